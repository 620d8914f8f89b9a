"""CUDA's caching allocator, replayed in pure Python.

:class:`CachingAllocator` follows the policy of PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) decision for
decision, so a trace of mallocs and frees gives the bytes a GPU would have
*reserved* (what decides an out-of-memory error), not only the bytes the
tensors hold. Each method names the C++ function it mirrors. Not modelled: CUDA
graphs and private memory pools, cross-stream use (``record_stream``) and its
events, IPC, and where the driver places segments (new segments get increasing
addresses here; addresses only break ties between equal-sized free blocks).

A malloc or free costs a few microseconds: see allocator_blocks for the sorted
free lists.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import NoReturn

from ..errors import BadInput
from .allocator_blocks import KEY_SHIFT, Block, BlockPool, ExpandableSegment
from .allocator_stats import (
    ABYTES,
    ALLOC,
    ISBYTES,
    ISPLIT,
    QBYTES,
    RBYTES,
    SEG,
    BlockInfo,
    DeviceStats,
    SegmentInfo,
)
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

_FIRST_ADDRESS = 1 << 32
_UNKNOWN_DEVICE_VA = 1 << 44  # address space of an expandable segment when the device's size is unknown


class CachingAllocator:
    """A replica of PyTorch's CUDA caching allocator for one device.

    ``capacity`` is what cudaMalloc can hand out in total (None: unlimited);
    ``conf`` is a ``PYTORCH_CUDA_ALLOC_CONF`` string (or a parsed
    :class:`AllocatorConfig`). ``device_total`` is the GPU's total memory, used
    by ``per_process_memory_fraction`` and the out-of-memory message (default:
    ``capacity``). ``malloc`` returns a handle (the block's address; 0 for a
    zero-byte request, as PyTorch returns nullptr), ``free`` takes it back.
    Running out raises ``torch.OutOfMemoryError`` with CUDA's message.

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
        #: Hooks tried, in order, when no cached block fits (``FreeCudaMemoryCallbacksRegistry``);
        #: each returns whether it freed memory.
        self.free_memory_callbacks: list[Callable[[], bool]] = []
        #: Told ``(action, address, size, stream)`` whenever device memory is taken or given back:
        #: ``segment_alloc``/``segment_free`` (cudaMalloc, cudaFree), ``segment_map``/``segment_unmap``
        #: (pages of an expandable segment), as ``torch.cuda.memory._snapshot()``'s trace names them.
        self.on_segment: Callable[[str, int, int, int], None] | None = None
        self.stats = DeviceStats()
        self._max_split = self.config.max_split_size
        self._rounding = any(d > 1 for d in self.config.roundup_power2_divisions)
        self._expandable = self.config.expandable_segments
        self._small = BlockPool(True)
        self._large = BlockPool(False)
        self._live: dict[int, Block] = {}
        self._next_addr = _FIRST_ADDRESS
        self._total = 0  # total_allocated_memory: bytes held by cudaMalloc and cuMemMap
        self._allowed: int | None = None  # allowed_memory_maximum
        self._gc = False
        #: What the last out-of-memory error asked the device for (the new segment's size), 0 before any.
        self.oom_segment_bytes = 0
        if self.config.per_process_memory_fraction < 1.0:
            self.set_per_process_memory_fraction(self.config.per_process_memory_fraction)

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
        pool = self._small if size <= KSMALL_SIZE else self._large  # get_pool
        block = self._get_free_block(pool, size, stream)
        if block is None and self.free_memory_callbacks and self._trigger_free_memory_callbacks():
            block = self._get_free_block(pool, size, stream)
        if block is None:
            block = self._allocate_new(pool, size, stream)
        return self._alloc_found_block(block, size, nbytes, self._should_split(block, size))

    def free(self, handle: int) -> None:
        """``DeviceCachingAllocator::free``: give a block back to its pool, merged with free neighbours."""
        block = self._live.pop(handle, None)
        if block is None:
            if handle == 0:
                return
            raise BadInput(f"free(handle={handle}): invalid device pointer, not a live allocation of this "
                           "allocator; pass a handle that malloc() returned and that was not freed yet")
        block.allocated = False
        size, t = block.size, block.pool.type
        st = self.stats
        cur, dec = st.cur, st.dec
        cur[ALLOC] -= 1
        cur[ALLOC + t] -= 1
        dec[ALLOC] += 1
        dec[ALLOC + t] += 1
        cur[ABYTES] -= size
        cur[ABYTES + t] -= size
        dec[ABYTES] += size
        dec[ABYTES + t] += size
        if size >= self._max_split:
            st.oversize(0, -1)
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
        return self.stats.cur[ABYTES]

    @property
    def reserved(self) -> int:
        """``torch.cuda.memory_reserved()``: bytes held from the device (cudaMalloc'd or mapped)."""
        return self.stats.cur[RBYTES]

    @property
    def max_allocated(self) -> int:
        """``torch.cuda.max_memory_allocated()``."""
        return self.stats.peak[ABYTES]

    @property
    def max_reserved(self) -> int:
        """``torch.cuda.max_memory_reserved()``."""
        return self.stats.peak[RBYTES]

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: the same flat, sorted key names."""
        return self.stats.as_dict(self._max_split)

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: every peak drops to its current value."""
        self.stats.reset_peak()

    def reset_accumulated_stats(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``: totals and event counters restart at zero."""
        self.stats.reset_accumulated()

    def block_size(self, handle: int) -> int:
        """The size of the block behind a live handle (what allocated_bytes counts for it)."""
        block = self._live.get(handle)
        if block is None:
            raise BadInput(f"block_size(handle={handle}): not a live allocation of this allocator")
        return block.size

    def segments(self) -> list[SegmentInfo]:
        """``snapshot``: every segment (for expandable segments, every mapped range), by address."""
        heads = [b for b in self._live.values() if b.prev is None or not b.prev.mapped]
        for pool in (self._small, self._large):
            heads += [b for b in pool.blocks.values() if b.prev is None or not b.prev.mapped]
        out = []
        for head in heads:
            blocks = []
            b: Block | None = head
            while b is not None and b.mapped:
                blocks.append(BlockInfo(b.size, b.requested if b.allocated else 0, b.allocated))
                b = b.next
            out.append(SegmentInfo(head.addr, sum(x.size for x in blocks), head.stream, not head.pool.small,
                                   head.seg is not None, tuple(blocks)))
        return sorted(out, key=lambda s: s.address)

    # ------------------------------------------------------------ using the cache

    def _get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """``get_free_block``: the best fit of the same stream and pool, under the oversize rules."""
        if self._gc:
            pool.gc_calls += 1
        keys = pool.keys.get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << KEY_SHIFT)
        if i == len(keys):
            return None
        block = pool.blocks[keys[i]]
        if block.seg is not None:
            # A block of an expandable segment counts as big as it can grow: prefer a larger one that grows less.
            j = i + 1
            while block.seg is not None and j < len(keys):
                other = pool.blocks[keys[j]]
                if other.expandable_size() >= block.expandable_size():
                    break
                i, block, j = j, other, j + 1
        max_split = self._max_split
        if size < max_split and block.size >= max_split:
            return None  # an oversize block is not handed to a request that could be split from it
        if size >= max_split and block.size >= size + self.config.max_non_split_rounding_size:
            return None  # an oversize request takes an oversize block only within max_non_split_rounding_size
        del pool.blocks[keys[i]]
        del keys[i]
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """``should_split``: small pool and expandable segments split off >= 512 B; large blocks > 1 MiB."""
        remaining = block.size - size
        if block.pool.small or self._expandable:
            return remaining >= KMIN_BLOCK_SIZE
        return size < self._max_split and remaining > KSMALL_SIZE

    def _alloc_found_block(self, block: Block, size: int, requested: int, split: bool) -> int:
        """``alloc_found_block``: split the remainder off when asked, count the allocation at the block's size."""
        pool = block.pool
        st, t = self.stats, pool.type
        already_split = block.prev is not None or block.next is not None
        if split:
            remaining = block
            block = Block(remaining.addr, size, remaining.stream, pool, remaining.seg)
            prev = block.prev = remaining.prev
            if prev is not None:
                prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
            if remaining.seg is None:
                if already_split:
                    st.down(ISBYTES, t, size)
                else:
                    st.up(ISBYTES, t, remaining.size)
                    st.up(ISPLIT, t, 1)
        elif already_split and block.seg is None:
            st.down(ISBYTES, t, block.size)
            st.down(ISPLIT, t, 1)
        block.allocated = True
        block.requested = requested
        self._live[block.addr] = block
        # allocation, allocated_bytes and requested_bytes, for all pools and this one (spelled out: hot path)
        cur, peak, inc = st.cur, st.peak, st.inc
        bsize = block.size
        for i, n in ((ALLOC, 1), (ABYTES, bsize), (QBYTES, requested), (ALLOC + t, 1), (ABYTES + t, bsize),
                     (QBYTES + t, requested)):
            v = cur[i] + n
            cur[i] = v
            if v > peak[i]:  # noqa: PLR1730 (a branch costs a tenth of max() on the hot path)
                peak[i] = v
            inc[i] += n
        if bsize >= self._max_split:
            st.oversize(0, 1)
        return block.addr

    def _free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours and cache the result; count inactive split blocks."""
        pool = block.pool
        st, t = self.stats, pool.type
        requested = block.requested
        merged = merged_bytes = 0
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                subsumed = self._try_merge_blocks(block, neighbour)
                if subsumed:
                    merged -= 1
                    merged_bytes -= subsumed
        pool.insert(block)
        if block.seg is None:
            if block.prev is not None or block.next is not None:
                merged += 1
                merged_bytes += block.size
            if merged:
                st.change(ISPLIT, t, merged)
            if merged_bytes:
                st.change(ISBYTES, t, merged_bytes)
        cur, dec = st.cur, st.dec
        cur[QBYTES] -= requested
        cur[QBYTES + t] -= requested
        dec[QBYTES] += requested
        dec[QBYTES + t] += requested

    def _try_merge_blocks(self, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks``: absorb a free neighbour in the same mapped state; returns its size or 0."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        src.pool.erase_any(src)
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
        return src.size

    def _trigger_free_memory_callbacks(self) -> bool:
        """``trigger_free_memory_callbacks``: run every hook; True when any freed memory."""
        freed = False
        for callback in self.free_memory_callbacks:
            freed |= bool(callback())
        return freed

    # ------------------------------------------------------------ new memory

    def _allocate_new(self, pool: BlockPool, size: int, stream: int) -> Block:
        """The part of ``malloc`` after the cache missed: new memory, release-and-retry, or out of memory."""
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
            self.stats.counters["num_ooms"] += 1
            self._raise_oom(alloc_size)
        return block

    def _new_address(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += -(-size // KSMALL_BUFFER) * KSMALL_BUFFER
        return addr

    def _alloc_block(self, pool: BlockPool, size: int, alloc_size: int, stream: int, retry: bool) -> Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` (or new mapped pages); None when the device says no."""
        st = self.stats
        if retry:
            st.counters["num_alloc_retries"] += 1
        if self._allowed is not None and self._total + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self.capacity is not None and self._total + alloc_size > self.capacity:
            return None  # cudaMalloc: cudaErrorMemoryAllocation
        self._total += alloc_size
        block = Block(self._new_address(alloc_size), alloc_size, stream, pool, None)
        if self.on_segment is not None:
            self.on_segment("segment_alloc", block.addr, alloc_size, stream)
        st.up(SEG, pool.type, 1)
        st.up(RBYTES, pool.type, alloc_size)
        if alloc_size >= self._max_split:
            st.oversize(4, 1)
        st.counters["num_device_alloc"] += 1
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
        ages = [calls - b.gc_base for b in pool.blocks.values() if not b.is_split()]
        total_age, count = sum(ages), len(ages)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count  # free the blocks at least as old as the average first
            freed = False
            for block in pool.in_order():
                age = calls - block.gc_base
                if not block.is_split() and block.seg is None and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    def _release_block(self, block: Block) -> None:
        """``release_block``: cudaFree an unsplit cached segment."""
        pool = block.pool
        pool.erase(block)
        if self.on_segment is not None:
            self.on_segment("segment_free", block.addr, block.size, block.stream)
        self._total -= block.size
        self.stats.down(SEG, pool.type, 1)
        self.stats.down(RBYTES, pool.type, block.size)
        if block.size >= self._max_split:
            self.stats.oversize(4, -1)
        self.stats.counters["num_device_free"] += 1

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, free oversize blocks, enough for
        the request."""
        max_split = self._max_split
        if max_split == SIZE_MAX:
            return False
        target = max(size, max_split)
        keys = pool.keys.get(stream, [])
        i = bisect_left(keys, target << KEY_SHIFT)
        if i < len(keys) and pool.blocks[keys[i]].seg is None:
            self._release_block(pool.blocks[keys[i]])  # one cached block is large enough
            return True
        released = 0
        for key in reversed(keys[:i]):  # none is: free the largest oversize ones until the sum is
            block = pool.blocks[key]
            if released >= target or block.size < max_split:
                break
            if block.seg is None:
                released += block.size
                self._release_block(block)
        return released >= target

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: free every unsplit cached segment, unmap every free expandable page."""
        self.stats.counters["num_sync_all_streams"] += 1  # synchronize_and_free_events
        for pool in (self._large, self._small):
            to_unmap = []
            for block in pool.in_order():  # release_blocks
                if block.seg is not None:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.is_split() and not block.mapped:
                    pool.erase_unmapped(block)  # release_expandable_segment

    # ------------------------------------------------------------ expandable segments

    def _try_allocate_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
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
        pool.erase(candidate)
        return candidate

    def _find_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block:
        """``find_expandable_block``: the lowest free-or-unmapped run with ``size`` bytes, else a new segment."""
        for candidate in pool.unmapped_in_order(stream):
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room, run = 0, candidate  # has_available_address_space
            while room < size and run is not None and not run.allocated:
                room += run.size
                run = run.next  # type: ignore[assignment]
            if room >= size:
                return candidate
        page = KSMALL_BUFFER if pool.small else self.config.large_segment_size
        total = self.device_total if self.device_total is not None else _UNKNOWN_DEVICE_VA
        # address space for 1 1/8 of the device's memory; a request past it fails at map_block on a GPU, but
        # without a capacity (a GPU large enough) the segment must hold it
        va = -(-max(total + total // 8, size if self.capacity is None else 0) // page) * page
        seg = ExpandableSegment(self._new_address(va), page, va)
        block = Block(seg.base, va, stream, pool, seg)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _map_block(self, block: Block, size: int) -> bool:
        """``map_block``: back the start of an unmapped block with whole pages, merge with free neighbours."""
        seg = block.seg
        assert seg is not None
        start, length = seg.map_range(block.addr, size)
        if self.capacity is not None and self._total + length > self.capacity:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY
        pool = block.pool
        pool.erase_unmapped(block)
        block.mapped = True
        if length < block.size:
            rest = Block(start + length, block.size - length, block.stream, pool, seg)
            rest.mapped = False
            rest.splice(block, block.next)
            pool.insert_unmapped(rest)
            block.size = length
        self._try_merge_blocks(block, block.prev)
        self._try_merge_blocks(block, block.next)
        pool.insert(block)
        self._total += length
        if self.on_segment is not None:
            self.on_segment("segment_map", start, length, block.stream)
        self.stats.up(RBYTES, pool.type, length)
        self.stats.counters["num_device_alloc"] += 1
        return True

    def _unmap_block(self, block: Block) -> None:
        """``unmap_block``: give the whole free pages of a cached block back to the device."""
        seg = block.seg
        assert seg is not None
        start, length = seg.unmap_range(block.addr, block.size)
        if length == 0:
            return
        pool = block.pool
        pool.erase(block)
        before = start - block.addr
        if before > 0:
            head = Block(block.addr, before, block.stream, pool, seg)
            head.splice(block.prev, block)
            pool.insert(head)
        after = block.size - before - length
        if after > 0:
            tail = Block(start + length, after, block.stream, pool, seg)
            tail.splice(block, block.next)
            pool.insert(tail)
        block.addr, block.size, block.mapped = start, length, False
        self._try_merge_blocks(block, block.prev)
        self._try_merge_blocks(block, block.next)
        pool.insert_unmapped(block)
        self._total -= length
        if self.on_segment is not None:
            self.on_segment("segment_unmap", start, length, block.stream)
        self.stats.down(RBYTES, pool.type, length)
        self.stats.counters["num_device_free"] += 1

    # ---------------------------------------------------------------- out of memory

    def _raise_oom(self, alloc_size: int) -> NoReturn:
        """The ``TORCH_CHECK_WITH(OutOfMemoryError, ...)`` at the end of ``malloc``, in CUDA's words."""
        import torch

        self.oom_segment_bytes = alloc_size

        total = self.device_total if self.device_total is not None else self._total
        free = (self.capacity if self.capacity is not None else total) - self._total
        allowed = f"{format_size(self._allowed)} allowed; " if self._allowed is not None else ""
        allocated, reserved = self.allocated, self.reserved
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {self.device} has a total "
            f"capacity of {format_size(total)} of which {format_size(max(free, 0))} is free. {allowed}"
            f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")

