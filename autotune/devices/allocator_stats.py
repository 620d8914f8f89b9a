"""The statistics of the caching-allocator replica, under ``torch.cuda.memory_stats()``'s names.

``DeviceStats`` of PyTorch's ``c10/core/CachingDeviceAllocator.h``: each
statistic has a current value, a peak, and the totals added and removed, for
all pools together and for the small and the large pool. Also the records of
:meth:`CachingAllocator.segments`, shaped like ``torch.cuda.memory_snapshot()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .allocconf import SIZE_MAX

STATS = ("allocation", "segment", "inactive_split", "allocated_bytes", "reserved_bytes", "inactive_split_bytes",
         "requested_bytes")
# Index of a statistic's "all" entry; + BlockPool.type (1 small, 2 large) for its pool's entry.
ALLOC, SEG, ISPLIT, ABYTES, RBYTES, ISBYTES, QBYTES = (3 * i for i in range(len(STATS)))
_TYPES = ("all", "small_pool", "large_pool")
_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class DeviceStats:
    """``DeviceStats``: flat lists indexed by ``3 * statistic + pool type``, cheap to update per event."""

    __slots__ = ("counters", "cur", "dec", "inc", "over", "peak")

    def __init__(self) -> None:
        n = 3 * len(STATS)
        self.cur, self.peak, self.inc, self.dec = [0] * n, [0] * n, [0] * n, [0] * n
        self.over = [0] * 8  # oversize_allocations then oversize_segments: current, peak, allocated, freed
        self.counters = dict.fromkeys(_COUNTERS, 0)

    def up(self, stat: int, t: int, n: int) -> None:
        """Add ``n`` to a statistic, for all pools (index ``stat``) and for pool type ``t``."""
        cur, peak, inc = self.cur, self.peak, self.inc
        v = cur[stat] + n
        cur[stat] = v
        if v > peak[stat]:  # noqa: PLR1730 (a branch costs a tenth of max() on the hot path)
            peak[stat] = v
        inc[stat] += n
        stat += t
        v = cur[stat] + n
        cur[stat] = v
        if v > peak[stat]:  # noqa: PLR1730
            peak[stat] = v
        inc[stat] += n

    def down(self, stat: int, t: int, n: int) -> None:
        """Take ``n`` from a statistic, for all pools and for pool type ``t``."""
        cur, dec = self.cur, self.dec
        cur[stat] -= n
        dec[stat] += n
        cur[stat + t] -= n
        dec[stat + t] += n

    def change(self, stat: int, t: int, n: int) -> None:
        if n > 0:
            self.up(stat, t, n)
        else:
            self.down(stat, t, -n)

    def oversize(self, k: int, n: int) -> None:
        """Count an oversize allocation (``k`` 0) or segment (``k`` 4) in or out."""
        over = self.over
        over[k] += n
        if n > 0:
            over[k + 2] += n
            over[k + 1] = max(over[k + 1], over[k])
        else:
            over[k + 3] -= n

    def as_dict(self, max_split_size: int) -> dict[str, int]:
        """The flat, sorted dictionary of ``torch.cuda.memory_stats()``."""
        out: dict[str, int] = {}
        names = {name: 3 * i for i, name in enumerate(STATS)}
        names["active"] = ALLOC  # nothing waits on another stream: the active blocks are the allocated ones
        names["active_bytes"] = ABYTES
        for name, base in names.items():
            for t, type_name in enumerate(_TYPES):
                i = base + t
                prefix = f"{name}.{type_name}."
                out[prefix + "current"] = self.cur[i]
                out[prefix + "peak"] = self.peak[i]
                out[prefix + "allocated"] = self.inc[i]
                out[prefix + "freed"] = self.dec[i]
        for k, name in ((0, "oversize_allocations"), (4, "oversize_segments")):
            for j, field in enumerate(("current", "peak", "allocated", "freed")):
                out[f"{name}.{field}"] = self.over[k + j]
        out.update(self.counters)
        out["num_oom_rejections"] = 0
        out["max_split_size"] = -1 if max_split_size == SIZE_MAX else max_split_size
        return dict(sorted(out.items()))

    def reset_peak(self) -> None:
        """``resetPeakStats``."""
        self.peak[:] = self.cur
        self.over[1], self.over[5] = self.over[0], self.over[4]

    def reset_accumulated(self) -> None:
        """``resetAccumulatedStats``."""
        n = len(self.inc)
        self.inc[:], self.dec[:] = [0] * n, [0] * n
        self.over[2:4], self.over[6:8] = [0, 0], [0, 0]
        self.counters = dict.fromkeys(_COUNTERS, 0)


@dataclass(frozen=True)
class BlockInfo:
    """One block of a segment, as ``torch.cuda.memory_snapshot()`` lists it."""

    size: int
    requested_size: int
    allocated: bool


@dataclass(frozen=True)
class SegmentInfo:
    """One segment (for expandable segments: one mapped range), as ``memory_snapshot()`` lists it."""

    address: int
    total_size: int
    stream: int
    is_large: bool
    is_expandable: bool
    blocks: tuple[BlockInfo, ...]

    @property
    def allocated_size(self) -> int:
        return sum(b.size for b in self.blocks if b.allocated)
