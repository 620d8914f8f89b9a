"""Workloads: what autotune plans for, from a probe file, a built-in probe, or a model you already have.

Owns: Workload, loading probe specs, Workload.from_model, and the batch arithmetic every stage
shares (sizes, splitting, the n_i / N weight). May import: errors, units, options, log, torch.
"""

from __future__ import annotations

from ..options import BUILTIN_PROBES, DEFAULT_PROBE
from .batches import batch_size, item_weight, split_batch
from .core import Workload, default_optimizer
from .loading import load_workload

__all__ = ["BUILTIN_PROBES", "DEFAULT_PROBE", "Workload", "batch_size", "default_optimizer", "item_weight",
           "load_workload", "split_batch"]
