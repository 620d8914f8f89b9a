"""Planning: micro-batch x accumulation steps x ranks = exactly the target batch, as pure arithmetic.

Owns: the planner and the exports to frameworks' settings. May import: errors, units, options,
serial, results (never torch, numpy or pandas).
"""

from __future__ import annotations

from ..results.plan import Plan
from .mixed import make_mixed_plan, split_ranks
from .planner import make_plan, nearest_uniform_targets, world_size_from

__all__ = ["Plan", "make_mixed_plan", "make_plan", "nearest_uniform_targets", "split_ranks", "world_size_from"]
