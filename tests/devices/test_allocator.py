"""The caching-allocator replica, rule by rule.

Every table's figures are worked out by hand from PyTorch's
c10/cuda/CUDACachingAllocator.cpp; the C++ function a table exercises is in
its test's name and docstring. Each table also has a planted fault (the rule
broken in the allocator) that the table catches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autotune.devices.allocator import CachingAllocator
from autotune.devices.allocator_blocks import Block
from autotune.errors import BadInput

MiB = 2**20


def play(script, conf="", capacity=None, **kw):
    """Run ``script`` ('m name nbytes [stream]', 'f name', 'e' for empty_cache); returns (allocator, handles)."""
    a = CachingAllocator(capacity=capacity, conf=conf, **kw)
    handles = {}
    for step in filter(None, script.split(";")):
        op, *args = step.split()
        if op == "m":
            handles[args[0]] = a.malloc(_bytes(args[1]), int(args[2]) if len(args) > 2 else 0)
        elif op == "f":
            a.free(handles.pop(args[0]))
        else:
            a.empty_cache()
    return a, handles


def _bytes(text):
    """'19M' -> 19 MiB, '19M-512' -> 19 MiB - 512, '1000' -> 1000."""
    total = 0
    for part in text.replace("-", "+-").split("+"):
        total += int(part[:-1]) * MiB if part.endswith("M") else int(part)
    return total


def figures(a, *keys):
    stats = a.memory_stats()
    return tuple(stats[k] for k in keys)


def table_fails(table, check):
    """True when some row of ``table`` no longer holds (used with a planted fault)."""
    for row in table:
        try:
            check(*row[1:])
        except (AssertionError, torch.OutOfMemoryError):
            return True
    return False


def ids(table):
    return [row[0] for row in table]


def rows(table):
    return [row[1:] for row in table]


# ---------------------------------------------------------------- pools, splitting

# (id, conf, script, allocated, reserved, inactive_split_bytes)
SHOULD_SPLIT = [
    ("small-remainder-split", "", "m a 1000", 1024, 2 * MiB, 2 * MiB - 1024),
    ("small-exact-fit", "", "m a 1M;m b 1M", 2 * MiB, 2 * MiB, 0),
    ("large-remainder-1MiB-kept", "", "m a 19M", 20 * MiB, 20 * MiB, 0),
    ("large-remainder-over-1MiB-split", "", "m a 19M-512", 19 * MiB - 512, 20 * MiB, MiB + 512),
    ("large-no-max-split", "", "m a 20M+512", 20 * MiB + 512, 22 * MiB, 2 * MiB - 512),
    ("oversize-request-not-split", "max_split_size_mb:20", "m a 20M+512", 22 * MiB, 22 * MiB, 0),
    ("under-max-split-split", "max_split_size_mb:20", "m a 5M", 5 * MiB, 20 * MiB, 15 * MiB),
    ("expandable-512B-rule", "expandable_segments:True", "m a 19M", 19 * MiB, 20 * MiB, 0),
    ("expandable-small", "expandable_segments:True", "m a 1000", 1024, 2 * MiB, 0),
]


@pytest.mark.parametrize(("conf", "script", "allocated", "reserved", "inactive"), rows(SHOULD_SPLIT),
                         ids=ids(SHOULD_SPLIT))
def test_should_split(conf, script, allocated, reserved, inactive):
    """should_split: small pool and expandable segments split off >= 512 B; large: remainder > 1 MiB and
    size < max_split_size. Unsplit slack counts in allocated_bytes (alloc_found_block counts the block size)."""
    check_should_split(conf, script, allocated, reserved, inactive)


def check_should_split(conf, script, allocated, reserved, inactive):
    a, _ = play(script, conf)
    assert (a.allocated, a.reserved) == (allocated, reserved)
    assert figures(a, "active_bytes.all.current", "inactive_split_bytes.all.current") == (allocated, inactive)


def test_pools_and_stat_breakdown():
    """get_pool: up to 1 MiB the small pool (2 MiB segments), above it the large pool; stats per pool add up."""
    a, _ = play("m a 1M;m b 1M+1")
    assert figures(a, "reserved_bytes.small_pool.current", "reserved_bytes.large_pool.current",
                   "segment.small_pool.current", "segment.large_pool.current") == (2 * MiB, 20 * MiB, 1, 1)
    assert figures(a, "allocated_bytes.small_pool.current", "allocated_bytes.large_pool.current",
                   "requested_bytes.all.current") == (MiB, MiB + 512, 2 * MiB + 1)


# ---------------------------------------------------------------- best fit

CACHED = "m x 22M;m y 26M;m z 30M;f x;f y;f z"
# (id, conf, script, allocated, reserved)
GET_FREE_BLOCK = [
    ("best-fit-then-exact", "", CACHED + ";m a 24M;m b 30M", 54 * MiB, 78 * MiB),
    ("exact-fit-unsplit", "", CACHED + ";m a 22M", 22 * MiB, 78 * MiB),
    ("nothing-fits", "", CACHED + ";m a 32M", 32 * MiB, 110 * MiB),
    ("same-stream-only", "", CACHED + ";m a 24M 1", 24 * MiB, 102 * MiB),
    ("oversize-not-for-small-requests", "max_split_size_mb:64", "m x 100M;f x;m a 30M", 30 * MiB, 130 * MiB),
    ("oversize-within-20MiB", "max_split_size_mb:64", "m x 100M;f x;m a 81M", 100 * MiB, 100 * MiB),
    ("oversize-beyond-20MiB", "max_split_size_mb:64", "m x 100M;f x;m a 80M", 80 * MiB, 180 * MiB),
    ("max_non_split_rounding_mb", "max_split_size_mb:64,max_non_split_rounding_mb:40", "m x 100M;f x;m a 80M",
     100 * MiB, 100 * MiB),
]


@pytest.mark.parametrize(("conf", "script", "allocated", "reserved"), rows(GET_FREE_BLOCK), ids=ids(GET_FREE_BLOCK))
def test_get_free_block(conf, script, allocated, reserved):
    """get_free_block: the smallest cached block that fits, same stream (BlockComparatorSize order); an oversize
    block (>= max_split_size) only for an oversize request within max_non_split_rounding_size (20 MiB)."""
    check_get_free_block(conf, script, allocated, reserved)


def check_get_free_block(conf, script, allocated, reserved):
    a, _ = play(script, conf)
    assert (a.allocated, a.reserved) == (allocated, reserved)


# ---------------------------------------------------------------- merging

# (id, script, inactive_split, inactive_split_bytes, reserved after empty_cache)
MERGE = [
    ("middle-freed", "m a 2M;m b 3M;m c 4M;f b", 2, 14 * MiB, 20 * MiB),
    ("merge-with-next", "m a 2M;m b 3M;m c 4M;f b;f a", 2, 16 * MiB, 20 * MiB),
    ("merge-both-sides", "m a 2M;m b 3M;m c 4M;f b;f a;f c", 0, 0, 0),
    ("merge-in-any-order", "m a 2M;m b 3M;m c 4M;f c;f a;f b", 0, 0, 0),
]


@pytest.mark.parametrize(("script", "count", "nbytes", "after_empty"), rows(MERGE), ids=ids(MERGE))
def test_try_merge_blocks(script, count, nbytes, after_empty):
    """free_block / try_merge_blocks: a freed block absorbs free neighbours; a whole free segment is unsplit
    again, so empty_cache (release_blocks) can cudaFree it."""
    check_merge(script, count, nbytes, after_empty)


def check_merge(script, count, nbytes, after_empty):
    a, _ = play(script)
    assert figures(a, "inactive_split.all.current", "inactive_split_bytes.all.current") == (count, nbytes)
    a.empty_cache()
    assert a.reserved == after_empty


# ---------------------------------------------------------------- release and retry

CAP = 250 * MiB
# (id, conf, capacity, script, reserved, num_alloc_retries, num_device_free)
RELEASE = [
    ("one-oversize-block-released", "max_split_size_mb:64", CAP, "m x 200M;f x;m a 120M", 120 * MiB, 0, 1),
    ("no-max-split-reuses-it", "", CAP, "m x 200M;f x;m a 120M", 200 * MiB, 0, 0),
    ("largest-oversize-first", "max_split_size_mb:64", CAP, "m x 100M;m y 70M;m z 30M;f x;f y;f z;m a 120M",
     150 * MiB, 0, 2),
    ("no-max-split-releases-all", "", CAP, "m x 100M;m y 70M;m z 30M;f x;f y;f z;m a 120M", 120 * MiB, 1, 3),
    ("oversize-not-enough-then-all", "max_split_size_mb:64", CAP, "m x 100M;m y 30M;f x;f y;m w 40M;m a 150M",
     190 * MiB, 1, 2),
    ("release-all-and-retry", "", 100 * MiB, "m x 30M;f x;m a 80M", 80 * MiB, 1, 1),
    ("expandable-unmaps-and-retries", "expandable_segments:True", 100 * MiB, "m x 30M;m y 50M;f x;m a 40M",
     100 * MiB, 1, 1),
]


@pytest.mark.parametrize(("conf", "capacity", "script", "reserved", "retries", "device_free"), rows(RELEASE),
                         ids=ids(RELEASE))
def test_release_available_cached_blocks(conf, capacity, script, reserved, retries, device_free):
    """On a failed cudaMalloc: release_available_cached_blocks (oversize cached blocks, the single fitting one
    or the largest first) and retry, then release_cached_blocks (every unsplit segment) and retry once more
    (num_alloc_retries)."""
    check_release(conf, capacity, script, reserved, retries, device_free)


def check_release(conf, capacity, script, reserved, retries, device_free):
    a, _ = play(script, conf, capacity)
    assert (a.reserved, *figures(a, "num_alloc_retries", "num_device_free", "num_ooms")) == (
        reserved, retries, device_free, 0)


# (id, conf, capacity, script, message after "CUDA out of memory. ")
OOM = [
    ("nothing-to-release", "", 100 * MiB, "m x 30M;f x;m a 80M;m b 30M",
     ("Tried to allocate 30.00 MiB. GPU 0 has a total capacity of 100.00 MiB of which 20.00 MiB is free. Of the "
     "allocated memory 80.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")),
    ("fragmented", "", 40 * MiB, "m a 6M;m b 6M;f a;m c 30M",
     ("Tried to allocate 30.00 MiB. GPU 0 has a total capacity of 40.00 MiB of which 20.00 MiB is free. Of the "
     "allocated memory 6.00 MiB is allocated by PyTorch, and 14.00 MiB is reserved by PyTorch but unallocated.")),
    ("segment-size-reported", "", 2 * MiB, "m a 1M;m b 1M+1",
     ("Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 2.00 MiB of which 0 bytes is free. Of the "
     "allocated memory 1024.00 KiB is allocated by PyTorch, and 1024.00 KiB is reserved by PyTorch but "
     "unallocated.")),
    ("mapped-pages-not-contiguous", "expandable_segments:True", 100 * MiB, "m x 30M;m y 50M;f x;m a 60M",
     ("Tried to allocate 60.00 MiB. GPU 0 has a total capacity of 100.00 MiB of which 40.00 MiB is free. Of the "
     "allocated memory 50.00 MiB is allocated by PyTorch, and 10.00 MiB is reserved by PyTorch but unallocated.")),
    ("fraction-allowed", "per_process_memory_fraction:0.5", 100 * MiB, "m a 40M;m b 20M",
     ("Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 100.00 MiB of which 60.00 MiB is free. 50.00 "
     "MiB allowed; Of the allocated memory 40.00 MiB is allocated by PyTorch, and 0 bytes is reserved")),
    ("expandable-pages", "expandable_segments:True", 30 * MiB, "m a 25M",
     "Tried to allocate 26.00 MiB. GPU 0 has a total capacity of 30.00 MiB of which 30.00 MiB is free."),
]


@pytest.mark.parametrize(("conf", "capacity", "script", "message"), rows(OOM), ids=ids(OOM))
def test_out_of_memory(conf, capacity, script, message):
    """malloc's TORCH_CHECK_WITH(OutOfMemoryError): after release-and-retry fails, num_ooms and CUDA's wording."""
    head, _, last = script.rpartition(";")
    a, _ = play(head, conf, capacity)
    before = a.memory_stats()["num_alloc_retries"]
    with pytest.raises(torch.OutOfMemoryError) as info:
        a.malloc(_bytes(last.split()[2]))
    text = str(info.value)
    assert text.startswith("CUDA out of memory. " + message)
    assert text.endswith("If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
                         "expandable_segments:True to avoid fragmentation.  See documentation for Memory "
                         "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-"
                         "usage-with-pytorch-cuda-alloc-conf)")
    assert figures(a, "num_ooms", "num_alloc_retries") == (1, before + 1)
    a.malloc(MiB // 2)  # the allocator stays usable after an OOM


# ---------------------------------------------------------------- garbage collection

GC_SCRIPT = "m a 100M;f a;m b 120M;f b;m c 140M;f c;m d 160M;m e 180M"
# (id, conf, reserved, num_device_free)
GARBAGE = [
    ("older-than-average-freed", "garbage_collection_threshold:0.5,per_process_memory_fraction:0.8", 480 * MiB, 2),
    ("needs-a-memory-fraction", "garbage_collection_threshold:0.5", 700 * MiB, 0),
    ("off-without-threshold", "per_process_memory_fraction:0.8", 700 * MiB, 0),
    ("below-threshold", "garbage_collection_threshold:0.9,per_process_memory_fraction:0.8", 700 * MiB, 0),
]


@pytest.mark.parametrize(("conf", "reserved", "device_free"), rows(GARBAGE), ids=ids(GARBAGE))
def test_garbage_collect_cached_blocks(conf, reserved, device_free):
    """garbage_collect_cached_blocks: only with a memory fraction set; once reserved passes threshold x allowed,
    unsplit cached large blocks at least as old as the average (in get_free_block calls) are freed."""
    check_garbage(conf, reserved, device_free)


def check_garbage(conf, reserved, device_free):
    a, _ = play(GC_SCRIPT, conf, 1000 * MiB)
    assert (a.reserved, a.memory_stats()["num_device_free"]) == (reserved, device_free)


# ---------------------------------------------------------------- expandable segments

EXP = "expandable_segments:True"
# (id, conf, script, allocated, reserved, num_device_free)
EXPANDABLE = [
    ("grows-by-20MiB-pages", EXP, "m a 5M;m b 30M", 35 * MiB, 40 * MiB, 0),
    ("plain-segments-instead", "", "m a 5M;m b 30M", 35 * MiB, 50 * MiB, 0),
    ("large_segment_size-pages", EXP + ",large_segment_size_mb:64", "m a 3M", 3 * MiB, 64 * MiB, 0),
    ("small-pool-2MiB-pages", EXP, "m a 1M;m b 1M;m c 1M", 3 * MiB, 4 * MiB, 0),
    ("whole-free-pages-unmapped", EXP, "m a 30M;m b 10M;f a;e", 10 * MiB, 20 * MiB, 1),
    ("all-unmapped", EXP, "m a 30M;m b 10M;f a;e;f b;e", 0, 0, 2),
]


@pytest.mark.parametrize(("conf", "script", "allocated", "reserved", "device_free"), rows(EXPANDABLE),
                         ids=ids(EXPANDABLE))
def test_expandable_segments(conf, script, allocated, reserved, device_free):
    """try_allocate_expandable_block / find_expandable_block / map_block / unmap_block: one segment per stream
    and pool grows by pages (large_segment_size for the large pool, 2 MiB for the small); release unmaps the
    whole free pages."""
    check_expandable(conf, script, allocated, reserved, device_free)


def check_expandable(conf, script, allocated, reserved, device_free):
    a, _ = play(script, conf)
    assert (a.allocated, a.reserved, a.memory_stats()["num_device_free"]) == (allocated, reserved, device_free)


def test_expandable_best_fit_prefers_a_block_that_grows_less(monkeypatch):
    """get_free_block on expandable segments: a block counts as big as it can grow, so the 4 MiB request takes
    the 10 MiB hole at the start, not the 5 MiB block that borders the unmapped pages (plain best fit would)."""
    def pick():
        a, h = play("m a 10M;m b 10M;m c 15M;m d 5M", EXP)
        a.free(h["a"])
        a.free(h["d"])
        return a.malloc(4 * MiB), h

    handle, h = pick()
    assert handle == h["a"]
    monkeypatch.setattr(Block, "expandable_size", lambda self: self.size)
    handle, h = pick()
    assert handle == h["d"]


# ---------------------------------------------------------------- planted faults

def _no_split(self, block, size):
    return False


def _never_release_available(self, pool, size, stream):
    return False


def _no_merge(self, dst, src):
    return 0


def _no_gc(self):
    return None


def _no_release(self):
    return None


def _small_pages(self, pool, size, stream):
    self.config = dataclasses.replace(self.config, large_segment_size=2 * MiB)
    return _find_expandable_block(self, pool, size, stream)


_find_expandable_block = CachingAllocator._find_expandable_block


@pytest.mark.parametrize(("method", "fault", "table", "check"), [
    ("_should_split", _no_split, SHOULD_SPLIT, check_should_split),
    ("_try_merge_blocks", _no_merge, MERGE, check_merge),
    ("_release_available_cached_blocks", _never_release_available, RELEASE, check_release),
    ("_release_cached_blocks", _no_release, RELEASE, check_release),
    ("_garbage_collect_cached_blocks", _no_gc, GARBAGE, check_garbage),
    ("_find_expandable_block", _small_pages, EXPANDABLE, check_expandable),
], ids=["no-split", "no-merge", "no-release-available", "no-release-cached", "no-gc", "2MiB-large-pages"])
def test_tables_catch_planted_faults(monkeypatch, method, fault, table, check):
    """Each rule's table fails when that rule is broken in the allocator."""
    assert not table_fails(table, check)
    monkeypatch.setattr(CachingAllocator, method, fault)
    assert table_fails(table, check)


