"""A CUDA GPU: the caching allocator's reserved peak decides; NVML says what is free.

A measurement records ``torch.cuda.max_memory_reserved`` (what decides),
``max_memory_allocated`` and the allocator's release-and-retry count
(``num_alloc_retries`` of ``torch.cuda.memory_stats``) over the work, each trial
starting as a fresh process would: garbage collected, cuBLAS workspaces
dropped, cache emptied, peaks reset.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..compat import clear_cublas_workspaces, nvml_device_index
from ..results.device import DeviceInfo
from ..units import format_bytes
from .allocconf import conf_from_environment
from .measurement import Measurement, Session, T, timed_measure
from .nvml import GpuInfo, Nvml, load_nvml
from .tracker import LiveStorageTracker

if TYPE_CHECKING:
    from .estimate import EstimateDevice


class CudaDevice:
    """``cuda:N``.

    Capacity = free memory on the GPU before probing (NVML) + what this process
    already holds reserved (which NVML counts as used), capped by ``memory_budget``.
    Peak = ``torch.cuda.max_memory_reserved`` over the work, after emptying the
    cache and resetting the peak. Without NVML (no driver library),
    ``torch.cuda.mem_get_info`` stands in, and the description says so.

    ``cuda`` and ``nvml`` are injectable so the logic is tested without a GPU.
    """

    estimated = False

    def __init__(self, index: int = 0, *, memory_budget: int | None = None, cuda=None,
                 nvml: Nvml | None | bool = True):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.index = index
        self.name = f"cuda:{index}"
        self.torch_device = torch.device("cuda", index)
        self.memory_budget = memory_budget
        if nvml is True:
            nvml, self.nvml_note = load_nvml()
        else:
            self.nvml_note = "" if nvml else "NVML not used"
        self.nvml = nvml or None
        self._info: GpuInfo | None = None
        self._capacity, self._free, self._total = self._read_capacity()
        # The allocator this process runs with: torch reads it once, at its first CUDA allocation.
        self.alloc_conf, self.alloc_conf_variable = conf_from_environment()

    def _nvml_index(self) -> int:
        try:
            return nvml_device_index(self.index) if self.cuda is torch.cuda else self.index
        except (RuntimeError, ValueError):  # CUDA_VISIBLE_DEVICES names no such device, or NVML cannot say
            return self.index

    def _read_capacity(self) -> tuple[int, int, int]:
        reserved = int(self.cuda.memory_reserved(self.index))
        if self.nvml is not None:
            self._info = self.nvml.info(self._nvml_index(), own_pid=os.getpid())
            free, total = self._info.free_bytes, self._info.total_bytes
        else:
            free, total = (int(x) for x in self.cuda.mem_get_info(self.index))
        capacity = free + reserved
        if self.memory_budget is not None:
            capacity = min(capacity, self.memory_budget)
        return capacity, free, total

    def capacity_bytes(self) -> int:
        return self._capacity

    def measure(self, work: Callable[[Session], T], *, enforce_capacity: bool = True) -> tuple[T, Measurement]:
        self.cleanup()
        self.cuda.synchronize(self.index)
        self.cuda.reset_peak_memory_stats(self.index)
        retries_before = self._retries()
        tracker = LiveStorageTracker(compiled_runs=True)  # compiled code runs compiled: the reserved peak decides
        device = torch.device("cuda", self.index)
        session = Session(tracker, move=lambda t: t.to(device, non_blocking=True), move_model=lambda m: m.to(device),
                          cuda_like=True, torch_device=device)

        def peak() -> int:
            self.cuda.synchronize(self.index)
            return int(self.cuda.max_memory_reserved(self.index))

        result, m = timed_measure(tracker, session, work, peak=peak)
        return result, replace(m, allocated_peak_bytes=int(self.cuda.max_memory_allocated(self.index)),
                               alloc_retries=self._retries() - retries_before)

    def _retries(self) -> int:
        """``num_alloc_retries`` so far (a counter that reset_peak_memory_stats leaves alone)."""
        return int(self.cuda.memory_stats(self.index).get("num_alloc_retries", 0))

    def cleanup(self) -> None:
        """Give memory back after a trial or an OOM: drop garbage and the cuBLAS workspaces (the next
        trial allocates them again, as a fresh process does), empty the cache."""
        gc.collect()
        if self.cuda is torch.cuda:
            clear_cublas_workspaces()
        self.cuda.empty_cache()

    def capability(self) -> tuple[int, int]:
        props = self.cuda.get_device_properties(self.index)
        return int(props.major), int(props.minor)

    def estimator(self) -> EstimateDevice:
        """The estimate that stands in for this GPU: its capacity, compute capability, cuDNN and CUDA
        versions, and this process's allocator settings (PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF)."""
        from .cudakernels import CudaTarget
        from .estimate import EstimateDevice

        versions: dict[str, Any] = {}
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn:
            versions["cudnn_version"] = int(cudnn)
        if torch.version.cuda:
            versions["cuda_version"] = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
        return EstimateDevice(capacity=self._capacity, cuda_like=True, name=f"estimate ({self.name})",
                              target=CudaTarget.from_environment(self.capability(), **versions),
                              alloc_conf=self.alloc_conf, alloc_conf_variable=self.alloc_conf_variable,
                              device_total=self._total, real_gpu=True)

    def describe(self) -> DeviceInfo:
        props = None
        try:
            props = self.cuda.get_device_properties(self.index)
        except (RuntimeError, AssertionError):  # CUDA cannot say: the description goes without it
            pass
        name = self._info.name if self._info else (getattr(props, "name", None) or self.name)
        source = "NVML free memory + this process's reserved memory"
        if self.nvml is None:
            source = f"torch.cuda.mem_get_info ({self.nvml_note})"
        budget = self.memory_budget if self.memory_budget is not None and self.memory_budget <= self._capacity \
            else None
        if budget is not None:
            source = "memory budget"
        return DeviceInfo(
            name=self.name, kind="cuda", estimated=False, capacity_bytes=self._capacity, capacity_source=source,
            budget_bytes=budget, measured_by="torch.cuda.max_memory_reserved",
            summary=f"{self.name} ({name}), capacity {format_bytes(self._capacity)} ({source})",
            torch=torch.__version__, model=name, total_bytes=self._total, free_bytes=self._free,
            other_processes=self._info.other_processes if self._info else None,
            driver=self.nvml.driver_version() if self.nvml is not None else None,
            allocator_conf=self.alloc_conf, allocator_conf_variable=self.alloc_conf_variable,
            compute_capability=f"{props.major}.{props.minor}" if props is not None and hasattr(props, "major")
            else None,
            note=None if self.nvml is not None else
            self.nvml_note + "; free memory read from torch.cuda.mem_get_info instead",
        )
