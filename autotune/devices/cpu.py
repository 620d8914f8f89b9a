"""The CPU as a device: memory counted by the live-storage tracker, exactly."""

from __future__ import annotations

import gc
import os
import platform
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..results.device import DeviceInfo
from ..units import format_bytes
from .compiled import AllocatorCount, compiled_note
from .host import ram_bytes
from .measurement import Measurement, Session, T, timed_measure
from .tracker import LiveStorageTracker

if TYPE_CHECKING:
    from .estimate import EstimateDevice


class CpuDevice:
    """``cpu``: capacity is ``memory_budget`` when given, else the RAM available now.

    Peak memory is the peak of live tensor-storage bytes (parameters, buffers,
    gradients, optimizer state, the batch, every temporary), not process RSS.
    With the capacity enforced, an allocation past it raises an emulated
    ``torch.OutOfMemoryError``; without, the work is measured whole (the probe
    does this, to learn how far past the budget a size is), bounded only by
    the RAM available. Compiled code (``torch.compile``) runs compiled; from
    its first use the CPU allocator's own count decides the peak
    (:mod:`autotune.devices.compiled`).
    """

    estimated = False

    def __init__(self, *, memory_budget: int | None = None):
        self.name = "cpu"
        self.torch_device = torch.device("cpu")
        self.memory_budget = memory_budget
        total, available = ram_bytes()
        self._total = total
        self._capacity = memory_budget if memory_budget is not None else available

    def capacity_bytes(self) -> int:
        return self._capacity

    def measure(self, work: Callable[[Session], T], *, enforce_capacity: bool = True) -> tuple[T, Measurement]:
        # Not enforcing the emulated capacity still never lets the work take more RAM than is free.
        tracker = LiveStorageTracker(capacity=self._capacity if enforce_capacity else ram_bytes()[1],
                                     compiled_runs=True)
        count = AllocatorCount()  # from a compiled model's first use: see autotune.devices.compiled
        # Moving to the CPU device copies, as moving to a GPU does: a micro-batch sliced
        # from a host batch then counts as itself, not as the whole host batch.
        session = Session(tracker, move=lambda t: t.clone(), move_model=lambda m: m,
                          on_compiled=lambda: count.start(tracker.current_bytes))

        def counted(session: Session) -> T:
            try:
                return work(session)
            finally:
                count.stop()

        result, m = timed_measure(tracker, session, counted)
        if count.started:
            peak = max(m.peak_bytes, count.peak)
            m = replace(m, peak_bytes=peak, notes=m.notes + (compiled_note(session.compiled, m.peak_bytes, peak),))
        return result, m

    def cleanup(self) -> None:
        gc.collect()

    def estimator(self) -> EstimateDevice:
        from .estimate import EstimateDevice

        return EstimateDevice(capacity=self._capacity, round_to=1, cuda_like=False, name="estimate (cpu)")

    def describe(self) -> DeviceInfo:
        source = "memory budget" if self.memory_budget is not None else "available RAM"
        return DeviceInfo(
            name=self.name, kind="cpu", estimated=False, capacity_bytes=self._capacity, capacity_source=source,
            budget_bytes=self.memory_budget, measured_by="live tensor-storage bytes (autotune tracker)",
            summary=f"cpu, capacity {format_bytes(self._capacity)} ({source})", torch=torch.__version__,
            model=platform.processor() or platform.machine(), cpu_count=os.cpu_count(), ram_total_bytes=self._total,
        )
