"""Each rank's speed for a mixed plan: timed on a GPU of the job, a roofline estimate for a GPU by name, unknown
elsewhere (a CPU's budget emulates memory, not speed)."""

from __future__ import annotations

import torch

from autotune.devices import get_device
from autotune.training import ranks
from autotune.training.timing import Timing
from autotune.workload import load_workload


class FakeGpu:
    """A GPU of this job, as far as choosing how to know its speed goes (its timing is stood in for)."""

    estimated = False
    torch_device = torch.device("cuda", 1)
    name = "cuda:1"

    def describe(self):
        return get_device("cpu").describe()


def test_a_gpu_of_the_job_is_timed_a_gpu_by_name_estimated_anything_else_unknown(monkeypatch):
    mlp = load_workload("mlp")
    timed = []
    monkeypatch.setattr(ranks, "measured_seconds_per_sample", lambda wl, dev, b: timed.append(b) or 0.25)
    assert ranks.speed(mlp, FakeGpu(), 64) == (0.25, "measured") and timed == [64]
    seconds, how = ranks.speed(mlp, get_device("estimate:T4-16GB"), 64)
    assert how == "roofline" and seconds is not None and seconds > 0
    assert ranks.speed(mlp, get_device("cpu"), 64) == (None, None)
    assert ranks.speed(mlp, get_device("estimate", memory_budget=2**34), 64) == (None, None)
    assert timed == [64]  # only the GPU of the job was timed


def test_timing_a_micro_step_gives_seconds_per_sample():
    quick = Timing(warmup=1, min_steps=2, max_steps=3, threshold=0.5, budget_s=1.0)
    seconds = ranks.measured_seconds_per_sample(load_workload("mlp"), get_device("cpu"), 32, timing=quick)
    assert 0 < seconds < 1


def test_outside_a_process_group_a_rank_gathers_only_itself():
    assert ranks.gather_objects({"x": 1}) == [{"x": 1}]
