"""The data structures of the caching-allocator replica: blocks, pools, expandable segments.

``Block``, ``BlockPool`` and ``ExpandableSegment`` of PyTorch's
``c10/cuda/CUDACachingAllocator.cpp``. A pool keeps its cached free blocks in
``BlockComparatorSize`` order (stream, size, address) as one sorted list of
integer keys per stream, ``size << KEY_SHIFT | address``, so the best fit is a
:func:`bisect.bisect_left` away; unmapped blocks of expandable segments are
kept by address (``BlockComparatorAddress``).
"""

from __future__ import annotations

from bisect import bisect_left, insort

KEY_SHIFT = 56  # free-block key: size << KEY_SHIFT | address (addresses stay below 2**56)


class Block:
    """``Block``: a range of a segment, free or allocated; ``prev``/``next`` link the ranges of one segment."""

    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "pool", "prev", "requested", "seg", "size",
                 "stream")

    def __init__(self, addr: int, size: int, stream: int, pool: BlockPool, seg: ExpandableSegment | None):
        self.addr = addr
        self.size = size
        self.stream = stream
        self.pool = pool
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.requested = 0
        self.mapped = True
        self.seg = seg
        self.gc_base = 0  # gc_count_base: the pool's get_free_block count when the block was cached

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        """``Block::splice``: put this block between ``before`` and ``after``."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    def expandable_size(self) -> int:
        """What a free block of an expandable segment can grow to: itself plus the unmapped range after it."""
        nxt = self.next
        return self.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class BlockPool:
    """``BlockPool``: the cached free blocks of the small or the large pool, by stream."""

    __slots__ = ("blocks", "gc_calls", "keys", "small", "type", "unmapped", "unmapped_blocks")

    def __init__(self, small: bool):
        self.small = small
        self.type = 1 if small else 2  # index of the pool's statistics (0 is "all")
        self.keys: dict[int, list[int]] = {}  # stream -> sorted size << KEY_SHIFT | address
        self.blocks: dict[int, Block] = {}  # key -> cached free block
        self.unmapped: dict[int, list[int]] = {}  # stream -> sorted addresses of unmapped blocks
        self.unmapped_blocks: dict[int, Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, block: Block) -> None:
        """``insert_into_blocks``: cache a free block and stamp its age."""
        block.gc_base = self.gc_calls
        key = block.size << KEY_SHIFT | block.addr
        keys = self.keys.get(block.stream)
        if keys is None:
            self.keys[block.stream] = [key]
        else:
            insort(keys, key)
        self.blocks[key] = block

    def erase(self, block: Block) -> None:
        key = block.size << KEY_SHIFT | block.addr
        keys = self.keys[block.stream]
        del keys[bisect_left(keys, key)]
        del self.blocks[key]

    def insert_unmapped(self, block: Block) -> None:
        insort(self.unmapped.setdefault(block.stream, []), block.addr)
        self.unmapped_blocks[block.addr] = block

    def erase_unmapped(self, block: Block) -> None:
        addrs = self.unmapped[block.stream]
        del addrs[bisect_left(addrs, block.addr)]
        del self.unmapped_blocks[block.addr]

    def erase_any(self, block: Block) -> None:
        if block.mapped:
            self.erase(block)
        else:
            self.erase_unmapped(block)

    def in_order(self) -> list[Block]:
        """The cached blocks in ``BlockComparatorSize`` order (stream, size, address), as a snapshot."""
        return [self.blocks[k] for stream in sorted(self.keys) for k in self.keys[stream]]

    def unmapped_in_order(self, stream: int) -> list[Block]:
        """The unmapped blocks of one stream, lowest address first."""
        return [self.unmapped_blocks[a] for a in self.unmapped.get(stream, ())]


class ExpandableSegment:
    """``ExpandableSegment``: a reserved address range that is mapped page by page."""

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
