"""The caller's random state is theirs: autotune seeds only the generators it forks and gives back.

``torch.manual_seed`` seeds every device's generator. Before CUDA starts, the
seed it gives CUDA waits (torch keeps it pending and applies it when CUDA
starts), and the next ``torch.manual_seed`` replaces it: a tool that calls it
would hand the caller's GPU its own seed, unseen until the caller's training on
the GPU draws its first dropout mask. These tests watch that pending seed on a
machine whose CUDA has not started (a CPU-only one among them).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import autotune
from autotune.devices import get_device
from autotune.planning import make_plan
from autotune.training.runner import run_plan
from autotune.training.timing import Timing, compare_plans, time_plan
from autotune.workload import load_workload


def pending_cuda_seeds() -> list:
    """The seeds waiting for CUDA to start (as the functions that will apply them)."""
    return [call[0] if call else None for call in torch.cuda._lazy_seed_tracker.get_calls()]


@contextlib.contextmanager
def callers_seeds_kept():
    if torch.cuda.is_initialized():  # asked as the test runs: a GPU test before it may have started CUDA
        pytest.skip("CUDA has started: no seed of it is pending")
    torch.manual_seed(1234)  # the caller's seed: for the CPU now, for CUDA when it starts
    pending, rng = pending_cuda_seeds(), torch.get_rng_state()
    assert any(pending)
    yield
    assert pending_cuda_seeds() == pending, "a seed of autotune's replaced the caller's seed pending for CUDA"
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_probe_a_plan_in_a_store_and_a_run_leave_the_callers_seeds_alone(tmp_path):
    cpu = get_device("cpu", memory_budget=3_000_000)
    with callers_seeds_kept():
        store = f"sqlite:///{tmp_path / 'plans.db'}"
        plan = autotune.plan(64, probe="mlp", device=cpu, store=store)
        assert autotune.plan(64, probe="mlp", device=cpu, store=store).probe.from_store  # a confirm run
        autotune.probe("mlp", device="estimate", memory_budget="1GiB")
        run_plan(plan, load_workload("mlp"), cpu, steps=1)


def test_timing_plans_leaves_the_callers_seeds_alone():
    cpu, mlp = get_device("cpu", memory_budget=2**30), load_workload("mlp")
    timing = Timing(warmup=0, min_steps=2, max_steps=2)
    with callers_seeds_kept():
        time_plan(mlp, cpu, make_plan(16, 8), timing=timing)
        compare_plans(mlp, cpu, make_plan(16, 8), make_plan(16, 16), timing=timing)


def test_the_check_sees_a_seed_replaced():
    with pytest.raises(AssertionError, match="replaced the caller's seed"), callers_seeds_kept():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # what autotune must not do: the CPU's state comes back, CUDA's pending seed not


def test_on_a_gpu_the_devices_own_generator_is_forked_and_seeded(monkeypatch):
    # CPU generators stand in for CUDA's; torch's fork is watched for the devices it saves and restores.
    from autotune.devices.base import own_random_state

    cuda = [torch.Generator(), torch.Generator()]
    states = [g.get_state() for g in cuda]
    forked = []
    real_fork = torch.random.fork_rng
    monkeypatch.setattr(torch.cuda, "default_generators", tuple(cuda))
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: forked.append(devices) or real_fork(devices=[]))
    with own_random_state(torch.device("cuda", 1), 7):
        assert torch.equal(cuda[1].get_state(), torch.Generator().manual_seed(7).get_state())
    assert forked == [[1]]
    assert torch.equal(cuda[0].get_state(), states[0])  # another GPU's generator: not seeded
