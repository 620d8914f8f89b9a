"""Throughput tuning: exact candidates, real timings, pruned when they do not fit."""

from __future__ import annotations

import pytest
import torch

from autotune.devices import get_device
from autotune.planning.planner import make_plan
from autotune.training import tune as tune_module
from autotune.training.tune import candidate_sizes, tune


@pytest.mark.parametrize("target,max_micro,world,want", [
    (1024, 300, 1, [256, 205, 171, 147, 128, 114, 103, 94, 86, 79, 74, 69]),
    (64, 64, 1, [64, 32, 22, 16, 13, 11, 10, 8, 7, 6, 5, 4]),
    (1024, 48, 8, [43, 32, 26, 22, 19, 16, 15, 13, 12, 11, 10, 9]),
])
def test_candidates_are_exact_plans_from_the_largest_down(target, max_micro, world, want):
    sizes = candidate_sizes(target, max_micro, world_size=world, multiple_of=1, uniform=None)
    assert sizes == want
    for micro in sizes:
        assert make_plan(target, micro, world_size=world).micro_batch == micro


def test_tune_times_candidates_and_keeps_the_target(mlp, tmp_path):
    device = get_device("cpu", memory_budget=3_000_000)
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    plan = tune(mlp, device, 256, trials=4, steps=1, storage=storage)
    assert plan.target_batch == 256 and sum(map(sum, plan.schedule)) == 256
    t = plan.tuning
    assert t["storage"] == storage and t["trials"] == 4
    measured = [c for c in t["candidates"] if c["samples_per_s"] is not None]
    assert measured and all(c["samples_per_s"] > 0 for c in measured)
    assert t["chosen"]["micro_batch"] == plan.micro_batch
    assert t["chosen"]["samples_per_s"] == max(c["samples_per_s"] for c in measured)
    # The study lives in its storage: a second call resumes it.
    again = tune(mlp, device, 256, trials=2, steps=1, storage=storage)
    assert again.tuning["trials"] == 6


def test_candidates_that_run_out_of_memory_are_pruned(mlp, monkeypatch):
    real = tune_module.time_plan

    def time_plan(workload, device, plan, **kw):
        if plan.micro_batch > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(workload, device, plan, **kw)

    monkeypatch.setattr(tune_module, "time_plan", time_plan)
    plan = tune(mlp, get_device("cpu", memory_budget=3_000_000), 512, trials=8, steps=1)
    assert plan.micro_batch <= 100
    pruned = [c for c in plan.tuning["candidates"] if not c["fits"]]
    assert pruned and all("ran out of memory" in c["why"] and c["micro_batch"] > 100 for c in pruned)


def test_tune_needs_a_real_device(mlp):
    with pytest.raises(Exception, match="real device"):
        tune(mlp, get_device("estimate", memory_budget=2**30), 64)