def test_get_free_block_table_catches_planted_faults(monkeypatch):
    """get_free_block's table fails for worst fit, for a stream-blind search, and without the rounding limit."""
    real = CachingAllocator._get_free_block

    def worst_fit(self, pool, size, stream):
        keys = pool.keys.get(stream)
        if keys and keys[-1] >> 56 >= size:
            return pool.blocks.pop(keys.pop())  # the largest cached block instead of the smallest that fits
        return real(self, pool, size, stream)

    def any_stream(self, pool, size, stream):
        return real(self, pool, size, next(iter(pool.keys), stream))

    def no_rounding_limit(self, pool, size, stream):
        config = self.config
        self.config = dataclasses.replace(config, max_non_split_rounding_size=2**60)
        try:
            return real(self, pool, size, stream)
        finally:
            self.config = config

    for fault in (worst_fit, any_stream, no_rounding_limit):
        monkeypatch.setattr(CachingAllocator, "_get_free_block", fault)
        assert table_fails(GET_FREE_BLOCK, check_get_free_block)


# ---------------------------------------------------------------- the rest of the API

def test_free_memory_callbacks():
    """trigger_free_memory_callbacks: when no cached block fits, the hooks run and the search is retried."""
    a = CachingAllocator()
    x = a.malloc(30 * MiB)

    def release_x():
        a.free(x)
        return True

    a.free_memory_callbacks.append(release_x)
    a.malloc(30 * MiB)
    assert (a.reserved, a.memory_stats()["num_device_alloc"]) == (30 * MiB, 1)
    a.free_memory_callbacks[:] = [lambda: False]
    a.malloc(30 * MiB)
    assert a.reserved == 60 * MiB


