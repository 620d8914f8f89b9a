"""This machine, read without torch: its RAM, what the installed torch was built for, and whether the CUDA
driver is installed.

``autotune devices`` answers from here and NVML alone, so it starts in a fraction
of a second; importing torch takes seconds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass


def ram_bytes() -> tuple[int, int]:
    """(total, available) RAM of this process in bytes: the machine's (``MemTotal``, ``MemAvailable``), bounded
    by the memory cgroup this process runs in (its limit, and that limit less what the cgroup uses) and by
    ``RLIMIT_AS`` when set (the limit, and the limit less the address space this process already maps)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        total, available = info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError):
        total = available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit, used in (_cgroup_memory(), _address_space()):
        if limit is not None:
            total, available = min(total, limit), min(available, max(0, limit - used))
    return total, available


def _cgroup_memory() -> tuple[int | None, int]:
    """(limit, usage) of this process's memory cgroup (v2, else v1); limit None when there is none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None, 0
    for _, controllers, path in lines:
        if controllers == "":
            found = _read_limit(f"/sys/fs/cgroup{path}", "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            found = _read_limit(f"/sys/fs/cgroup/memory{path}", "memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        if found[0] is not None:
            return found
    return None, 0


def _read_limit(folder: str, limit_file: str, usage_file: str) -> tuple[int | None, int]:
    """(limit, usage) of one cgroup: its usage less the file cache it can drop (inactive files), as
    ``docker stats`` counts it."""
    try:
        with open(os.path.join(folder, limit_file)) as f:
            text = f.read().strip()
        with open(os.path.join(folder, usage_file)) as f:
            used = int(f.read().strip())
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split() for line in f if line.count(" ") == 1)
    except (OSError, ValueError):
        return None, 0
    if not text.isdigit() or int(text) >= 1 << 60:  # "max", or v1's "no limit" (a page-rounded 2**63 - 1)
        return None, 0
    cache = stat.get("total_inactive_file", stat.get("inactive_file", "0"))
    return int(text), used - (int(cache) if cache.isdigit() else 0)


def _address_space() -> tuple[int | None, int]:
    """(``RLIMIT_AS``, bytes of address space this process maps); the limit None when there is none."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None, 0
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None, 0
    try:
        with open("/proc/self/status") as f:
            mapped = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    except (OSError, ValueError):
        mapped = 0
    return soft, mapped


@dataclass(frozen=True)
class TorchBuild:
    version: str
    gpu: str | None  # "cuda 12.4", "hip 6.2", or None for a CPU-only build


def torch_build() -> TorchBuild:
    """torch's version and GPU backend, from ``torch/version.py`` alone when torch is not imported yet."""
    version = sys.modules.get("torch.version")
    if version is None:
        version = _load_version_file()
    if version is None:  # an unusual install: ask torch itself
        import torch

        version = torch.version
    cuda, hip = getattr(version, "cuda", None), getattr(version, "hip", None)
    gpu = f"cuda {cuda}" if cuda else (f"hip {hip}" if hip else None)
    return TorchBuild(version=str(version.__version__), gpu=gpu)


def _load_version_file():
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    file_spec = importlib.util.spec_from_file_location("_autotune_torch_version", path)
    if file_spec is None or file_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(module)
    except (OSError, SyntaxError, ImportError):
        return None
    return module


def cuda_driver_missing() -> str:
    """Why torch's CUDA build could not see a GPU here ("" when it might): the CUDA driver's library does not load.

    A CUDA build of torch asks that library (``libcuda.so.1``, part of the NVIDIA driver, never of a wheel)
    for every GPU, so where it does not load, importing torch to ask would only cost seconds.
    """
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        ctypes.CDLL(name)
    except OSError as exc:
        return f"the CUDA driver does not load ({exc})"
    return ""
