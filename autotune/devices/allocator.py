"""CUDA's caching allocator, replayed in pure Python.

:class:`CachingAllocator` follows the policy of PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) decision for
decision, so a trace of mallocs and frees gives the bytes a GPU would have
*reserved* (what decides an out-of-memory error), not only the bytes the
tensors hold. Each method below names the C++ function it mirrors. What is not
modelled: CUDA graphs and private memory pools, cross-stream use
(``record_stream``) and its events, IPC, and the order in which the driver
hands out addresses (new segments get increasing addresses here).

The per-event cost is a few microseconds: free blocks live in one sorted list
of integer keys per pool and stream (``size << 56 | address``), searched with
:mod:`bisect`, the way ``std::set<Block*, BlockComparatorSize>`` is in C++.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from ..errors import BadInput
from .allocconf import (
    KMIN_BLOCK_SIZE,
    KSMALL_BUFFER,
    KSMALL_SIZE,
    SIZE_MAX,
    AllocatorConfig,
    format_size,
    get_allocation_size,
    round_size,
)

__all__ = ["AllocatorConfig", "BlockInfo", "CachingAllocator", "SegmentInfo"]

_SHIFT = 56  # free-block key: size << _SHIFT | address (addresses stay below 2**56)
_FIRST_ADDRESS = 1 << 32
_NO_CAPACITY_VA = 1 << 44  # address space of an expandable segment when the device size is unknown
# Statistics kept per pool type (index = 3 * stat + type; type 0 all, 1 small pool, 2 large pool).
_STATS = ("allocation", "segment", "inactive_split", "allocated_bytes", "reserved_bytes",
          "inactive_split_bytes", "requested_bytes")
_ALLOC, _SEG, _ISPLIT, _ABYTES, _RBYTES, _ISBYTES, _QBYTES = (3 * i for i in range(len(_STATS)))
_TYPES = ("all", "small_pool", "large_pool")


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


class _Block:
    """``Block``: a range of a segment, free or allocated; ``prev``/``next`` link the ranges of one segment."""

    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "pool", "prev", "requested", "seg", "size",
                 "stream")

    def __init__(self, addr: int, size: int, stream: int, pool: _Pool, seg: _Expandable | None):
        self.addr = addr
        self.size = size
        self.stream = stream
        self.pool = pool
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.requested = 0
        self.mapped = True
        self.seg = seg
        self.gc_base = 0


class _Pool:
    """``BlockPool``: the cached free blocks of the small or the large pool, by stream."""

    __slots__ = ("blocks", "gc_calls", "keys", "small", "type", "unmapped", "unmapped_blocks")

    def __init__(self, small: bool):
        self.small = small
        self.type = 1 if small else 2
        self.keys: dict[int, list[int]] = {}  # stream -> sorted size << _SHIFT | address
        self.blocks: dict[int, _Block] = {}  # key -> free mapped block
        self.unmapped: dict[int, list[int]] = {}  # stream -> sorted addresses of unmapped blocks
        self.unmapped_blocks: dict[int, _Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count


class _Expandable:
    """``ExpandableSegment``: a reserved address range mapped page by page."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int):
        self.base, self.page, self.size = base, page, size

    def map_range(self, ptr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::map``'s range: the whole pages that cover [ptr, ptr + size)."""
        begin = (ptr - self.base) // self.page
        end = -(-(ptr + size - self.base) // self.page)
        return self.base + begin * self.page, (end - begin) * self.page

    def unmap_range(self, ptr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::unmap``'s range: the whole pages inside [ptr, ptr + size)."""
        begin = -(-(ptr - self.base) // self.page)
        end = (ptr + size - self.base) // self.page
        if begin >= end:
            return ptr, 0
        return self.base + begin * self.page, (end - begin) * self.page


def _splice(block: _Block, before: _Block | None, after: _Block | None) -> None:
    """``Block::splice``: put ``block`` between ``before`` and ``after``."""
    if before is not None:
        before.next = block
    block.prev = before
    if after is not None:
        after.prev = block
    block.next = after


class CachingAllocator:
    """A replica of PyTorch's CUDA caching allocator for one device.

    ``capacity`` is what cudaMalloc can hand out in total (None: unlimited);
    ``conf`` is a ``PYTORCH_CUDA_ALLOC_CONF`` string (or a parsed
    :class:`AllocatorConfig`). ``device_total`` is the GPU's total memory, used
    by ``per_process_memory_fraction`` and the out-of-memory message (default:
    ``capacity``). ``malloc`` returns a handle (the block's address; 0 for a
    zero-byte request, as PyTorch returns nullptr), ``free`` takes it back.

    >>> a = CachingAllocator(capacity=2**30)
    >>> h = a.malloc(1000)
    >>> a.allocated, a.reserved
    (1024, 2097152)
    """

    def __init__(self, capacity: int | None = None, conf: str | AllocatorConfig = "", *,
                 device_total: int | None = None, device: int = 0):
        for name, value in (("capacity", capacity), ("device_total", device_total)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise BadInput(f"{name}={value!r} is not a byte count: pass a whole number >= 0, or None")
        self.config = conf if isinstance(conf, AllocatorConfig) else AllocatorConfig.parse(conf)
        self.capacity = capacity
        self.device_total = device_total if device_total is not None else capacity
        self.device = device
        #: Hooks tried, in order, before a new segment is allocated (``FreeCudaMemoryCallbacksRegistry``);
        #: each returns whether it freed memory.
        self.free_memory_callbacks: list[Callable[[], bool]] = []
        cfg = self.config
        self._max_split = cfg.max_split_size
        self._rounding = any(d > 1 for d in cfg.roundup_power2_divisions)
        self._expandable = cfg.expandable_segments
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._live: dict[int, _Block] = {}
        self._next_addr = _FIRST_ADDRESS
        self._segments: list[_Expandable] = []
        self._total = 0  # total_allocated_memory: what cudaMalloc and cuMemMap hold
        self._allowed: int | None = None  # allowed_memory_maximum
        self._gc = False
        n = 3 * len(_STATS)
        self._cur, self._peak, self._inc, self._dec = [0] * n, [0] * n, [0] * n, [0] * n
        self._over = [0] * 8  # oversize_allocations then oversize_segments: current, peak, allocated, freed
        self._counters = dict.fromkeys(("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                        "num_device_alloc", "num_device_free"), 0)
        if cfg.per_process_memory_fraction < 1.0:
            self.set_per_process_memory_fraction(cfg.per_process_memory_fraction)

    # ----------------------------------------------------------------- public API

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """``DeviceCachingAllocator::malloc``: a block of at least ``nbytes`` on ``stream``; returns its handle."""
        if nbytes <= 0:
            if nbytes == 0:
                return 0
            raise BadInput(f"malloc(nbytes={nbytes}): a request needs a byte count >= 0")
        if self._rounding:
            size = round_size(nbytes, self.config)
        else:
            size = KMIN_BLOCK_SIZE if nbytes < KMIN_BLOCK_SIZE else -(-nbytes // KMIN_BLOCK_SIZE) * KMIN_BLOCK_SIZE
        pool = self._small if size <= KSMALL_SIZE else self._large
        block = self._get_free_block(pool, size, stream)
        if block is None and self.free_memory_callbacks and self._trigger_callbacks():
            block = self._get_free_block(pool, size, stream)
        if block is None:
            block = self._allocate_new(pool, size, stream)
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= KMIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > KSMALL_SIZE
        return self._alloc_found_block(block, size, nbytes, split)

    def free(self, handle: int) -> None:
        """``DeviceCachingAllocator::free``: give a block back to its pool, merged with free neighbours."""
        block = self._live.pop(handle, None)
        if block is None:
            if handle == 0:
                return
            raise BadInput(f"free(handle={handle}): invalid device pointer, not a live allocation of this "
                           "allocator; pass a handle that malloc() returned and that was not freed yet")
        block.allocated = False
        size = block.size
        pool = block.pool
        cur, dec, t = self._cur, self._dec, pool.type
        for i in (_ALLOC, _ALLOC + t):
            cur[i] -= 1
            dec[i] += 1
        for i in (_ABYTES, _ABYTES + t):
            cur[i] -= size
            dec[i] += size
        if size >= self._max_split:
            self._over[0] -= 1
            self._over[3] += 1
        self._free_block(block)

    def empty_cache(self) -> None:
        """``emptyCache``: release every cached segment that holds no allocation (``release_cached_blocks``)."""
        self._release_cached_blocks()

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """``setMemoryFraction``: cap what this allocator may reserve at ``fraction`` x ``device_total``."""
        if not 0.0 <= fraction <= 1.0:
            raise BadInput(f"per_process_memory_fraction={fraction} is invalid: set it in [0.0, 1.0]")
        if self.device_total is None:
            raise BadInput("per_process_memory_fraction needs the device's size: pass capacity or device_total")
        self._allowed = int(fraction * self.device_total) if fraction < 1.0 else None
        self._gc = self._allowed is not None and self.config.garbage_collection_threshold > 0.0

    @property
    def allocated(self) -> int:
        """``torch.cuda.memory_allocated()``: bytes in allocated blocks."""
        return self._cur[_ABYTES]

    @property
    def reserved(self) -> int:
        """``torch.cuda.memory_reserved()``: bytes held from the device (cudaMalloc'd or mapped)."""
        return self._cur[_RBYTES]

    @property
    def max_allocated(self) -> int:
        """``torch.cuda.max_memory_allocated()``."""
        return self._peak[_ABYTES]

    @property
    def max_reserved(self) -> int:
        """``torch.cuda.max_memory_reserved()``."""
        return self._peak[_RBYTES]

    def block_size(self, handle: int) -> int:
        """The size of the block behind a live handle (what allocated_bytes counts for it)."""
        block = self._live.get(handle)
        if block is None:
            raise BadInput(f"block_size(handle={handle}): not a live allocation of this allocator")
        return block.size

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: the same flat, sorted key names."""
        out: dict[str, int] = {}
        cur, peak, inc, dec = self._cur, self._peak, self._inc, self._dec
        names = {name: 3 * i for i, name in enumerate(_STATS)}
        names["active"] = _ALLOC  # nothing waits on another stream: active blocks are the allocated ones
        names["active_bytes"] = _ABYTES
        for name, base in names.items():
            for t, type_name in enumerate(_TYPES):
                i = base + t
                prefix = f"{name}.{type_name}."
                out[prefix + "current"] = cur[i]
                out[prefix + "peak"] = peak[i]
                out[prefix + "allocated"] = inc[i]
                out[prefix + "freed"] = dec[i]
        for k, name in ((0, "oversize_allocations"), (4, "oversize_segments")):
            for j, field in enumerate(("current", "peak", "allocated", "freed")):
                out[f"{name}.{field}"] = self._over[k + j]
        out.update(self._counters)
        out["num_oom_rejections"] = 0
        out["max_split_size"] = -1 if self._max_split == SIZE_MAX else self._max_split
        return dict(sorted(out.items()))

    def reset_peak_stats(self) -> None:
        """``resetPeakStats``: every peak drops to its current value."""
        self._peak[:] = self._cur
        self._over[1], self._over[5] = self._over[0], self._over[4]

    def reset_accumulated_stats(self) -> None:
        """``resetAccumulatedStats``: the allocated/freed totals and the event counters restart at zero."""
        n = len(self._inc)
        self._inc[:], self._dec[:] = [0] * n, [0] * n
        self._over[2:4], self._over[6:8] = [0, 0], [0, 0]
        self._counters = dict.fromkeys(self._counters, 0)

    def segments(self) -> list[SegmentInfo]:
        """``snapshot``: every segment (expandable ones: every mapped range), by address."""
        heads: list[_Block] = [b for b in self._live.values() if b.prev is None or not b.prev.mapped]
        for pool in (self._small, self._large):
            heads += [b for b in pool.blocks.values() if b.prev is None or not b.prev.mapped]
        out = []
        for head in heads:
            blocks = []
            b: _Block | None = head
            while b is not None and b.mapped:
                blocks.append(BlockInfo(b.size, b.requested if b.allocated else 0, b.allocated))
                b = b.next
            out.append(SegmentInfo(head.addr, sum(x.size for x in blocks), head.stream, not head.pool.small,
                                   head.seg is not None, tuple(blocks)))
        return sorted(out, key=lambda s: s.address)

    # ------------------------------------------------------- the pool's sorted set

    def _insert(self, pool: _Pool, block: _Block) -> None:
        """``BlockPool::insert_into_blocks``: cache a free block and stamp its age (``gc_count_base``)."""
        block.gc_base = pool.gc_calls
        key = block.size << _SHIFT | block.addr
        keys = pool.keys.get(block.stream)
        if keys is None:
            pool.keys[block.stream] = [key]
        else:
            insort(keys, key)
        pool.blocks[key] = block

    def _erase(self, pool: _Pool, block: _Block) -> None:
        key = block.size << _SHIFT | block.addr
        keys = pool.keys[block.stream]
        del keys[bisect_left(keys, key)]
        del pool.blocks[key]

    def _insert_unmapped(self, pool: _Pool, block: _Block) -> None:
        insort(pool.unmapped.setdefault(block.stream, []), block.addr)
        pool.unmapped_blocks[block.addr] = block

    def _erase_unmapped(self, pool: _Pool, block: _Block) -> None:
        addrs = pool.unmapped[block.stream]
        del addrs[bisect_left(addrs, block.addr)]
        del pool.unmapped_blocks[block.addr]

    def _up(self, stat: int, t: int, n: int) -> None:
        cur, peak, inc = self._cur, self._peak, self._inc
        for i in (stat, stat + t):
            v = cur[i] + n
            cur[i] = v
            if v > peak[i]:  # noqa: PLR1730 (a branch costs a tenth of max() on the hot path)
                peak[i] = v
            inc[i] += n

    def _down(self, stat: int, t: int, n: int) -> None:
        cur, dec = self._cur, self._dec
        for i in (stat, stat + t):
            cur[i] -= n
            dec[i] += n

    def _oversize(self, k: int, n: int) -> None:
        over = self._over
        over[k] += n
        if n > 0:
            over[k + 2] += n
            over[k + 1] = max(over[k + 1], over[k])
        else:
            over[k + 3] -= n

    # ------------------------------------------------------------- finding blocks

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``get_free_block``: the best fit of the same stream and pool, under the oversize rules."""
        if self._gc:
            pool.gc_calls += 1
        keys = pool.keys.get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        block = pool.blocks[keys[i]]
        if block.seg is not None:
            # An expandable block counts as big as it can grow: skip to a larger one that grows less.
            j = i + 1
            while block.seg is not None and j < len(keys):
                other = pool.blocks[keys[j]]
                if _expandable_size(other) >= _expandable_size(block):
                    break
                i, block, j = j, other, j + 1
        max_split = self._max_split
        if size < max_split and block.size >= max_split:
            return None  # do not hand an oversize block to a request that may be split
        if size >= max_split and block.size >= size + self.config.max_non_split_rounding_size:
            return None  # an oversize block is used only within max_non_split_rounding_size of the request
        del pool.blocks[keys[i]]
        del keys[i]
        return block

    def _trigger_callbacks(self) -> bool:
        """``trigger_free_memory_callbacks``: run every hook; True when any freed memory."""
        freed = False
        for callback in self.free_memory_callbacks:
            freed |= bool(callback())
        return freed

    def _allocate_new(self, pool: _Pool, size: int, stream: int) -> _Block:
        """The part of ``malloc`` after the cache missed: new segment, release-and-retry, or out of memory."""
        alloc_size = get_allocation_size(size, self.config)
        if self._gc:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size, alloc_size, stream, False)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, alloc_size, stream, False)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, stream, True)
        if block is None:
            self._counters["num_ooms"] += 1
            self._raise_oom(alloc_size)
        return block

    def _alloc_found_block(self, block: _Block, size: int, requested: int, split: bool) -> int:
        """``alloc_found_block``: split off the remainder when ``should_split`` said so, count the allocation."""
        pool = block.pool
        t = pool.type
        already_split = block.prev is not None or block.next is not None
        if split:
            remaining = block
            block = _Block(remaining.addr, size, remaining.stream, pool, remaining.seg)
            _splice(block, remaining.prev, remaining)
            remaining.addr += size
            remaining.size -= size
            self._insert(pool, remaining)
            if remaining.seg is None:
                if already_split:
                    self._down(_ISBYTES, t, size)
                else:
                    self._up(_ISBYTES, t, remaining.size)
                    self._up(_ISPLIT, t, 1)
        elif already_split and block.seg is None:
            self._down(_ISBYTES, t, block.size)
            self._down(_ISPLIT, t, 1)
        block.allocated = True
        block.requested = requested
        self._live[block.addr] = block
        cur, peak, inc = self._cur, self._peak, self._inc
        bsize = block.size
        for i, n in ((_ALLOC, 1), (_ALLOC + t, 1), (_ABYTES, bsize), (_ABYTES + t, bsize),
                     (_QBYTES, requested), (_QBYTES + t, requested)):
            v = cur[i] + n
            cur[i] = v
            if v > peak[i]:  # noqa: PLR1730 (a branch costs a tenth of max() on the hot path)
                peak[i] = v
            inc[i] += n
        if bsize >= self._max_split:
            self._oversize(0, 1)
        return block.addr

    def _free_block(self, block: _Block) -> None:
        """``free_block``: merge with free neighbours (``try_merge_blocks``) and cache the result."""
        pool = block.pool
        t = pool.type
        requested = block.requested
        merged_blocks = merged_bytes = 0
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            self._erase(pool, prev)
            block.addr = prev.addr
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
            block.size += prev.size
            merged_blocks -= 1
            merged_bytes -= prev.size
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._erase(pool, nxt)
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
            block.size += nxt.size
            merged_blocks -= 1
            merged_bytes -= nxt.size
        self._insert(pool, block)
        if block.seg is None:
            if block.prev is not None or block.next is not None:
                merged_blocks += 1
                merged_bytes += block.size
            for stat, n in ((_ISPLIT, merged_blocks), (_ISBYTES, merged_bytes)):
                if n > 0:
                    self._up(stat, t, n)
                elif n < 0:
                    self._down(stat, t, -n)
        cur, dec = self._cur, self._dec
        for i in (_QBYTES, _QBYTES + t):
            cur[i] -= requested
            dec[i] += requested

    # --------------------------------------------------------- getting new memory

    def _new_address(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += -(-size // KSMALL_BUFFER) * KSMALL_BUFFER
        return addr

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, stream: int, retry: bool) -> _Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` (or mapped pages), None when the device says no."""
        if retry:
            self._counters["num_alloc_retries"] += 1
        if self._allowed is not None and self._total + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self.capacity is not None and self._total + alloc_size > self.capacity:
            return None  # cudaMalloc: cudaErrorMemoryAllocation
        self._total += alloc_size
        block = _Block(self._new_address(alloc_size), alloc_size, stream, pool, None)
        self._up(_SEG, pool.type, 1)
        self._up(_RBYTES, pool.type, alloc_size)
        if alloc_size >= self._max_split:
            self._oversize(4, 1)
        self._counters["num_device_alloc"] += 1
        return block

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: past the threshold, release the older unsplit large blocks."""
        assert self._allowed is not None
        threshold = int(self.config.garbage_collection_threshold * self._allowed)
        if self._total <= threshold:
            return
        target = self._total - threshold
        pool = self._large
        calls = pool.gc_calls
        ages = [calls - b.gc_base for b in pool.blocks.values() if b.prev is None and b.next is None]
        total_age, count = sum(ages), len(ages)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count  # free blocks at least as old as the average first
            freed = False
            for block in _in_order(pool):
                age = calls - block.gc_base
                if block.prev is None and block.next is None and block.seg is None and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    def _release_block(self, block: _Block) -> None:
        """``release_block``: cudaFree an unsplit cached segment."""
        pool = block.pool
        self._erase(pool, block)
        self._total -= block.size
        self._down(_SEG, pool.type, 1)
        self._down(_RBYTES, pool.type, block.size)
        if block.size >= self._max_split:
            self._oversize(4, -1)
        self._counters["num_device_free"] += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, free oversize blocks, enough for the request."""
        max_split = self._max_split
        if max_split == SIZE_MAX:
            return False
        target = max(size, max_split)
        keys = pool.keys.get(stream, [])
        i = bisect_left(keys, target << _SHIFT)
        if i < len(keys) and pool.blocks[keys[i]].seg is None:
            self._release_block(pool.blocks[keys[i]])
            return True
        released = 0
        for key in reversed(keys[:i]):  # no single block is large enough: free the largest oversize ones
            block = pool.blocks[key]
            if released >= target or block.size < max_split:
                break
            if block.seg is None:
                released += block.size
                self._release_block(block)
        return released >= target

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: free every unsplit cached segment, unmap every free expandable page."""
        self._counters["num_sync_all_streams"] += 1
        for pool in (self._large, self._small):
            to_unmap = []
            for block in _in_order(pool):  # release_blocks
                if block.seg is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None and not block.mapped:
                    self._erase_unmapped(pool, block)  # release_expandable_segment
                    self._segments.remove(block.seg)  # type: ignore[arg-type]

    # ------------------------------------------------------------ expandable segments

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address with room for ``size``."""
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._erase(pool, candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block:
        """``find_expandable_block``: the lowest free-or-unmapped run with ``size`` bytes, else a new segment."""
        for addr in pool.unmapped.get(stream, ()):
            candidate = pool.unmapped_blocks[addr]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room, run = 0, candidate  # has_available_address_space
            while room < size and run is not None and not run.allocated:
                room += run.size
                run = run.next  # type: ignore[assignment]
            if room >= size:
                return candidate
        page = KSMALL_BUFFER if pool.small else self.config.large_segment_size
        total = self.device_total if self.device_total is not None else _NO_CAPACITY_VA
        va = -(-(total + total // 8) // page) * page
        seg = _Expandable(self._new_address(va), page, va)
        self._segments.append(seg)
        block = _Block(seg.base, va, stream, pool, seg)
        block.mapped = False
        self._insert_unmapped(pool, block)
        return block

    def _map_block(self, block: _Block, size: int) -> bool:
        """``map_block``: back the start of an unmapped block with whole pages, merge with free neighbours."""
        seg = block.seg
        assert seg is not None
        start, length = seg.map_range(block.addr, size)
        if self.capacity is not None and self._total + length > self.capacity:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY
        pool = block.pool
        self._erase_unmapped(pool, block)
        block.mapped = True
        if length < block.size:
            rest = _Block(start + length, block.size - length, block.stream, pool, seg)
            rest.mapped = False
            _splice(rest, block, block.next)
            self._insert_unmapped(pool, rest)
            block.size = length
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(pool, block)
        self._total += length
        self._up(_RBYTES, pool.type, length)
        self._counters["num_device_alloc"] += 1
        return True

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: return the whole free pages of a cached block to the device."""
        seg = block.seg
        assert seg is not None
        start, length = seg.unmap_range(block.addr, block.size)
        if length == 0:
            return
        pool = block.pool
        self._erase(pool, block)
        before = start - block.addr
        if before > 0:
            head = _Block(block.addr, before, block.stream, pool, seg)
            _splice(head, block.prev, block)
            self._insert(pool, head)
        after = block.size - before - length
        if after > 0:
            tail = _Block(start + length, after, block.stream, pool, seg)
            _splice(tail, block, block.next)
            self._insert(pool, tail)
        block.addr, block.size, block.mapped = start, length, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_unmapped(pool, block)
        self._total -= length
        self._down(_RBYTES, pool.type, length)
        self._counters["num_device_free"] += 1

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: absorb a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._erase(src.pool, src)
        else:
            self._erase_unmapped(src.pool, src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # ---------------------------------------------------------------- out of memory

    def _raise_oom(self, alloc_size: int) -> NoReturn:
        """The ``TORCH_CHECK_WITH(OutOfMemoryError, ...)`` at the end of ``malloc``, in CUDA's words."""
        import torch

        total = self.device_total if self.device_total is not None else self._total
        free = (self.capacity if self.capacity is not None else total) - self._total
        allowed = f"{format_size(self._allowed)} allowed; " if self._allowed is not None else ""
        allocated, reserved = self._cur[_ABYTES], self._cur[_RBYTES]
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {self.device} has a total "
            f"capacity of {format_size(total)} of which {format_size(max(free, 0))} is free. {allowed}"
            f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def _expandable_size(block: _Block) -> int:
    """What a free block of an expandable segment can grow to: itself plus the unmapped range after it."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _in_order(pool: _Pool) -> list[_Block]:
    """The pool's free blocks in ``BlockComparatorSize`` order (stream, size, address), as a snapshot."""
    return [pool.blocks[k] for stream in sorted(pool.keys) for k in pool.keys[stream]]
