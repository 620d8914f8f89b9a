"""An allocation trace replayed through the caching-allocator simulation: what a GPU would reserve.

The estimate records every device allocation and free of the fit rule
(:class:`~autotune.devices.tracker.LiveStorageTracker` with ``record=True``)
and :func:`replay` hands them, in order, to a fresh
:class:`~autotune.devices.allocator.CachingAllocator` of the GPU's capacity
under the process's allocator settings (``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``). Out of memory in the
simulation is not an error here: the replay then runs again without a limit,
so the result always has the reserved peak the trace would need.

:func:`replay_snapshot` does the same for a trace PyTorch recorded on a real GPU
(``torch.cuda.memory._record_memory_history`` then ``_snapshot()``), which is
how ``bench/gpu_check.sh`` checks the simulation against the real allocator.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .allocator import AllocatorConfig, CachingAllocator

Event = tuple[int, int, int]  # (key, nbytes, stream); nbytes -1 frees key


@dataclass(frozen=True, kw_only=True)
class Replay:
    """What the simulated allocator did with a trace."""

    reserved_peak: int  # torch.cuda.max_memory_reserved()
    allocated_peak: int  # torch.cuda.max_memory_allocated()
    retries: int  # num_alloc_retries: cudaMalloc failed, cached blocks were freed and it was tried again
    out_of_memory: bool  # the trace does not fit the capacity even after freeing the cache
    events: int
    seconds: float


def replay(events: Sequence[Event], *, capacity: int | None, conf: str | AllocatorConfig = "",
           device_total: int | None = None) -> Replay:
    """Replay ``events`` on a fresh allocator; when they do not fit ``capacity``, the peaks are the
    unlimited allocator's and ``out_of_memory`` is True."""
    import torch

    start = time.perf_counter()
    config = conf if isinstance(conf, AllocatorConfig) else AllocatorConfig.parse(conf)
    try:
        alloc = _run(events, CachingAllocator(capacity, config, device_total=device_total))
        oom = False
    except torch.OutOfMemoryError:
        alloc = _run(events, CachingAllocator(None, unlimited(config), device_total=device_total or capacity))
        oom = True
    stats = alloc.stats.counters
    return Replay(reserved_peak=alloc.max_reserved, allocated_peak=alloc.max_allocated,
                  retries=stats["num_alloc_retries"], out_of_memory=oom, events=len(events),
                  seconds=time.perf_counter() - start)


def unlimited(config: AllocatorConfig) -> AllocatorConfig:
    """``config`` on a GPU large enough: without ``per_process_memory_fraction``, whose cap is the capacity's."""
    return replace(config, per_process_memory_fraction=1.0)


def _run(events: Iterable[Event], alloc: CachingAllocator) -> CachingAllocator:
    handles: dict[int, int] = {}
    malloc, free, pop = alloc.malloc, alloc.free, handles.pop
    for key, nbytes, stream in events:
        if nbytes < 0:
            handle = pop(key, None)
            if handle is not None:
                free(handle)
        else:
            handles[key] = malloc(nbytes, stream)
    return alloc


def snapshot_events(snapshot: dict, device: int = 0) -> list[Event]:
    """The allocations and frees of a ``torch.cuda.memory._snapshot()`` taken with history recorded,
    in order, as replay events: each ``alloc`` at its requested size, each ``free_completed`` (the moment
    the block went back to the cache; ``free_requested`` when the trace has no completions) as its free.

    Keys are block addresses (an address freed and handed out again is a new allocation by then).
    Blocks that were live when recording started (freed in the trace without being allocated in it, or
    still allocated in the snapshot's segments and never seen in the trace) are allocated first, by
    address: the replay cannot know where the real allocator had put them.
    """
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    done = "free_completed" if any(e.get("action") == "free_completed" for e in trace) else "free_requested"
    seen: set[int] = set()
    before: dict[int, tuple[int, int]] = {}
    for e in trace:
        action, addr = e.get("action"), int(e.get("addr", 0) or 0)
        if action == "alloc":
            seen.add(addr)
        elif action == done and addr not in seen:
            before[addr] = (int(e.get("size", 0)), _stream(e))
            seen.add(addr)
    for segment in snapshot.get("segments", ()):
        if int(segment.get("device", device)) != device:
            continue
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", ()):
            if block.get("state") in ("active_allocated", "active_pending_free") and address not in seen:
                before[address] = (int(block.get("requested_size", block.get("size", 0))),
                                   _stream(segment))
            address += int(block.get("size", 0))
    events: list[Event] = [(addr, size, stream) for addr, (size, stream) in sorted(before.items())]
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            events.append((int(e["addr"]), int(e.get("size", 0)), _stream(e)))
        elif action == done:
            events.append((int(e["addr"]), -1, 0))
    return events


def _stream(event: dict) -> int:
    return int(event.get("stream", 0) or 0)


def replay_snapshot(snapshot: dict, *, capacity: int | None = None, conf: str | AllocatorConfig = "",
                    device_total: int | None = None) -> Replay:
    """Replay a real allocator's recorded history (see :func:`snapshot_events`)."""
    return replay(snapshot_events(snapshot), capacity=capacity, conf=conf, device_total=device_total)
