"""DeviceInfo: what a result was measured on (or estimated for), as a device reports itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from .record import Record, Whole, one_of

KINDS = ("cpu", "cuda", "estimate")


@dataclass(frozen=True, kw_only=True)
class DeviceInfo(Record):
    """A device as a result records it.

    ``capacity_bytes`` is what the fit rule's margin is taken from and
    ``capacity_source`` says, in words, where it came from; ``budget_bytes`` is
    the memory budget the user gave when it set the capacity (a run of the plan
    keeps to it), else None. ``summary`` is one line a person reads. The fields
    from ``model`` on are the ones a kind of device has (a GPU's driver, an
    estimate's engine) and None elsewhere.
    """

    name: str
    kind: Annotated[str, one_of(KINDS)]
    estimated: bool
    capacity_bytes: Whole
    capacity_source: str
    measured_by: str
    summary: str
    torch: str
    budget_bytes: int | None = None
    model: str | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    driver: str | None = None
    allocator_conf: str | None = None
    allocator_conf_variable: str | None = None  # where allocator_conf came from: PYTORCH_CUDA_ALLOC_CONF, ...
    other_processes: tuple[tuple[int, int], ...] | None = None
    cpu_count: int | None = None
    ram_total_bytes: int | None = None
    allowance_bytes: int | None = None
    round_to: int | None = None
    cuda_like: bool | None = None
    engine: str | None = None
    engine_fallback: str | None = None
    compute_capability: str | None = None  # "9.0": the GPU an estimate stood in for, or the GPU measured
    note: str | None = None

    def validate(self) -> None:
        # torch.__version__ is a str subclass of torch's: kept as it is, a pickled result would import torch
        # wherever it is read (the service's server process, which never needs torch).
        object.__setattr__(self, "torch", str(self.torch))
        if self.other_processes is not None:
            object.__setattr__(self, "other_processes",
                               tuple((int(pid), int(n)) for pid, n in self.other_processes))
