"""Fakes of what autotune asks a GPU through: ``torch.cuda`` (``FakeCuda``, over a toy caching allocator) and the
NVML facade (``FakeNvml``). The device tests, the contract every backend passes, ``autotune devices`` and the
store's fingerprints take them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from autotune.devices.nvml import GpuInfo

GiB = 1024**3


class FakeCuda:
    """The ``torch.cuda`` calls autotune makes, over a toy caching allocator.

    ``allocated`` is memory in tensors, ``cached`` is freed memory the allocator
    keeps; reserved = allocated + cached. ``peak`` is the reserved peak and
    ``peak_allocated`` the allocated peak since the last
    ``reset_peak_memory_stats``; ``retries`` counts release-and-retries (an
    allocation that would take reserved past ``limit`` frees the cache first),
    and is never reset, as in torch. ``calls`` logs what was called.
    """

    def __init__(self, count: int = 2, *, free: int = 70 * GiB, total: int = 80 * GiB, allocated: int = 0,
                 cached: int = 0, peak: int | None = None, name: str = "Fake H100", limit: int | None = None,
                 retries: int = 0, capability: tuple[int, int] = (9, 0)):
        self.count, self.free, self.total, self.name = count, free, total, name
        self.allocated, self.cached = allocated, cached
        self.peak = self.reserved if peak is None else peak
        self.peak_allocated = allocated
        self.limit = limit
        self.retries = retries
        self.capability = capability
        self.calls: list[str] = []

    @property
    def reserved(self) -> int:
        return self.allocated + self.cached

    # the allocator, driven by test work
    def alloc(self, n: int) -> None:
        self.calls.append(f"alloc {n}")
        if self.cached >= n:  # fits in a cached block: no new reservation
            self.cached -= n
        elif self.limit is not None and self.reserved + n > self.limit:
            self.retries += 1  # cudaMalloc failed: free the cache and try again
            self.cached = 0
            if self.reserved + n > self.limit:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes")
        self.allocated += n
        self.peak = max(self.peak, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free_(self, n: int) -> None:
        self.calls.append(f"free {n}")
        self.allocated -= n
        self.cached += n

    # torch.cuda's interface
    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def memory_reserved(self, index: int = 0) -> int:
        return self.reserved

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        return self.free, self.total

    def synchronize(self, index: int = 0) -> None:
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.peak = self.reserved
        self.peak_allocated = self.allocated

    def max_memory_reserved(self, index: int = 0) -> int:
        self.calls.append("max_memory_reserved")
        return self.peak

    def max_memory_allocated(self, index: int = 0) -> int:
        return self.peak_allocated

    def memory_stats(self, index: int = 0) -> dict[str, int]:
        return {"num_alloc_retries": self.retries, "reserved_bytes.all.peak": self.peak,
                "allocated_bytes.all.peak": self.peak_allocated}

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def get_device_properties(self, index: int = 0):
        return SimpleNamespace(name=self.name, total_memory=self.total, major=self.capability[0],
                               minor=self.capability[1])

    def get_device_name(self, index: int = 0) -> str:
        return self.name


OTHERS = ((111, 8 * GiB), (222, 10 * GiB))


class FakeNvml:
    """The ``Nvml`` facade: driver_version, device_count, info."""

    def __init__(self, count: int = 2, *, free: int = 60 * GiB, total: int = 80 * GiB, others=OTHERS):
        self.count, self.free, self.total, self.others = count, free, total, others
        self.asked: list[tuple[int, int]] = []

    def driver_version(self) -> str:
        return "550.54.15"

    def device_count(self) -> int:
        return self.count

    def info(self, index: int, *, own_pid: int) -> GpuInfo:
        self.asked.append((index, own_pid))
        return GpuInfo(index=index, name=f"NVML GPU {index}", total_bytes=self.total, free_bytes=self.free,
                       used_bytes=self.total - self.free, other_processes=tuple(self.others))
