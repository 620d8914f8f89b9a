"""Properties of the caching-allocator replica over random malloc/free/empty_cache sequences (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.devices.allocator import CachingAllocator
from autotune.devices.allocator_stats import QBYTES
from autotune.devices.allocconf import (
    KSMALL_SIZE,
    AllocatorConfig,
    get_allocation_size,
    round_size,
)

MiB = 2**20
CONFS = ["", "max_split_size_mb:40", "roundup_power2_divisions:[1:2,64:8,>:2]", "expandable_segments:True",
         "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
         ("max_split_size_mb:40,garbage_collection_threshold:0.5,per_process_memory_fraction:0.8,"
         "roundup_power2_divisions:4"),
         "expandable_segments:True,garbage_collection_threshold:0.5,per_process_memory_fraction:0.8"]
SIZES = st.one_of(st.integers(1, 4096), st.integers(1, 2 * MiB), st.integers(MiB, 24 * MiB),
                  st.integers(10 * MiB, 96 * MiB), st.sampled_from([MiB, MiB + 1, 10 * MiB, 19 * MiB, 20 * MiB]))
OPS = st.lists(st.one_of(
    st.tuples(st.just("malloc"), SIZES, st.sampled_from([0, 0, 0, 7])),
    st.tuples(st.just("free"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("empty"), st.just(0), st.just(0)),
), max_size=60)
STATS = ("allocation", "segment", "inactive_split", "allocated_bytes", "reserved_bytes", "inactive_split_bytes",
         "requested_bytes")


def check_invariants(a: CachingAllocator, live: dict[int, int]) -> None:
    """reserved >= allocated >= the live requests; allocated is the live blocks' sizes; stats agree."""
    stats = a.memory_stats()
    requested = sum(live.values())
    assert a.reserved >= a.allocated >= requested == stats["requested_bytes.all.current"]
    assert a.allocated == sum(a.block_size(h) for h in live)
    if a.capacity is not None:
        assert a.reserved <= a.capacity
    segments = a.segments()
    assert sum(s.total_size for s in segments) == a.reserved
    assert sum(s.allocated_size for s in segments) == a.allocated
    split_free = [b.size for s in segments if not s.is_expandable and len(s.blocks) > 1
                  for b in s.blocks if not b.allocated]
    assert stats["inactive_split_bytes.all.current"] == sum(split_free)
    assert stats["inactive_split.all.current"] == len(split_free)
    for name in STATS:
        current = [stats[f"{name}.{pool}.current"] for pool in ("all", "small_pool", "large_pool")]
        assert current[0] == current[1] + current[2]
        assert min(current) >= 0
        assert stats[f"{name}.all.peak"] >= current[0]
        assert stats[f"{name}.all.allocated"] - stats[f"{name}.all.freed"] == current[0]


def plain_oom_oracle(a: CachingAllocator, nbytes: int, stream: int) -> bool:
    """Whether malloc must run out of memory, from the snapshot alone (default policy, no max_split_size):
    no cached block of the pool and stream fits, and the segment does not fit even after every free segment
    is released."""
    size = round_size(nbytes, a.config)
    large = size > KSMALL_SIZE
    segments = a.segments()
    fits = any(b.size >= size and not b.allocated for s in segments if s.is_large == large and s.stream == stream
               for b in s.blocks)
    releasable = sum(s.total_size for s in segments if s.allocated_size == 0)
    assert a.capacity is not None
    return not fits and a.reserved - releasable + get_allocation_size(size, a.config) > a.capacity


def exercise(a: CachingAllocator, ops, oracle: bool = False) -> dict[int, int]:
    """Replay ``ops`` on ``a``, checking the invariants (and with ``oracle``, when OOM must happen) at each step."""
    live: dict[int, int] = {}
    for op, value, stream in ops:
        if op == "malloc":
            must_fail = plain_oom_oracle(a, value, stream) if oracle else None
            ooms = a.memory_stats()["num_ooms"]
            try:
                live[a.malloc(value, stream)] = value
                failed = False
            except torch.OutOfMemoryError:
                failed = True
                assert a.capacity is not None or a._allowed is not None
                assert a.memory_stats()["num_ooms"] == ooms + 1
            assert must_fail in (None, failed)
        elif op == "free" and live:
            handle = list(live)[value % len(live)]
            a.free(handle)
            del live[handle]
        elif op == "empty":
            a.empty_cache()
        check_invariants(a, live)
    return live


