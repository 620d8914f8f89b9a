"""What every device offers: a capacity, a measured session, cleanup, a description.

A device runs a piece of work inside a :class:`Session` and returns what the
work returned together with a :class:`Measurement` of its peak memory (both in
:mod:`autotune.devices.measurement`, which the devices build on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from ..results.device import DeviceInfo
from .measurement import Measurement, Session, T, _load_dispatch_machinery, timed_measure

if TYPE_CHECKING:
    from .estimate import EstimateDevice

__all__ = ["Device", "Measurement", "Session", "T", "_load_dispatch_machinery", "own_random_state",
           "timed_measure"]


class Device(Protocol):
    """The interface every device backend implements (cpu, cuda:N, estimate)."""

    name: str
    estimated: bool
    torch_device: torch.device  # where the work's tensors live (meta for an estimate)

    def capacity_bytes(self) -> int: ...

    def measure(self, work: Callable[[Session], T], *, enforce_capacity: bool = True) -> tuple[T, Measurement]:
        """Run ``work`` in a measured session; its exceptions (an OOM too) propagate."""
        ...

    def cleanup(self) -> None:
        """Return memory to its baseline once the caller has dropped an OOM and its references."""
        ...

    def describe(self) -> DeviceInfo: ...

    def estimator(self) -> EstimateDevice:
        """The estimate that stands in for this device (itself, for an estimate)."""
        ...


@contextlib.contextmanager
def own_random_state(device: torch.device, seed: int | None = None) -> Iterator[None]:
    """Inside, the random state of the CPU and of ``device`` (a CUDA device) is autotune's: seeded with
    ``seed`` where given, and back as it was on exit.

    Only these generators are seeded. ``torch.manual_seed`` seeds every device's,
    and before CUDA starts it leaves CUDA's seed pending, which no fork restores:
    the caller's GPU would start with autotune's seed instead of theirs.
    """
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        if seed is not None:
            torch.default_generator.manual_seed(seed)
            for index in cuda:
                torch.cuda.default_generators[index].manual_seed(seed)
        yield
