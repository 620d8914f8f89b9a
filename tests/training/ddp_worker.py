"""A case of torchrun_cases.py: the runner, under DDP, with planted faults."""

from __future__ import annotations

import contextlib

from autotune import api as pipeline
from autotune.devices import get_device
from autotune.training import runner
from autotune.training.accumulate import Accumulator
from autotune.training.runner import run_plan
from autotune.training.sync import Sync
from autotune.workload import load_workload


def with_no_sync(kwargs: dict, no_sync) -> dict:
    """The runner's keywords for an Accumulator, its Sync part replaced by one with ``no_sync``."""
    parts = [p for p in kwargs.get("parts", ()) if not isinstance(p, Sync)]
    return {**kwargs, "parts": [*parts, Sync(no_sync=no_sync)]}


class SyncsEveryMicroStep(Accumulator):
    """Fault: no no_sync(): DDP all-reduces after every micro-step (right result, k rounds)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **with_no_sync(kwargs, contextlib.nullcontext))


class NoWorldFactor(Accumulator):
    """Fault: the loss is not multiplied by the world size, so DDP's average shrinks the gradient."""

    def weight(self, n_items, total_items):
        return n_items / total_items


BUDGET, TARGET = 2_600_000, 255  # max micro-batch ~112 with DDP's buckets: 255 -> 2 micro-steps per rank


def checks(plan, workload, device, steps: int, faults: dict) -> dict:
    """The run's checks, by name, for the correct accumulation ("correct") and for each planted fault."""
    out: dict = {}
    try:
        for name, cls in {"correct": Accumulator, **faults}.items():
            runner.Accumulator = cls  # the accumulation the runner trains and verifies with
            result = run_plan(plan, workload, device, steps=steps)
            out[name] = {c["name"]: {"passed": c["passed"], "value": c["value"], "message": c["message"]}
                         for c in result.verification.to_dict()["checks"]}
            out[name]["passed"] = result.passed
    finally:
        runner.Accumulator = Accumulator
    return out


def case() -> dict:
    """The plan's checks for the correct accumulation and for each planted fault."""
    mlp = load_workload("mlp")
    device = get_device("cpu", memory_budget=BUDGET)
    plan = pipeline.plan(TARGET, workload=mlp, device=device)
    return {"schedule": [list(r) for r in plan.schedule],
            **checks(plan, mlp, device, 3, {"no_sync_missing": SyncsEveryMicroStep, "no_world_factor": NoWorldFactor})}