def release_everything(a: CachingAllocator, live: dict[int, int]) -> None:
    """Freeing every live block and emptying the cache gives everything back."""
    for handle in list(live):
        a.free(handle)
        del live[handle]
        check_invariants(a, live)
    a.empty_cache()
    assert (a.reserved, a.allocated, a.segments()) == (0, 0, [])
    stats = a.memory_stats()
    assert all(stats[f"{name}.all.current"] == 0 for name in STATS)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFS), capacity=st.sampled_from([None, 48 * MiB, 160 * MiB]), ops=OPS)
def test_invariants_hold_and_everything_returns(conf, capacity, ops):
    """After every step the invariants hold; freeing everything then empty_cache() leaves nothing reserved."""
    a = CachingAllocator(capacity=capacity, conf=conf, device_total=capacity or 1 << 34)
    release_everything(a, exercise(a, ops))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(["", "roundup_power2_divisions:4"]), capacity=st.sampled_from([24 * MiB, 100 * MiB]),
       ops=OPS)
def test_out_of_memory_exactly_when_release_and_retry_cannot_fit(conf, capacity, ops):
    """OOM is raised iff no cached block fits and the new segment exceeds capacity even after every free
    segment is released (release_cached_blocks, then one retry)."""
    exercise(CachingAllocator(capacity=capacity, conf=conf), ops, oracle=True)


FIXED_OPS = [("malloc", 2 * MiB, 0), ("malloc", 3 * MiB, 0), ("malloc", 700, 0), ("free", 0, 0), ("free", 0, 0),
             ("malloc", 20 * MiB, 0), ("free", 1, 0), ("malloc", 22 * MiB, 0)]


def _leaky_requested(self, block):
    requested = block.requested
    _free_block(self, block)
    self.stats.cur[QBYTES] += requested


def _ignores_capacity(self, *args):
    capacity, self.capacity = self.capacity, None
    try:
        return _alloc_block(self, *args)
    finally:
        self.capacity = capacity


_free_block, _alloc_block = CachingAllocator._free_block, CachingAllocator._alloc_block


@pytest.mark.parametrize(("method", "fault"), [
    ("_try_merge_blocks", lambda self, dst, src: 0),
    ("_free_block", _leaky_requested),
    ("_release_cached_blocks", lambda self: None),
    ("_alloc_block", _ignores_capacity),
], ids=["no-merge", "requested-not-decremented", "no-release", "capacity-ignored"])
def test_property_checks_catch_planted_faults(monkeypatch, method, fault):
    """The invariants, the OOM oracle and the give-everything-back check fail on a broken allocator."""
    def run():
        a = CachingAllocator(capacity=24 * MiB)
        release_everything(a, exercise(a, FIXED_OPS, oracle=True))

    run()
    monkeypatch.setattr(CachingAllocator, method, fault)
    with pytest.raises((AssertionError, torch.OutOfMemoryError)):
        run()


@pytest.mark.parametrize("conf", CONFS)
def test_config_round_trip(conf):
    """An allocator built from a parsed AllocatorConfig behaves as one built from the string."""
    script = [(5 * MiB, 0), (30 * MiB, 0), (700, 0), (19 * MiB, 7)]
    results = []
    for source in (conf, AllocatorConfig.parse(conf)):
        a = CachingAllocator(capacity=1 << 30, conf=source)
        handles = [a.malloc(n, s) for n, s in script]
        a.free(handles[1])
        results.append((a.reserved, a.allocated, a.memory_stats()))
    assert results[0] == results[1]
