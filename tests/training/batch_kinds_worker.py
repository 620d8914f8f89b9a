"""A case of torchrun_cases.py: graph and packed batches under DDP, each rank's share taken by the
workload's split."""

from __future__ import annotations

from autotune import api as pipeline
from autotune.devices import get_device
from autotune.training.runner import run_plan

from ..workload.batch_kinds import RUN_BUDGETS, graph_workload, packed_workload


def case() -> dict:
    """Each workload's per-rank batches, gradient error and failed checks, planned and run at 31 samples."""
    out = {}
    for make in (graph_workload, packed_workload):
        w = make(worst=True)
        device = get_device("cpu", memory_budget=RUN_BUDGETS[w.name])
        plan = pipeline.plan(31, workload=w, device=device)
        result = run_plan(plan, w, device, steps=2)
        v = result.verification
        out[w.name] = {"per_rank_batch": list(plan.per_rank_batch), "micro_steps": plan.accumulation_steps,
                       "error": v.gradient_relative_error, "failed": [c.name for c in v.failed]}
    return out
