"""The contract every device backend keeps (cpu, estimates, cuda with a fake driver).

Each backend gets the same checks. The work only makes tensors with plain
torch calls, which every backend can count: the CPU for real, the estimates as
fake tensors, the fake CUDA device as host tensors its tracker sees (moving to
a real GPU cannot run here). Backends that can move a model also run the fit
rule.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from autotune.devices import CpuDevice, CudaDevice, get_device
from autotune.devices.oom import is_oom
from autotune.devices.tracker import CATEGORIES
from autotune.probing.fitrule import fit_rule_work
from autotune.results.device import DeviceInfo
from autotune.workload import load_workload

from .fakes import FakeCuda, FakeNvml

GiB = 1024**3

BACKENDS = {
    "cpu": lambda: CpuDevice(memory_budget=GiB),
    "cpu-estimator": lambda: CpuDevice(memory_budget=GiB).estimator(),
    "estimate": lambda: get_device("estimate", memory_budget=24 * GiB),
    "cuda-fake": lambda: CudaDevice(0, cuda=FakeCuda(), nvml=FakeNvml()),
}
MOVES_TENSORS = {"cpu", "cpu-estimator", "estimate"}  # a fake CUDA device cannot .to("cuda")
KINDS = {"cpu": "cpu", "cpu-estimator": "estimate", "estimate": "estimate", "cuda-fake": "cuda"}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return request.param, BACKENDS[request.param]()


def plain_work(session):
    a = torch.ones(128, 64)
    b = a @ torch.ones(64, 32)
    c = b.relu().sum(dim=0)
    del a, b
    return tuple(c.shape)


def test_device_contract(backend):
    key, dev = backend

    assert dev.capacity_bytes() > 0
    info = dev.describe()
    desc = info.to_dict()
    again = DeviceInfo.from_dict(json.loads(json.dumps(desc)), kind="ProbeResult", source="x.json")
    assert again == info  # results carry it: plain data that reads back whole
    assert {"name", "kind", "estimated", "summary", "capacity_bytes"} <= set(desc)
    assert desc["name"] == dev.name
    assert desc["kind"] == KINDS[key]
    assert desc["estimated"] is dev.estimated is (key != "cpu" and key != "cuda-fake")
    assert desc["capacity_bytes"] == dev.capacity_bytes()
    assert isinstance(desc["summary"], str) and desc["summary"]

    result, m = dev.measure(plain_work)
    assert result == (32,)
    assert m.peak_bytes >= 0 and m.seconds >= 0
    assert m.tracked_peak_bytes > 0
    assert tuple(m.breakdown) == CATEGORIES
    assert sum(m.breakdown.values()) == m.tracked_peak_bytes
    assert max(m.timeline) == m.tracked_peak_bytes

    est = dev.estimator()
    assert est.estimated is True
    assert est.capacity_bytes() > 0
    assert est.estimator().estimated is True


def test_an_oom_in_the_work_propagates_and_leaves_nothing_tracked(backend):
    _, dev = backend
    seen = {}

    def work(session):
        seen["tracker"] = session.tracker
        held = [torch.ones(1000) for _ in range(3)]  # noqa: F841 - live when the OOM comes
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB")

    error = None
    try:
        dev.measure(work)
    except Exception as exc:  # noqa: BLE001 - what comes out is what is checked
        error = exc
    assert error is not None and is_oom(error)
    assert seen["tracker"].current_bytes > 0  # the traceback still holds the work's tensors
    del error
    dev.cleanup()
    assert seen["tracker"].current_bytes == 0


@pytest.mark.parametrize("key", sorted(MOVES_TENSORS))
def test_fit_rule_on_every_backend_that_moves_tensors(key):
    dev = BACKENDS[key]()
    _, m = dev.measure(fit_rule_work(load_workload("mlp"), 8))
    assert sum(m.breakdown.values()) == m.tracked_peak_bytes
    if m.allocated_peak_bytes is None:  # no caching allocator: the live bytes decide
        assert m.peak_bytes == m.tracked_peak_bytes and m.alloc_retries is None
    else:  # a (simulated) caching allocator: reserved >= allocated >= the live tensors
        assert m.peak_bytes >= m.allocated_peak_bytes >= m.tracked_peak_bytes and m.alloc_retries == 0
    assert m.breakdown["parameters"] > 0 and m.breakdown["gradients"] > 0 and m.breakdown["optimizer_state"] > 0
    gc.collect()
