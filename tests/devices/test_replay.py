"""The allocation trace an estimate records, its replay through the allocator simulation, and what a probe
makes of the simulated figures (reserved peak deciding, release-and-retry flagged).

Sizes follow CUDACachingAllocator.cpp: requests round to 512 bytes; up to 1 MiB goes to the small pool in
2 MiB segments; larger requests under 10 MiB share 20 MiB segments; larger ones get their size rounded
to 2 MiB.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autotune.devices import EstimateDevice, get_device
from autotune.devices.meta import MetaKernels
from autotune.devices.replay import replay, replay_snapshot, snapshot_events
from autotune.devices.tracker import LiveStorageTracker
from autotune.probing.finder import find_max_micro_batch
from autotune.probing.fitrule import fit_rule_work
from autotune.workload import Workload

MiB = 2**20
GiB = 2**30


# -- the trace --------------------------------------------------------------------------------------------


def test_the_trace_has_exact_sizes_in_order_with_frees():
    tracker = LiveStorageTracker(record=True, kernel=MetaKernels())
    with tracker:
        a = torch.empty(1000, device="meta")  # 4000 bytes: unrounded in the trace
        b = torch.empty(10, 10, device="meta", dtype=torch.float16)
        c = a.view(10, 100)  # a view allocates nothing
        del a, c
        torch.empty(0, device="meta")  # nothing: CUDA hands out no block for 0 bytes
        del b
    sizes = [(n, s) for _, n, s in tracker.trace]
    assert sizes == [(4000, 0), (200, 0), (-1, 0), (-1, 0)]
    keys = [k for k, _, _ in tracker.trace]
    assert keys[2] == keys[0] and keys[3] == keys[1]  # frees name what they free


def test_a_resize_is_a_new_block_then_the_old_one_freed():
    tracker = LiveStorageTracker(record=True)
    with tracker:
        a = torch.empty(100, device="meta")
        a.resize_(1000)
    (k1, n1, _), (k2, n2, _), (k3, n3, _) = tracker.trace
    assert (n1, n2, n3) == (400, 4000, -1) and k3 == k1 != k2


def test_no_trace_unless_asked_and_workspaces_only_in_the_trace():
    assert LiveStorageTracker().trace is None
    tracker = LiveStorageTracker(record=True)
    key = tracker.device_alloc(5 * MiB)
    tracker.scratch([MiB, 0, 2 * MiB])
    tracker.device_free(key)
    assert [n for _, n, _ in tracker.trace] == [5 * MiB, MiB, 2 * MiB, -1, -1, -1]
    assert tracker.current_bytes == 0  # live bytes count tensors only


# -- the replay ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("events", "reserved", "allocated"), [
    ([(1, 1000, 0)], 2 * MiB, 1024),  # round_size 512s; small pool, one 2 MiB segment
    ([(1, 1000, 0), (2, 1000, 1)], 4 * MiB, 2048),  # another stream: another segment
    ([(1, 3 * MiB, 0), (2, 3 * MiB, 0)], 20 * MiB, 6 * MiB),  # large under 10 MiB: one shared 20 MiB segment
    # 10 MiB and more: rounded up to 2 MiB; the 1 MiB left is not split off (should_split: more than 1 MiB),
    # so the whole block counts as allocated
    ([(1, 11 * MiB, 0)], 12 * MiB, 12 * MiB),
    ([(1, 11 * MiB, 0), (1, -1, 0), (2, 11 * MiB, 0)], 12 * MiB, 12 * MiB),  # the cached block is reused
    ([(1, 4000, 0), (9, -1, 0)], 2 * MiB, 4096),  # a free of something never allocated is ignored
])
def test_replay_figures(events, reserved, allocated):
    r = replay(events, capacity=None)
    assert (r.reserved_peak, r.allocated_peak, r.retries, r.out_of_memory) == (reserved, allocated, 0, False)


def test_replay_under_a_capacity_retries_after_freeing_the_cache():
    # 12 MiB cached, then 16 MiB asked with 24 MiB in all: cudaMalloc fails, the cache is freed, one retry.
    events = [(1, 12 * MiB, 0), (1, -1, 0), (2, 16 * MiB, 0)]
    assert replay(events, capacity=None).reserved_peak == 28 * MiB
    r = replay(events, capacity=24 * MiB)
    assert (r.reserved_peak, r.allocated_peak, r.retries, r.out_of_memory) == (16 * MiB, 16 * MiB, 1, False)


def test_replay_that_runs_out_reports_the_unlimited_peak():
    r = replay([(1, 12 * MiB, 0), (2, 16 * MiB, 0)], capacity=24 * MiB)
    assert (r.reserved_peak, r.out_of_memory) == (28 * MiB, True)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_a_request_past_the_devices_address_space_runs_out_and_the_unlimited_replay_holds_it(conf):
    """2 GiB on a 1 GiB GPU: out of memory; replayed without a limit (a GPU large enough), an expandable segment
    needs address space for the request, not 1 1/8 of the 1 GiB device's memory."""
    r = replay([(1, 2 << 30, 0), (1, -1, 0)], capacity=1 << 30, conf=conf, device_total=1 << 30)
    assert r.out_of_memory and r.reserved_peak >= r.allocated_peak >= 2 << 30


