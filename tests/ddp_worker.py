"""Run under torchrun by tests/test_distributed.py: the runner with planted DDP faults."""

from __future__ import annotations

import contextlib
import json
import sys

from rank_exit import run_then_exit  # tests/ is this script's folder

from autotune import api as pipeline
from autotune.devices import get_device
from autotune.training import distributed, runner
from autotune.training.accumulate import Accumulator
from autotune.training.runner import run_plan
from autotune.workload import load_workload


class SyncsEveryMicroStep(Accumulator):
    """Fault: no no_sync(): DDP all-reduces after every micro-step (right result, k rounds)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "no_sync": contextlib.nullcontext})


class NoWorldFactor(Accumulator):
    """Fault: the loss is not multiplied by the world size, so DDP's average shrinks the gradient."""

    def weight(self, n_items, total_items):
        return n_items / total_items


def main() -> None:
    with distributed.process_group(60):
        mlp = load_workload("mlp")
        device = get_device("cpu", memory_budget=int(sys.argv[1]))
        plan = pipeline.plan(int(sys.argv[2]), workload=mlp, device=device)
        out = {"schedule": [list(r) for r in plan.schedule]}
        for name, cls in (("correct", Accumulator), ("no_sync_missing", SyncsEveryMicroStep),
                          ("no_world_factor", NoWorldFactor)):
            runner.Accumulator = cls  # the accumulation the runner trains and verifies with
            result = run_plan(plan, mlp, device, steps=3)
            out[name] = {c["name"]: {"passed": c["passed"], "value": c["value"], "message": c["message"]}
                         for c in result.verification.to_dict()["checks"]}
            out[name]["passed"] = result.passed
        if distributed.rank() == 0:
            print(json.dumps(out))


if __name__ == "__main__":
    run_then_exit(main)
