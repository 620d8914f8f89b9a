"""Devices: ``cpu``, ``cuda:N``, ``estimate`` and ``estimate:GPU``, behind one interface (see base.Device).

The device classes load on first use: ``list_devices`` (``autotune devices``)
answers from NVML and /proc without importing torch.

Owns: the devices, the live-storage tracker, out-of-memory recognition, the caching-allocator
simulation, the CPU's and CUDA's kernel choices on meta (attention, recurrent layers, oneDNN's
LSTM), the batch's known values and the shape rules they answer in estimates, GPU presets, and the
estimate session (session.py), the one place that changes torch's global state while a measurement
runs (resize watcher, aten kernels, fake process groups, the recorder's hooks), one measurement at a
time. May import: the foundation (errors, units, options, log, serial, compat: torch's private APIs),
results, planning, workload, and torch; never probing or above.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from ..errors import DeviceError
from ..lazy import exports
from ..units import format_bytes
from .host import cuda_driver_missing, ram_bytes, torch_build
from .nvml import load_nvml

if TYPE_CHECKING:
    from .allocator import CachingAllocator
    from .base import Device, Measurement, Session
    from .cpu import CpuDevice
    from .cuda import CudaDevice
    from .estimate import CUDA_CONTEXT_ALLOWANCE, EstimateDevice

__all__ = ["CUDA_CONTEXT_ALLOWANCE", "CachingAllocator", "CpuDevice", "CudaDevice", "Device", "EstimateDevice",
           "Measurement", "Session", "get_device", "list_devices"]

_LAZY = {"Device": "base", "Measurement": "base", "Session": "base", "CpuDevice": "cpu", "CudaDevice": "cuda",
         "EstimateDevice": "estimate", "CUDA_CONTEXT_ALLOWANCE": "estimate", "CachingAllocator": "allocator"}


__getattr__ = exports(__name__, _LAZY, globals())

DEVICE_FORMS = "auto, cpu, cuda, cuda:N, estimate, estimate:GPU"


def _cuda_names(cuda) -> list[str]:
    try:
        count = cuda.device_count() if cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # torch's CUDA failed to start (a driver or build mismatch)
        count = 0
    return [f"cuda:{i}" for i in range(count)]


def get_device(name: str = "auto", *, memory_budget: int | None = None, cuda=None, nvml=True) -> Device:
    """The device called ``name``: auto | cpu | cuda | cuda:N | estimate | estimate:GPU.

    ``auto`` is ``cuda:0`` when a CUDA GPU is usable, else ``cpu``. ``estimate``
    needs ``memory_budget``: the memory of the GPU you are planning for.
    ``estimate:GPU`` names one (``estimate:H100-80GB``; see
    :mod:`autotune.devices.presets`): its memory as NVML reports it, unless
    ``memory_budget`` is given, and its compute capability for the kernel choices.
    """
    from .cpu import CpuDevice
    from .cuda import CudaDevice
    from .estimate import CUDA_CONTEXT_ALLOWANCE, EstimateDevice

    if cuda is None:
        import torch

        cuda = torch.cuda
    text = str(name).strip().lower()
    if text.startswith("estimate:"):
        from .presets import find_preset

        preset = find_preset(str(name).strip()[len("estimate:"):])
        _check_allowance(memory_budget, preset.allowance_bytes)
        return EstimateDevice.for_preset(preset, memory_budget)
    if text == "auto":
        text = "cuda:0" if _cuda_names(cuda) else "cpu"
    if text == "cpu":
        _check_ram(memory_budget)
        return CpuDevice(memory_budget=memory_budget)
    if text == "estimate":
        if memory_budget is None:
            raise DeviceError("{device='estimate'} needs {memory_budget}", field="memory_budget",
                              fix="the memory of the GPU you are planning for, e.g. 80GiB")
        _check_allowance(memory_budget, CUDA_CONTEXT_ALLOWANCE)
        return EstimateDevice.for_gpu(memory_budget)
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise DeviceError(f"unknown device {name!r}: use one of {DEVICE_FORMS}")
    index = int(match.group(1) or 0)
    present = _cuda_names(cuda)
    if not present:
        raise DeviceError(
            f"{text if ':' in text else 'cuda:0'} is not available: no CUDA GPU here "
            f"(torch.cuda.is_available() is False; no NVIDIA driver, or a CPU-only torch build). "
            f"Devices here: cpu, estimate"
        )
    if index >= len(present):
        raise DeviceError(f"cuda:{index} does not exist: devices here are cpu, {', '.join(present)}, estimate")
    return CudaDevice(index, memory_budget=memory_budget, cuda=cuda, nvml=nvml)


def _check_allowance(memory_budget: int | None, allowance: int) -> None:
    if memory_budget is not None and memory_budget <= allowance:
        raise DeviceError(
            f"{{memory_budget}} {format_bytes(memory_budget)} is not more than the {format_bytes(allowance)} a CUDA "
            "context takes", field="memory_budget", limit=allowance, fix="give the GPU's memory, e.g. 24GiB")


def _check_ram(memory_budget: int | None) -> None:
    """A CPU budget is memory this process can have: more than its RAM cannot be measured or enforced."""
    total = ram_bytes()[0]
    if memory_budget is not None and memory_budget > total:
        raise DeviceError(
            f"{{memory_budget}} {format_bytes(memory_budget)} is more than the {format_bytes(total)} of RAM this "
            "process can use (the machine's, bounded by its memory cgroup and RLIMIT_AS)", field="memory_budget",
            limit=total, fix=f"give at most {format_bytes(total)} for {{device='cpu'}}, or plan for a larger device "
                             f"with {{device='estimate'}} and {{memory_budget}} "
                             f"{format_bytes(memory_budget).replace(' ', '')}")


def list_devices(*, cuda=None, nvml=True) -> dict[str, Any]:
    """What ``autotune devices`` shows: the CPU's RAM and every GPU's memory.

    GPUs come from NVML. torch is imported only when NVML cannot list them and
    the installed torch was built for GPUs (then ``torch.cuda`` is asked), a
    CUDA build only where the CUDA driver's library loads; or when ``cuda`` (a
    ``torch.cuda``-like object) is passed.
    """
    total, available = ram_bytes()
    build = torch_build()
    out: dict[str, Any] = {
        "cpu": {"name": "cpu", "cpu_count": os.cpu_count(), "ram_total_bytes": total, "ram_available_bytes": available},
        "gpus": [],
        "notes": [],
        "torch": build.version,
    }
    if nvml is True:
        nvml, why = load_nvml()
    else:
        why = "" if nvml else "NVML not used"
    if nvml is not None:
        out["driver"] = nvml.driver_version()
        for i in range(nvml.device_count()):
            info = nvml.info(i, own_pid=os.getpid())
            out["gpus"].append({
                "index": i, "name": info.name, "total_bytes": info.total_bytes, "free_bytes": info.free_bytes,
                "used_bytes": info.used_bytes, "other_processes_bytes": info.other_process_bytes,
                "other_processes": [list(p) for p in info.other_processes],
            })
        if not out["gpus"]:
            out["notes"].append("NVML loaded but reports no GPU")
        elif cuda is not None and not _cuda_names(cuda):
            out["notes"].append("torch cannot use these GPUs (CPU-only torch build?)")
        elif cuda is None and build.gpu is None:
            out["notes"].append(f"torch {build.version} is a CPU-only build: it cannot use these GPUs; "
                                "install a CUDA build of torch")
        return out
    if cuda is None and build.gpu is not None:
        no_driver = cuda_driver_missing() if build.gpu.startswith("cuda") else ""
        if no_driver:
            why = f"{why}; {no_driver}" if why else no_driver
        else:
            import torch

            cuda = torch.cuda
    gpus = _cuda_names(cuda) if cuda is not None else []
    if gpus:
        out["notes"].append(f"{why}; GPU memory from torch.cuda.mem_get_info instead")
        for i, _ in enumerate(gpus):
            free, total_g = cuda.mem_get_info(i)
            out["gpus"].append({
                "index": i, "name": cuda.get_device_name(i), "total_bytes": int(total_g),
                "free_bytes": int(free), "used_bytes": int(total_g - free),
                "other_processes_bytes": None, "other_processes": None,
            })
    else:
        out["notes"].append(f"no NVIDIA driver or GPU found ({why}); CUDA is not available to torch")
    return out