def test_replay_reads_the_alloc_conf():
    # 30 MiB cached, then 10 MiB asked: split from the cached block, unless max_split_size_mb makes the
    # 30 MiB block oversize, which a smaller request may not take (get_free_block): a new 10 MiB segment.
    events = [(1, 30 * MiB, 0), (1, -1, 0), (2, 10 * MiB, 0)]
    assert replay(events, capacity=None).reserved_peak == 30 * MiB
    assert replay(events, capacity=None, conf="max_split_size_mb:20").reserved_peak == 40 * MiB


# -- a snapshot PyTorch recorded ------------------------------------------------------------------------------


def entry(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream}


def test_snapshot_events_take_completed_frees_and_blocks_live_before_recording():
    snapshot = {
        "segments": [{"device": 0, "address": 7000, "stream": 0, "blocks": [
            {"size": 512, "requested_size": 100, "state": "active_allocated"},  # live all along, untouched
            {"size": 1536, "state": "inactive"}]}],
        "device_traces": [[
            entry("free_requested", 5000, 300),  # allocated before recording began
            entry("free_completed", 5000, 300),
            entry("alloc", 100, 4000),
            entry("segment_alloc", 100, 2 * MiB),
            entry("free_requested", 100, 4000),
            entry("free_completed", 100, 4000),
            entry("alloc", 100, 8000, stream=11),
        ]],
    }
    assert snapshot_events(snapshot) == [(5000, 300, 0), (7000, 100, 0), (5000, -1, 0), (100, 4000, 0),
                                         (100, -1, 0), (100, 8000, 11)]
    r = replay_snapshot(snapshot)
    # at the end: the untouched block (512) and 8000 rounded to 8192, on stream 11 in a segment of its own
    assert (r.allocated_peak, r.reserved_peak) == (512 + 8192, 4 * MiB)


def test_snapshot_without_completions_uses_the_requested_frees():
    trace = [entry("alloc", 1, 3 * MiB), entry("free_requested", 1, 3 * MiB), entry("alloc", 2, 3 * MiB)]
    assert snapshot_events({"device_traces": [trace]}) == [(1, 3 * MiB, 0), (1, -1, 0), (2, 3 * MiB, 0)]


# -- the estimate's reserved peak is the replay's -----------------------------------------------------------------


def mlp():
    from autotune.workload import load_workload

    return load_workload("mlp")


def test_the_estimate_peak_is_the_replay_of_its_own_trace(monkeypatch):
    from autotune.devices import estimate as estimate_mod

    made = []
    real = estimate_mod.LiveStorageTracker
    monkeypatch.setattr(estimate_mod, "LiveStorageTracker", lambda **kw: made.append(real(**kw)) or made[-1])
    dev = get_device("estimate", memory_budget=8 * GiB)
    _, m = dev.measure(fit_rule_work(mlp(), 16))
    r = replay(made[-1].trace, capacity=dev.capacity_bytes())
    assert (m.peak_bytes, m.allocated_peak_bytes, m.alloc_retries) == (r.reserved_peak, r.allocated_peak, 0)
    assert m.peak_bytes > m.allocated_peak_bytes > m.tracked_peak_bytes
    assert 0 < m.replay_seconds <= m.seconds


def test_without_the_simulation_the_live_bytes_rounded_decide():
    dev = get_device("estimate", memory_budget=8 * GiB)
    off = EstimateDevice(**{**dev._settings(), "simulate": False})
    _, m = off.measure(fit_rule_work(mlp(), 16))
    assert (m.allocated_peak_bytes, off.round_to) == (None, 512)
    assert m.peak_bytes == m.tracked_peak_bytes


def test_a_conf_torch_refuses_is_refused_naming_the_variable(monkeypatch):
    from autotune.errors import BadInput

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1")
    with pytest.raises(BadInput, match=r"^PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:1' cannot be used: .*too small"):
        get_device("estimate", memory_budget=8 * GiB)


