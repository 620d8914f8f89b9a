"""NVML through ``pynvml`` (the nvidia-ml-py package), behind a small, fakeable facade."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    other_processes: tuple[tuple[int, int], ...]  # (pid, bytes) of processes other than this one

    @property
    def other_process_bytes(self) -> int:
        return sum(b for _, b in self.other_processes)


class Nvml:
    """The few NVML calls autotune makes. Tests pass an object with the same methods."""

    def __init__(self, module):
        self._nv = module
        # pynvml's errors (NVMLError_NotSupported...), and a facade's RuntimeError
        self._errors = (RuntimeError, getattr(module, "NVMLError", RuntimeError))
        self._nv.nvmlInit()

    def driver_version(self) -> str:
        v = self._nv.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def device_count(self) -> int:
        return int(self._nv.nvmlDeviceGetCount())

    def info(self, index: int, *, own_pid: int) -> GpuInfo:
        nv = self._nv
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        name = nv.nvmlDeviceGetName(handle)
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        except self._errors:  # not supported on every driver; the figures above still hold
            procs = []
        others = tuple(
            (int(p.pid), int(p.usedGpuMemory or 0)) for p in procs if int(p.pid) != own_pid
        )
        return GpuInfo(
            index=index,
            name=name.decode() if isinstance(name, bytes) else str(name),
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            other_processes=others,
        )


def load_nvml() -> tuple[Nvml | None, str]:
    """(NVML, "") when the driver's library loads, else (None, why not)."""
    try:
        import pynvml
    except ImportError as exc:  # nvidia-ml-py is a dependency, but be plain about it
        return None, f"the pynvml module (package nvidia-ml-py) is not installed: {exc}"
    try:
        return Nvml(pynvml), ""
    except (pynvml.NVMLError, OSError) as exc:  # no driver library, or one that does not start
        return None, f"NVML could not load ({type(exc).__name__}: {exc}); no NVIDIA driver on this machine?"