def test_memory_stats_names_and_peaks():
    """memory_stats has torch.cuda.memory_stats()'s keys; reset_peak_stats lowers peaks to current values."""
    a, _h = play("m a 19M;m b 1000;f a")
    stats = a.memory_stats()
    for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "allocation", "segment",
                 "active", "inactive_split", "inactive_split_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{field}" in stats
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                "max_split_size", "oversize_allocations.peak", "oversize_segments.current"):
        assert key in stats
    assert list(stats) == sorted(stats)
    assert (stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]) == (20 * MiB + 1024, 1024)
    assert (stats["requested_bytes.all.peak"], stats["max_split_size"]) == (19 * MiB + 1000, -1)
    assert stats["allocated_bytes.all.freed"] == 20 * MiB
    a.reset_peak_stats()
    assert (a.max_allocated, a.max_reserved) == (1024, 22 * MiB)
    a.reset_accumulated_stats()
    assert figures(a, "allocated_bytes.all.freed", "num_device_alloc") == (0, 0)


def test_oversize_stats():
    """oversize_allocations / oversize_segments count blocks and segments of max_split_size or more."""
    a, _ = play("m a 100M;m b 30M;f a", "max_split_size_mb:64")
    assert figures(a, "oversize_allocations.current", "oversize_allocations.peak", "oversize_segments.current",
                   "max_split_size") == (0, 1, 1, 64 * MiB)