def test_cuda_malloc_async_is_not_simulated_and_says_so(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    dev = get_device("estimate", memory_budget=8 * GiB)
    assert not dev.simulates and "cudaMallocAsync" in dev.describe().note
    _, m = dev.measure(fit_rule_work(mlp(), 4))
    assert m.allocated_peak_bytes is None and any("cudaMallocAsync" in n for n in m.notes)


# -- release-and-retry in the probe ----------------------------------------------------------------------------


class Growing(nn.Module):
    """A temporary that grows every call: each micro-step's block is too big for the cached one."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        scratch = torch.empty(x.shape[0] * (16 + 4 * self.calls) * MiB // 4, device=x.device)  # 20, 24, 28, 32 x
        return (x * self.w).sum() + scratch.sum() * 0


def growing_workload():
    return Workload(name="growing", model=Growing, batch=lambda n, g: torch.zeros(n, 4),
                    loss=lambda m, b: m(b), optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def test_a_size_that_fits_only_through_release_and_retry_is_flagged():
    # Capacity 100 MiB after the allowance: at micro-batch 2 the scratch blocks are 40, 48, 56, 64 MiB;
    # each new one would add to the cached ones past 100 MiB, so the cache is freed first.
    device = EstimateDevice(capacity=740 * MiB, allowance=640 * MiB)
    result = find_max_micro_batch(growing_workload(), device, margin=0.0, max_batch=2)
    assert result.max_micro_batch == 2
    assert result.alloc_retries and result.alloc_retries > 0
    assert result.peak_bytes <= result.usable_bytes
    assert any("fits only through release-and-retry" in note for note in result.notes)
    assert result.trials[-1].retries == result.alloc_retries


def test_no_flag_without_retries():
    device = EstimateDevice(capacity=4 * GiB, allowance=640 * MiB)
    result = find_max_micro_batch(growing_workload(), device, margin=0.0, max_batch=2)
    assert result.alloc_retries == 0
    assert not any("release-and-retry" in note for note in result.notes)


# -- exact against a brute-force search over simulated runs --------------------------------------------------


class Wide(nn.Module):
    """Per sample a 1 MiB row: tensors cross the small-pool and 10 MiB segment thresholds as the batch grows."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(256 * 1024))

    def forward(self, x):
        return (x * self.w).relu().sum()


def wide_workload():
    return Workload(name="wide", model=Wide, batch=lambda n, g: torch.zeros(n, 256 * 1024), loss=lambda m, b: m(b))


def simulated_fit(device, workload, usable, batch) -> bool:
    """Whether the simulated fit-rule run of ``batch`` samples fits."""
    from autotune.probing.fitrule import run_trial

    return run_trial(device, workload, batch, usable, source="estimate").fits


@pytest.mark.slow
@pytest.mark.parametrize(("name", "budget"), [("wide", 760), ("gpt", 680)])
def test_estimate_answers_equal_a_brute_force_search_over_simulated_runs(name, budget):
    from autotune.workload import load_workload

    workload = wide_workload() if name == "wide" else load_workload(name)
    device = get_device("estimate:A100-40GB", memory_budget=budget * MiB)
    result = find_max_micro_batch(workload, device, max_batch=100_000)
    best, usable = result.max_micro_batch, result.usable_bytes
    # the largest size in [1, 2 * best + 2] that fits is ``best``: it fits, and every size above it, tried one
    # by one, does not
    assert best > 0 and simulated_fit(device, workload, usable, best)
    assert [b for b in range(best + 1, 2 * best + 3) if simulated_fit(device, workload, usable, b)] == []


# -- a probe that confirms on a device whose caching allocator decides ---------------------------------------


class SimulatedGpu:
    """A 'real' device whose measurements are a simulating estimate's: exactly what the estimate predicts.
    Drives the probe's confirm path with allocator figures (a real GPU cannot run here)."""

    estimated = False
    torch_device = torch.device("meta")

    def __init__(self, capacity: int):
        self.inner = EstimateDevice(capacity=capacity, allowance=0, name="gpu")
        self.name = "gpu0"  # not cuda:N: the probe would fork a CUDA generator

    def capacity_bytes(self):
        return self.inner.capacity_bytes()

    def measure(self, work, *, enforce_capacity=True):
        return self.inner.measure(work)

    def cleanup(self):
        pass

    def describe(self):
        from dataclasses import replace

        return replace(self.inner.describe(), kind="cuda", estimated=False)

    def estimator(self):
        return EstimateDevice(**self.inner._settings())


@pytest.mark.slow
def test_a_probe_confirming_on_a_gpu_records_real_and_simulated_allocator_figures():
    from autotune.workload import load_workload

    result = find_max_micro_batch(load_workload("gpt"), SimulatedGpu(60 * MiB), max_batch=100_000)
    estimates = {t.batch: t for t in result.trials if t.source == "estimate"}
    real = [t for t in result.trials if t.source == "real"]
    assert real and real[-1].batch == result.max_micro_batch
    assert result.max_micro_batch in estimates  # the simulation's figures beside the real ones at the answer
    assert result.predicted_allocated_peak_bytes == estimates[result.max_micro_batch].allocated_bytes
    assert result.allocated_peak_bytes == real[-1].allocated_bytes == result.predicted_allocated_peak_bytes
    assert result.estimate_error == 0.0 and result.real_runs == 1  # the simulation checked the next size already
    line = result.allocator_line()
    assert line.startswith("caching allocator (measured): reserved") and "; simulated: reserved" in line
