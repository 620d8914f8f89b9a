"""The host memory the workload's batch takes to build, measured at every size built and bounded by the RAM.

Every device builds the micro-batch for real on the host (an estimate too, unless it can build it shape-only),
and a batch can grow faster than the micro-batch: graphs padded to the batch's largest, pairwise scores of
every sample with every other. A size whose build would take more than the host can give would not fail
cleanly: the kernel kills the process (or the allocator fails and looks like the device's out-of-memory
error). So each real build is counted by the live-storage tracker (its peak of live host bytes), and before a
size is built its peak is predicted from the sizes built before it (the quadratic through the three largest),
climbing by doubling with throwaway builds so that no prediction reaches more than twice past a measured size.
A size predicted, or counted, past :data:`HOST_SHARE` of what this process can still take
(:func:`autotune.devices.host.ram_bytes`: the available RAM, its memory cgroup, ``RLIMIT_AS``) raises
:class:`HostMemory` before it is built: the probe then takes the largest size predicted within it as the
largest it can reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..compat import active_fake_mode
from ..devices.host import ram_bytes
from ..devices.oom import is_oom
from ..devices.tracker import LiveStorageTracker
from ..errors import AutotuneError
from ..units import format_bytes
from .search import PeakCurve

#: Share of what the host can still give that one build may take: the rest is for Python and the allocator.
HOST_SHARE = 0.8

Build = Callable[[int, torch.Generator], Any]


class HostMemory(AutotuneError):
    """Building the micro-batch of ``batch`` on the host would take more memory than this process can get."""

    def __init__(self, batch: int, needed: int | None, room: int, largest: int):
        self.batch, self.needed, self.room, self.largest = batch, needed, room, largest
        takes = f"takes about {format_bytes(needed)}" if needed is not None else "runs out of host memory"
        super().__init__(
            f"building micro-batch {batch} on the host {takes}, more than the {format_bytes(room)} one batch may "
            f"take ({HOST_SHARE:.0%} of what this process can still take: the available RAM, bounded by its "
            "memory cgroup and RLIMIT_AS)")

    def note(self, largest: int) -> str:
        """What the probe says when this sets its largest size."""
        return (f"{self}: the probe searched up to micro-batch {largest}, the largest whose batch this host can "
                "build; a host with more memory, or a batch that holds less per sample (no padding to the "
                "batch's largest), reaches further")


class HostBatches:
    """Peak live host bytes of building the batch, per micro-batch size, over every trial of one probe.

    ``room()``: bytes this process can still take (default: the available RAM as
    :func:`~autotune.devices.host.ram_bytes` bounds it).
    """

    def __init__(self, room: Callable[[], int] | None = None):
        self.peaks: dict[int, int] = {}
        self._room = room if room is not None else (lambda: ram_bytes()[1])

    def builder(self, make: Build) -> Build:
        """``make``, built within the host's memory; a shape-only build (under ``FakeTensorMode``) takes none."""
        def build(size: int, generator: torch.Generator) -> Any:
            if active_fake_mode() is not None:
                return make(size, generator)
            room = max(1, int(self._room() * HOST_SHARE))
            self._climb(make, size, room)
            return self._measured(make, size, generator, room)

        return build

    def predict(self, size: int) -> int | None:
        """The peak predicted at ``size`` from the sizes built (measured there, when it was)."""
        if size in self.peaks:
            return self.peaks[size]
        below = sorted(s for s in self.peaks if s < size)[-3:]
        if not below:
            return None
        if len(below) == 1:
            return self.peaks[below[0]] * size // below[0]
        curve = PeakCurve({s: (self.peaks[s],) for s in below})
        line = PeakCurve({s: (self.peaks[s],) for s in below[-2:]})
        return max(curve.peak(size), line.peak(size))

    def _climb(self, make: Build, size: int, room: int) -> None:
        """Throwaway builds at doubling sizes until a size at least half of ``size`` was measured; refuse the
        first size (``size`` or one on the way) whose peak, predicted from no further than twice past a
        measured size, is past ``room``."""
        while True:
            largest = max((s for s in self.peaks if s < size), default=0)
            step = size if size in self.peaks or 2 * largest >= size else max(1, 2 * largest)
            predicted = self.predict(step)
            if predicted is not None and predicted > room:
                raise HostMemory(step, predicted, room, self._largest(step, room))
            if step == size:
                return
            with torch.random.fork_rng(devices=[]):  # the fit rule's samples stay those it draws
                self._measured(make, step, torch.Generator().manual_seed(0), room)

    def _measured(self, make: Build, size: int, generator: torch.Generator, room: int) -> Any:
        """``make(size, generator)`` with its live host bytes counted: past ``room`` it stops."""
        tracker = LiveStorageTracker(capacity=room, watched=False)
        try:
            with tracker:
                batch = make(size, generator)
        except torch.OutOfMemoryError:  # the tracker's: live host bytes would pass the room
            raise self._failed(size, room) from None
        except MemoryError:
            raise self._failed(size, room) from None
        except RuntimeError as exc:  # the CPU allocator's own failure (RLIMIT_AS), told apart by is_oom
            if is_oom(exc, "cpu"):
                raise self._failed(size, room) from None
            raise
        self.peaks[size] = max(self.peaks.get(size, 0), tracker.peak_bytes)
        return batch

    def _largest(self, size: int, room: int) -> int:
        """The largest size below ``size`` whose predicted peak is within ``room`` (bisected on the prediction,
        from the largest size built below it)."""
        lo, hi = max((s for s in self.peaks if s < size and self.peaks[s] <= room), default=0), size
        while hi - lo > 1:
            mid = (lo + hi) // 2
            predicted = self.predict(mid)
            lo, hi = (mid, hi) if predicted is not None and predicted <= room else (lo, mid)
        return lo

    def _failed(self, size: int, room: int) -> HostMemory:
        """A build at ``size`` ran out of host memory: the sizes built below it are what is known to fit."""
        return HostMemory(size, None, room, max((s for s in self.peaks if s < size), default=0))
