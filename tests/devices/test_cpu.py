"""The CPU device: the fit rule measured by the live-storage tracker, exactly."""

from __future__ import annotations

import gc

import pytest
import torch

from autotune.devices import CpuDevice, EstimateDevice
from autotune.devices.cpu import ram_bytes
from autotune.devices.oom import is_oom
from autotune.probing.fitrule import fit_rule_work
from autotune.workload.bookkeeping import noise_buffer

GiB = 1024**3
FLOAT = 4


def param_bytes(workload) -> int:
    return sum(p.untyped_storage().nbytes() for p in workload.model().parameters())


@pytest.fixture(scope="module")
def mlp_workload():
    from autotune.workload import load_workload

    return load_workload("mlp")


@pytest.fixture(scope="module")
def measured(mlp_workload):
    """The mlp fit rule at a few batch sizes, measured once for the module."""
    device = CpuDevice(memory_budget=GiB)
    return {b: device.measure(fit_rule_work(mlp_workload, b))[1] for b in (1, 512)}


def test_capacity_is_the_budget_or_the_available_ram():
    assert CpuDevice(memory_budget=3 * GiB).capacity_bytes() == 3 * GiB
    total, available = ram_bytes()
    assert 0 < available <= total
    assert 0 < CpuDevice().capacity_bytes() <= total


def test_describe():
    desc = CpuDevice(memory_budget=3 * GiB).describe().to_dict()
    assert (desc["name"], desc["kind"], desc["estimated"], desc["capacity_bytes"]) == ("cpu", "cpu", False, 3 * GiB)
    assert desc["summary"] == "cpu, capacity 3.0 GiB (memory budget)"
    assert CpuDevice().describe().capacity_source == "available RAM"
    assert desc["budget_bytes"] == 3 * GiB and CpuDevice().describe().budget_bytes is None


@pytest.mark.parametrize("batch", [1, 512])
def test_fit_rule_breakdown_for_mlp_with_adamw(mlp_workload, measured, batch):
    m = measured[batch]
    p = param_bytes(mlp_workload)
    assert p == (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10) * FLOAT  # 340_008
    # AdamW keeps exp_avg and exp_avg_sq (one of each per parameter, same size)
    # and a 0-dim float32 ``step`` per parameter tensor: 6 tensors x 4 bytes.
    # Both optimizer steps of the fit rule run with every gradient still live
    # (zero_grad comes after step), and the second runs with the state live, so
    # the peak sees all of it, at small and at large batches alike.
    assert m.breakdown["parameters"] == p
    assert m.breakdown["gradients"] == p
    assert m.breakdown["optimizer_state"] == 2 * p + 6 * FLOAT
    assert m.breakdown["activations"] == m.peak_bytes - 4 * p - 6 * FLOAT
    assert sum(m.breakdown.values()) == m.peak_bytes == m.tracked_peak_bytes
    assert max(m.timeline) == m.peak_bytes


def test_small_batches_peak_in_the_optimizer_step_large_ones_in_activations(measured):
    # The design's "piecewise, not linear" curve: at batch 1 the peak is set by
    # the optimizer step: AdamW's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``
    # for the 256x256 weight holds two 256 KiB temporaries (sqrt, division) while
    # the loop variable ``denom`` still holds the previous parameter's (the
    # 256-float bias of the first layer). The runner's noise-measurement buffer is live throughout.
    noise = noise_buffer(6, "meta").numel() * FLOAT
    assert measured[1].breakdown["activations"] == 2 * 256 * 256 * FLOAT + 256 * FLOAT + noise
    assert measured[512].breakdown["activations"] > measured[1].breakdown["activations"]


def test_measurements_repeat_exactly(mlp_workload, measured):
    _, again = CpuDevice(memory_budget=GiB).measure(fit_rule_work(mlp_workload, 512))
    assert (again.peak_bytes, again.breakdown, again.timeline) == (
        measured[512].peak_bytes, measured[512].breakdown, measured[512].timeline)


def test_capacity_equal_to_the_peak_fits_one_byte_less_is_an_emulated_oom(mlp_workload, measured):
    peak = measured[512].peak_bytes
    _, m = CpuDevice(memory_budget=peak).measure(fit_rule_work(mlp_workload, 512))
    assert m.peak_bytes == peak
    message = rf"emulated .*\({peak} bytes\) live, capacity is .*\({peak - 1} bytes\)"
    with pytest.raises(torch.OutOfMemoryError, match=message):
        CpuDevice(memory_budget=peak - 1).measure(fit_rule_work(mlp_workload, 512))


def test_capacity_not_enforced_measures_past_it(mlp_workload, measured):
    _, m = CpuDevice(memory_budget=1024).measure(fit_rule_work(mlp_workload, 512), enforce_capacity=False)
    assert m.peak_bytes == measured[512].peak_bytes > 1024


def test_an_oom_leaves_nothing_tracked_behind(mlp_workload):
    seen = {}
    fit = fit_rule_work(mlp_workload, 512)

    def work(session):
        seen["tracker"] = session.tracker
        return fit(session)

    with pytest.raises(torch.OutOfMemoryError) as info:
        CpuDevice(memory_budget=2 * 1024**2).measure(work)
    assert is_oom(info.value)
    assert seen["tracker"].current_bytes > 0  # the traceback still holds the model and batch
    del info
    gc.collect()
    assert seen["tracker"].current_bytes == 0


def test_other_errors_propagate_unchanged():
    def work(session):
        torch.ones(3) @ torch.ones(4)

    with pytest.raises(RuntimeError, match="size mismatch|shapes cannot be multiplied|inconsistent") as info:
        CpuDevice(memory_budget=GiB).measure(work)
    assert not is_oom(info.value)


def test_host_side_building_is_not_counted():
    def work(session):
        model = session.model(lambda: torch.nn.Linear(100, 10))  # built on the host, then counted
        x = session.batch(lambda size, g: torch.randn(size, 100, generator=g), 7, torch.Generator())
        with session.tracker.paused():
            torch.ones(10**6)  # host work: not counted
        return model, x

    (model, x), m = CpuDevice(memory_budget=GiB).measure(work)
    assert m.peak_bytes == (100 * 10 + 10) * FLOAT + 7 * 100 * FLOAT
    assert m.breakdown["parameters"] == (100 * 10 + 10) * FLOAT


def test_estimator_is_an_exact_cpu_estimate():
    est = CpuDevice(memory_budget=3 * GiB).estimator()
    assert isinstance(est, EstimateDevice) and est.estimated
    assert (est.capacity_bytes(), est.round_to, est.cuda_like, est.allowance) == (3 * GiB, 1, False, 0)
