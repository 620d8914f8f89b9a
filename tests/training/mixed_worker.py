"""A case of torchrun_cases.py: ranks that differ (CPU budgets of 8 MiB and 3 MiB), planned with each rank
its own micro-batch and micro-steps, trained and verified; planted faults: a rank that weights by its own items,
a rank that skips its synchronising backward."""

from __future__ import annotations

import torch.distributed as dist

from autotune import api as pipeline
from autotune.devices import get_device
from autotune.planning.mixed import make_mixed_plan
from autotune.results.ranks import RankShare
from autotune.training import runner
from autotune.training.accumulate import Accumulator
from autotune.training.runner import run_plan
from autotune.workload import load_workload

BUDGETS, TARGET = ("8MiB", "3MiB"), 1800  # max micro-batches ~1341 and ~259: rank 0 one micro-step, rank 1 two


class LocalItems(Accumulator):
    """Fault: rank 1 weights each micro-batch by its share of its own items (the mean over its own samples, as a
    plain DDP loop does), and DDP averages the ranks: right only when every rank holds as many items."""

    def total_items(self, local: int) -> int:
        self.local = local
        return super().total_items(local)  # the collective still runs: the ranks stay paired

    def weight(self, n_items: int, total_items: int) -> float:
        return n_items / self.local if self.rank == 1 else super().weight(n_items, total_items)


class SkipsItsSync(Accumulator):
    """Fault: rank 0, which runs the fewest micro-steps, runs every one of them without synchronising, and stands
    in for its synchronising backward with zero gradients, as DDP's join() does for a rank out of data (so the
    other rank's all-reduce completes instead of hanging)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.rank == 0:  # every micro-step in the model's no_sync(), the last one too
            without_sync = self.sync.micro_step
            self.sync.micro_step = lambda last: without_sync(last=False)  # type: ignore[method-assign]

    def finish(self, noise):
        if self.rank == 0:
            self.model._match_all_reduce_for_bwd_pass()  # DDP's own zero all-reduce for a joined rank
        return super().finish(noise)


def verified(plan, workload, device, steps: int, accumulation: type[Accumulator]) -> list[dict]:
    """Every rank's checks (by name: passed, value, limit) for a run by ``plan`` with ``accumulation``."""
    try:
        runner.Accumulator = accumulation
        result = run_plan(plan, workload, device, steps=steps)
    finally:
        runner.Accumulator = Accumulator
    mine = {c.name: {"passed": c.passed, "value": c.value, "limit": c.limit, "message": c.message}
            for c in result.verification.checks}
    mine["passed"] = result.passed
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def fsdp_plan():
    """A mixed plan under FSDP, made by hand: ranks of unequal max micro-batches, in step."""
    shares = [RankShare(device="cpu", max_micro_batch=m, usable_bytes=60 * 2**20) for m in (300, 60)]
    return make_mixed_plan(500, shares, parallel="fsdp")


def case() -> dict:
    """The mixed plan, and every rank's checks for the correct accumulation and each planted fault; a mixed plan
    under FSDP."""
    mlp = load_workload("mlp")
    plan = pipeline.plan(TARGET, workload=mlp, device="cpu", memory_budget=",".join(BUDGETS))
    device = get_device("cpu", memory_budget=plan.budget_bytes_of(dist.get_rank()))
    sharded = fsdp_plan()
    return {
        "schedule": [list(r) for r in plan.schedule],
        "mixed": plan.mixed.to_dict() if plan.mixed is not None else None,
        "correct": verified(plan, mlp, device, 2, Accumulator),
        "local_items": verified(plan, mlp, device, 1, LocalItems),
        "skips_its_sync": verified(plan, mlp, device, 1, SkipsItsSync),
        "fsdp_schedule": [list(r) for r in sharded.schedule],
        "fsdp": verified(sharded, mlp, get_device("cpu", memory_budget=64 * 2**20), 1, Accumulator),
    }
