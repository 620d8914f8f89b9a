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
    """(total, available) RAM of this machine in bytes."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages


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
