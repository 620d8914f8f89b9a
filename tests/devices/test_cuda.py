"""CUDA and NVML logic, tested on the CPU with fakes; one real-GPU section behind the ``gpu`` marker.

``CudaDevice`` and ``list_devices`` take the ``torch.cuda``-like object and the
NVML facade as arguments, so capacity, measurement bookkeeping and device
naming are all checked here. What cannot run without a GPU: ``Session.move``
and ``Session.model`` on a CUDA device (they call ``.to("cuda")``), so the
fake-allocator measurements use work that only drives the fake's counters.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from autotune.devices import CpuDevice, CudaDevice, EstimateDevice, get_device, list_devices
from autotune.devices.nvml import GpuInfo, Nvml, load_nvml
from autotune.devices.oom import is_oom
from autotune.errors import BadInput, DeviceError

from .fakes import FakeCuda, FakeNvml

GiB = 1024**3
MiB = 1024**2
OWN_PID = os.getpid()
HAS_GPU = torch.cuda.is_available()


# -- Nvml against a fake pynvml module ----------------------------------------------


def fake_pynvml(*, names=b"NVIDIA H100 80GB HBM3", procs_error: Exception | None = None):
    calls = []

    def procs(handle):
        if procs_error is not None:
            raise procs_error
        return [
            SimpleNamespace(pid=111, usedGpuMemory=8 * GiB),
            SimpleNamespace(pid=OWN_PID, usedGpuMemory=3 * GiB),
            SimpleNamespace(pid=222, usedGpuMemory=10 * GiB),
            SimpleNamespace(pid=333, usedGpuMemory=None),  # not available (e.g. WDDM): counted as 0
        ]

    return SimpleNamespace(
        calls=calls,
        nvmlInit=lambda: calls.append("init"),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetName=lambda h: names,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * GiB, free=55 * GiB, used=25 * GiB),
        nvmlDeviceGetComputeRunningProcesses=procs,
    )


def test_nvml_reads_other_processes_and_leaves_out_our_own():
    module = fake_pynvml()
    nvml = Nvml(module)
    assert module.calls == ["init"]
    assert nvml.driver_version() == "550.54.15"
    assert nvml.device_count() == 2
    info = nvml.info(1, own_pid=OWN_PID)
    assert info == GpuInfo(index=1, name="NVIDIA H100 80GB HBM3", total_bytes=80 * GiB, free_bytes=55 * GiB,
                           used_bytes=25 * GiB, other_processes=((111, 8 * GiB), (222, 10 * GiB), (333, 0)))
    assert info.other_process_bytes == 18 * GiB
    # Seen from process 111, the others are us and 222 (and 333).
    assert Nvml(fake_pynvml()).info(0, own_pid=111).other_process_bytes == 13 * GiB


def test_nvml_without_process_listing_still_reports_memory():
    nvml = Nvml(fake_pynvml(names="A100", procs_error=RuntimeError("NVML_ERROR_NOT_SUPPORTED")))
    info = nvml.info(0, own_pid=OWN_PID)
    assert (info.name, info.free_bytes, info.other_processes) == ("A100", 55 * GiB, ())


@pytest.mark.skipif(HAS_GPU, reason="checks the no-driver path")
def test_load_nvml_without_a_driver_says_why():
    nvml, why = load_nvml()
    assert nvml is None
    assert "NVML" in why or "pynvml" in why


# -- capacity ----------------------------------------------------------------------------


def test_capacity_without_nvml_is_mem_get_info_plus_reserved():
    cuda = FakeCuda(free=70 * GiB, allocated=1 * GiB, cached=1 * GiB)
    dev = CudaDevice(0, cuda=cuda, nvml=None)
    assert dev.capacity_bytes() == 72 * GiB  # free + this process's 2 GiB reserved
    desc = dev.describe().to_dict()
    assert "mem_get_info" in desc["note"] and "NVML not used" in desc["note"]
    assert "mem_get_info" in desc["capacity_source"]
    assert (desc["driver"], desc["other_processes"], desc["model"]) == (None, None, "Fake H100")


def test_capacity_with_nvml_is_nvml_free_plus_reserved():
    cuda = FakeCuda(free=1 * GiB, allocated=2 * GiB)  # mem_get_info disagrees: NVML must win
    nvml = FakeNvml(free=60 * GiB)
    dev = CudaDevice(1, cuda=cuda, nvml=nvml)
    assert dev.capacity_bytes() == 62 * GiB
    assert nvml.asked == [(1, OWN_PID)]
    desc = dev.describe().to_dict()
    assert desc["note"] is None
    assert desc["capacity_source"] == "NVML free memory + this process's reserved memory"
    assert desc["other_processes"] == [[111, 8 * GiB], [222, 10 * GiB]]  # plain JSON data: lists
    assert (desc["driver"], desc["model"], desc["name"], desc["free_bytes"]) == (
        "550.54.15", "NVML GPU 1", "cuda:1", 60 * GiB)


@pytest.mark.parametrize(
    ("budget", "capacity", "source"),
    [
        (None, 62 * GiB, "NVML free memory + this process's reserved memory"),
        (40 * GiB, 40 * GiB, "memory budget"),
        (62 * GiB, 62 * GiB, "memory budget"),
        (100 * GiB, 62 * GiB, "NVML free memory + this process's reserved memory"),
    ],
)
def test_memory_budget_caps_the_capacity(budget, capacity, source):
    dev = CudaDevice(0, memory_budget=budget, cuda=FakeCuda(allocated=2 * GiB), nvml=FakeNvml(free=60 * GiB))
    assert dev.capacity_bytes() == capacity
    assert dev.describe().capacity_source == source
    assert dev.describe().budget_bytes == (budget if source == "memory budget" else None)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-driver path")
def test_nvml_that_cannot_load_falls_back_to_mem_get_info():
    dev = CudaDevice(0, cuda=FakeCuda(free=30 * GiB))  # nvml=True: the real loader, no driver here
    assert dev.capacity_bytes() == 30 * GiB
    assert "NVML could not load" in dev.describe().note


def test_estimator_stands_in_for_this_gpu(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    dev = CudaDevice(1, cuda=FakeCuda(allocated=2 * GiB, capability=(8, 6)), nvml=FakeNvml(free=60 * GiB))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # read when the device was made
    est = dev.estimator()
    assert isinstance(est, EstimateDevice) and est.estimated
    assert (est.name, est.capacity_bytes(), est.round_to, est.cuda_like, est.simulates) == (
        "estimate (cuda:1)", 62 * GiB, 1, True, True)
    assert (est.target.capability, est.device_total, est.alloc_conf) == ((8, 6), 80 * GiB, "expandable_segments:True")
    assert est.allocator is not None and est.allocator.expandable_segments
    assert dev.describe().allocator_conf == "expandable_segments:True"
    assert dev.describe().compute_capability == "8.6"


# -- measurement with the allocator's statistics ------------------------------------------


def allocator_work(cuda):
    def work(session):
        cuda.calls.append("work")
        cuda.alloc(3 * GiB)
        cuda.free_(1 * GiB)
        cuda.alloc(512 * MiB)  # from the cache: no new reservation
        cuda.free_(2 * GiB + 512 * MiB)
        host = torch.ones(3)  # a tensor the tracker sees (rounded as CUDA would)
        return session, host

    return work


def test_measure_reports_the_reserved_peak_of_the_work_alone():
    # Before: a 10 GiB peak from an earlier trial and 1 GiB cached (too small
    # for the work's 3 GiB block). Without empty_cache the cached GiB would
    # count; without the reset, the old peak.
    cuda = FakeCuda(allocated=1 * GiB, cached=1 * GiB, peak=10 * GiB)
    dev = CudaDevice(0, cuda=cuda, nvml=FakeNvml())
    cuda.calls.clear()
    (session, _), m = dev.measure(allocator_work(cuda))
    assert m.peak_bytes == 1 * GiB + 3 * GiB
    assert cuda.calls == ["empty_cache", "synchronize", "reset_peak_memory_stats", "work",
                          f"alloc {3 * GiB}", f"free {1 * GiB}", f"alloc {512 * MiB}", f"free {2 * GiB + 512 * MiB}",
                          "synchronize", "max_memory_reserved"]
    assert m.tracked_peak_bytes == 3 * 4  # exact bytes: the allocator's rounding is in the reserved peak
    assert sum(m.breakdown.values()) == m.tracked_peak_bytes
    assert m.allocated_peak_bytes == 1 * GiB + 3 * GiB  # what the tensors held at most
    assert m.alloc_retries == 0
    assert session.cuda_like and session.torch_device == torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("fault", "peak"),
    [("cleanup", 5 * GiB), ("reset_peak_memory_stats", 10 * GiB)],
)
def test_peak_check_catches_a_missing_empty_cache_or_reset(monkeypatch, fault, peak):
    cuda = FakeCuda(allocated=1 * GiB, cached=1 * GiB, peak=10 * GiB)
    dev = CudaDevice(0, cuda=cuda, nvml=FakeNvml())
    monkeypatch.setattr(dev if fault == "cleanup" else cuda, fault, lambda *args: None)
    _, m = dev.measure(allocator_work(cuda))
    assert m.peak_bytes == peak != 4 * GiB


def cached_then_grown(cuda):
    def work(session):
        cuda.alloc(1 * GiB)  # kept
        cuda.alloc(1 * GiB)
        cuda.free_(1 * GiB)  # cached: 1 GiB
        cuda.alloc(3 * GiB // 2)  # too big for the cached GiB: a new block
        cuda.free_(3 * GiB // 2)

    return work


def test_measure_records_the_allocated_peak_beside_the_reserved_one():
    cuda = FakeCuda()
    _, m = CudaDevice(0, cuda=cuda, nvml=FakeNvml()).measure(cached_then_grown(cuda))
    # reserved: 1 kept + 1 cached + 1.5 new; allocated: 1 kept + 1.5 new
    assert (m.peak_bytes, m.allocated_peak_bytes, m.alloc_retries) == (7 * GiB // 2, 5 * GiB // 2, 0)


def test_measure_counts_only_the_works_own_release_and_retries():
    # Three retries happened before (torch never resets the counter); with 3 GiB the new
    # 1.5 GiB block needs the cached GiB freed first: one retry of the work's own.
    cuda = FakeCuda(limit=3 * GiB, retries=3)
    _, m = CudaDevice(0, cuda=cuda, nvml=FakeNvml()).measure(cached_then_grown(cuda))
    assert (m.peak_bytes, m.allocated_peak_bytes, m.alloc_retries) == (5 * GiB // 2, 5 * GiB // 2, 1)
    assert cuda.retries == 4


def test_measure_reraises_and_cleanup_returns_the_memory():
    cuda = FakeCuda()
    dev = CudaDevice(0, cuda=cuda, nvml=FakeNvml())
    seen = {}

    def work(session):
        seen["tracker"] = session.tracker
        cuda.alloc(5 * GiB)
        keep = torch.ones(1000)  # noqa: F841 - live when the OOM comes
        cuda.free_(5 * GiB)  # the caching allocator keeps it
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    cuda.calls.clear()
    with pytest.raises(torch.OutOfMemoryError) as info:
        dev.measure(work)
    assert is_oom(info.value)
    del info
    dev.cleanup()  # what the probe does once it has dropped the OOM
    assert cuda.calls[-1] == "empty_cache"
    assert cuda.reserved == 0
    assert seen["tracker"].current_bytes == 0


def test_cleanup_empties_the_cache():
    cuda = FakeCuda(allocated=1 * GiB, cached=3 * GiB)
    dev = CudaDevice(0, cuda=cuda, nvml=FakeNvml())
    dev.cleanup()
    assert "empty_cache" in cuda.calls
    assert cuda.reserved == 1 * GiB


@pytest.mark.parametrize(
    ("settings", "expected"),
    [({}, True), ({"foreach": False}, False), ({"fused": True}, None)],
)
def test_cuda_sessions_pick_the_multi_tensor_optimizer_path(settings, expected):
    dev = CudaDevice(0, cuda=FakeCuda(), nvml=FakeNvml())
    model = torch.nn.Linear(4, 2)

    def work(session):
        return session.optimizer(lambda params: torch.optim.AdamW(params, **settings), model)

    opt, _ = dev.measure(work)
    assert opt.param_groups[0]["foreach"] is expected


# -- naming devices ------------------------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_a_gpu_is_a_one_line_error_naming_the_devices_here(name):
    with pytest.raises(DeviceError, match=r"is not available: no CUDA GPU here .*Devices here: cpu, estimate$") as info:
        get_device(name)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, BadInput) and info.value.exit_code == 2


TWO_GPUS = "devices here are cpu, cuda:0, cuda:1, estimate"


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("cuda:3", {"cuda": FakeCuda(count=2)}, rf"^cuda:3 does not exist: {TWO_GPUS}$"),
        ("cuda:2", {"cuda": FakeCuda(count=2)}, rf"^cuda:2 does not exist: {TWO_GPUS}$"),
        ("cuda", {"cuda": FakeCuda(count=0)}, r"^cuda:0 is not available"),
        ("tpu", {}, r"^unknown device 'tpu': use one of auto, cpu, cuda, cuda:N, estimate, estimate:GPU$"),
        ("cuda:x", {}, r"^unknown device 'cuda:x'"),
        ("estimate", {}, r"^device='estimate' needs memory_budget"),
        ("estimate", {"memory_budget": 512 * MiB}, r"512.0 MiB is not more than the 640.0 MiB a CUDA context"),
    ],
)
def test_get_device_errors(name, kwargs, match):
    with pytest.raises(DeviceError, match=match):
        get_device(name, **kwargs)


@pytest.mark.parametrize(
    ("name", "kind", "device_name"),
    [("auto", CudaDevice, "cuda:0"), ("cuda", CudaDevice, "cuda:0"), ("cuda:1", CudaDevice, "cuda:1"),
     (" CPU ", CpuDevice, "cpu")],
)
def test_get_device_with_gpus(name, kind, device_name):
    dev = get_device(name, cuda=FakeCuda(count=2), nvml=FakeNvml())
    assert isinstance(dev, kind) and dev.name == device_name


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_auto_is_the_cpu_without_a_gpu():
    assert isinstance(get_device("auto"), CpuDevice)


# -- listing devices ----------------------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_list_devices_here_has_no_gpus_and_says_why():
    out = list_devices()
    assert out["gpus"] == []
    assert len(out["notes"]) == 1 and out["notes"][0].startswith("no NVIDIA driver or GPU found")
    assert out["cpu"]["ram_total_bytes"] >= out["cpu"]["ram_available_bytes"] > 0


def test_list_devices_with_nvml_shows_other_processes():
    out = list_devices(cuda=FakeCuda(count=2), nvml=FakeNvml(count=2, free=60 * GiB))
    assert out["driver"] == "550.54.15"
    assert [g["index"] for g in out["gpus"]] == [0, 1]
    gpu = out["gpus"][1]
    assert gpu == {"index": 1, "name": "NVML GPU 1", "total_bytes": 80 * GiB, "free_bytes": 60 * GiB,
                   "used_bytes": 20 * GiB, "other_processes_bytes": 18 * GiB,
                   "other_processes": [[111, 8 * GiB], [222, 10 * GiB]]}
    assert out["notes"] == []


def test_list_devices_without_nvml_reads_mem_get_info():
    out = list_devices(cuda=FakeCuda(count=2, free=50 * GiB), nvml=None)
    assert [(g["name"], g["free_bytes"], g["used_bytes"], g["other_processes"]) for g in out["gpus"]] == [
        ("Fake H100", 50 * GiB, 30 * GiB, None)] * 2
    assert out["notes"] == ["NVML not used; GPU memory from torch.cuda.mem_get_info instead"]


@pytest.mark.parametrize(
    ("cuda", "nvml", "note"),
    [
        (FakeCuda(count=0), FakeNvml(count=1), "torch cannot use these GPUs (CPU-only torch build?)"),
        (FakeCuda(count=1), FakeNvml(count=0), "NVML loaded but reports no GPU"),
    ],
)
def test_list_devices_notes(cuda, nvml, note):
    assert note in list_devices(cuda=cuda, nvml=nvml)["notes"]


# -- a real GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_real_gpu_measures_the_reserved_peak_of_a_matmul():
    n = 1024
    dev = CudaDevice(0)
    assert 0 < dev.capacity_bytes() <= torch.cuda.get_device_properties(0).total_memory

    def work(session):
        a = session.batch(lambda size, generator: torch.ones(size, size), n, torch.Generator())
        b = a @ a
        return float(b[0, 0])

    value, m = dev.measure(work)
    assert value == n
    assert m.peak_bytes == torch.cuda.max_memory_reserved(0)
    assert m.tracked_peak_bytes == 2 * n * n * 4  # a and b; the host copy of a is not counted
    assert m.peak_bytes >= m.tracked_peak_bytes  # plus allocator rounding and cuBLAS workspace
    dev.cleanup()
    assert torch.cuda.memory_reserved(0) <= m.peak_bytes