def test_segments_snapshot():
    """segments(): like memory_snapshot(), blocks in address order with their sizes and states."""
    a, _ = play("m a 2M;m b 3M;f a")
    (seg,) = a.segments()
    assert (seg.total_size, seg.is_large, seg.is_expandable, seg.allocated_size) == (20 * MiB, True, False, 3 * MiB)
    assert [(b.size, b.allocated) for b in seg.blocks] == [(2 * MiB, False), (3 * MiB, True), (15 * MiB, False)]


def test_zero_bytes_and_misuse():
    """A zero-byte request is nullptr (handle 0) and allocates nothing; bad handles and sizes are BadInput."""
    a = CachingAllocator()
    assert a.malloc(0) == 0
    a.free(0)
    assert (a.reserved, a.memory_stats()["allocation.all.allocated"]) == (0, 0)
    h = a.malloc(10)
    a.free(h)
    with pytest.raises(BadInput, match="invalid device pointer"):
        a.free(h)
    with pytest.raises(BadInput, match="nbytes=-1"):
        a.malloc(-1)
    with pytest.raises(BadInput, match="capacity"):
        CachingAllocator(capacity=-5)
    with pytest.raises(BadInput, match="Unrecognized key 'max_split_size'"):
        CachingAllocator(conf="max_split_size:128")
    with pytest.raises(BadInput, match="device's size"):
        CachingAllocator().set_per_process_memory_fraction(0.5)


@pytest.mark.parametrize("conf", [None, 128, b"expandable_segments:True"])
def test_settings_that_are_not_a_string_are_bad_input_naming_conf(conf):
    with pytest.raises(BadInput, match=rf"^conf={conf!r} is not allocator settings: pass a string"):
        CachingAllocator(conf=conf)


def test_public_pytorch_figures():
    """The figures PyTorch's own test_cuda.py (test_allocator_settings, test_roundup_power2_divisions_*) expects
    from a real GPU: active_bytes grows by the rounded size, requested_bytes by the request."""
    def grows(conf, nbytes):
        a = CachingAllocator(conf=conf)
        a.malloc(nbytes)
        return figures(a, "active_bytes.all.allocated", "requested_bytes.all.allocated")

    nbytes, big = 4 * 21 * MiB, 4 * 100 * MiB
    assert grows("", nbytes) == (nbytes, nbytes)
    assert grows("roundup_power2_divisions:4", nbytes) == (96 * MiB, nbytes)
    assert grows(LIST := "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", nbytes)[0] == 88 * MiB
    assert grows(LIST, big)[0] == 512 * MiB
    assert grows("roundup_power2_divisions:[128:1,256:0,512:4]", 4 * 67 * MiB)[0] == 4 * 67 * MiB
    assert grows("roundup_power2_divisions:[128:1,256:0,512:4]", 4 * 130 * MiB)[0] == 640 * MiB
