"""The estimate's allocation trace as a ``torch.cuda.memory._snapshot()``: what PyTorch's own viewers open.

:func:`build` replays a :class:`~autotune.devices.recorder.Recording` through
the caching-allocator simulation, as the estimate did, and writes down what
the allocator did in the format of the installed torch's
``torch.cuda.memory._snapshot()`` (``torch/cuda/memory.py``):

- ``device_traces[0]``: every ``segment_alloc``/``segment_free`` (cudaMalloc,
  cudaFree; ``segment_map``/``segment_unmap`` for expandable segments), every
  ``alloc``, ``free_requested`` and ``free_completed`` with the block's address
  and the requested size, in order, each with the Python frames that made the
  tensor, innermost first; an ``oom`` entry where the simulation ran out of
  memory at the GPU's capacity (the replay then goes on without a limit, as the
  estimate's figures do); ``time_us`` is the entry's position in the trace;
- ``segments``: the segments at the end, with their blocks (``active_allocated``
  or ``inactive``, the frames of a live block).

Standing in for no caching allocator (the CPU, or ``cudaMallocAsync``), each
storage is its own segment of exactly its size: the trace shows allocated
memory only, reserved equals allocated.

``python -m torch.cuda._memory_viz trace_plot FILE -o out.html`` (add ``-s`` for
the reserved segments), ``segment_plot``, and pytorch.org/memory_viz open the
file :func:`write` makes (pickle protocol 4, which the viewer reads).
Nothing here imports torch but the allocator simulation's out-of-memory error.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .allocator import AllocatorConfig, CachingAllocator
from .recorder import Made, Recording
from .replay import unlimited

#: What a trace entry's size means: the requested bytes of the block (``alloc``, ``free_*``) or the segment's.
RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_ALIGN = 512


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """How the GPU's allocator is simulated: None for no caching allocator (each storage its own segment)."""

    conf: AllocatorConfig
    capacity: int | None
    device_total: int | None


@dataclass(frozen=True, kw_only=True)
class OutOfMemoryAt:
    """Where the simulated allocator at the GPU's capacity runs out of memory, and what it holds then."""

    index: int  # the trace event whose allocation fails
    requested: int  # the bytes it asks for
    reserved: int  # what the allocator holds then, its cache released as far as it can be
    segment: int  # what it asks the device for, in vain: a new segment for the request
    capacity: int
    live: dict[int, int]  # trace key -> block size of every allocation live then

    @property
    def device_free(self) -> int:
        return max(0, self.capacity - self.reserved)


#: ``on_step(i, key, block, reserved, allocated)``: after trace event ``i`` (of ``key``), the block it took
#: (its size; -1 for a free) and the bytes reserved and allocated (in blocks) then.
OnStep = Callable[[int, int, int, int, int], None]


def build(recording: Recording, simulation: Simulation | None, *, on_step: OnStep | None = None,
          on_oom: Callable[[OutOfMemoryAt], None] | None = None) -> dict[str, Any]:
    """The snapshot of ``recording`` (see the module docstring), told to ``on_step`` event by event; ``on_oom``
    is told where the allocator at the GPU's capacity runs out of memory, before the replay without a limit."""
    if simulation is None:
        return _build_plain(recording, on_step)
    oom_at = first_oom(recording.trace, simulation)
    if oom_at is not None and on_oom is not None:
        on_oom(oom_at)
    alloc = CachingAllocator(simulation.capacity if oom_at is None else None,
                             simulation.conf if oom_at is None else unlimited(simulation.conf),
                             device_total=simulation.device_total or simulation.capacity)
    entries: list[dict[str, Any]] = []

    def segment(action: str, addr: int, size: int, stream: int) -> None:
        entries.append({"action": action, "addr": addr, "size": size, "stream": stream, "frames": [],
                        "time_us": len(entries)})

    alloc.on_segment = segment
    handles: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for i, (key, nbytes, stream) in enumerate(recording.trace):
        if oom_at is not None and i == oom_at.index:
            entries.append({"action": "oom", "size": nbytes, "device_free": oom_at.device_free, "stream": stream,
                            "frames": _frames(recording.made.get(key)), "time_us": len(entries)})
        if nbytes < 0:
            addr = handles.pop(key, None)
            if addr is None:
                continue
            size, frames = sizes.pop(key), _frames(recording.made.get(key))
            for action in ("free_requested", "free_completed"):
                entries.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames,
                                "time_us": len(entries)})
            alloc.free(addr)
            block = -1
        else:
            addr = alloc.malloc(nbytes, stream)
            handles[key], sizes[key] = addr, nbytes
            entries.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": stream,
                            "frames": _frames(recording.made.get(key)), "time_us": len(entries)})
            block = alloc.block_size(addr)
        if on_step is not None:
            on_step(i, key, block, alloc.reserved, alloc.allocated)
    keys = {addr: key for key, addr in handles.items()}
    segments = []
    for seg in alloc.segments():
        address, blocks = seg.address, []
        for b in seg.blocks:
            owner = keys.get(address) if b.allocated else None
            blocks.append({"address": address, "size": b.size, "requested_size": b.requested_size if b.allocated
                           else 0, "state": "active_allocated" if b.allocated else "inactive",
                           "frames": _frames(recording.made.get(owner)) if owner is not None else []})
            address += b.size
        segments.append(_segment(seg.address, seg.total_size, seg.stream, "large" if seg.is_large else "small",
                                 blocks, expandable=seg.is_expandable))
    return {"segments": segments, "device_traces": [entries]}


def _build_plain(recording: Recording, on_step: OnStep | None) -> dict[str, Any]:
    """Allocated memory only: each storage a segment of its exact size at a fresh address."""
    entries: list[dict[str, Any]] = []
    live: dict[int, tuple[int, int]] = {}
    next_addr, total = 1 << 32, 0
    for i, (key, nbytes, stream) in enumerate(recording.trace):
        frames = _frames(recording.made.get(key))
        if nbytes < 0:
            found = live.pop(key, None)
            if found is None:
                continue
            addr, size = found
            entries += [{"action": a, "addr": addr, "size": size, "stream": 0, "frames": frames,
                         "time_us": len(entries) + j} for j, a in enumerate(("free_requested", "free_completed"))]
            entries.append({"action": "segment_free", "addr": addr, "size": size, "stream": 0, "frames": [],
                            "time_us": len(entries)})
            total -= size
            block = -1
        else:
            addr, next_addr = next_addr, next_addr + -(-max(nbytes, 1) // _ALIGN) * _ALIGN
            live[key] = (addr, nbytes)
            entries.append({"action": "segment_alloc", "addr": addr, "size": nbytes, "stream": stream, "frames": [],
                            "time_us": len(entries)})
            entries.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": stream, "frames": frames,
                            "time_us": len(entries)})
            total += nbytes
            block = nbytes
        if on_step is not None:
            on_step(i, key, block, total, total)
    segments = [_segment(addr, n, 0, "large" if n > 1 << 20 else "small",
                         [{"address": addr, "size": n, "requested_size": n, "state": "active_allocated",
                           "frames": _frames(recording.made.get(key))}])
                for key, (addr, n) in sorted(live.items(), key=lambda kv: kv[1][0])]
    return {"segments": segments, "device_traces": [entries]}


def _segment(address: int, total: int, stream: int, kind: str, blocks: list[dict[str, Any]], *,
             expandable: bool = False) -> dict[str, Any]:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": 0, "address": address, "total_size": total, "stream": stream, "segment_type": kind,
            "segment_pool_id": (0, 0), "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b["requested_size"] for b in blocks), "is_expandable": expandable,
            "frames": [], "blocks": blocks}


def _frames(made: Made | None) -> list[dict[str, Any]]:
    return list(made.frames) if made is not None else []


def first_oom(trace: list[tuple[int, int, int]], simulation: Simulation) -> OutOfMemoryAt | None:
    """Where the simulated allocator at the GPU's capacity runs out of memory, and what it holds then; None when
    the whole trace fits."""
    import torch

    if simulation.capacity is None:
        return None
    alloc = CachingAllocator(simulation.capacity, simulation.conf, device_total=simulation.device_total)
    handles: dict[int, int] = {}
    for i, (key, nbytes, stream) in enumerate(trace):
        if nbytes < 0:
            handle = handles.pop(key, None)
            if handle is not None:
                alloc.free(handle)
            continue
        try:
            handles[key] = alloc.malloc(nbytes, stream)
        except torch.OutOfMemoryError:
            return OutOfMemoryAt(index=i, requested=nbytes, reserved=alloc.reserved, segment=alloc.oom_segment_bytes,
                                 capacity=simulation.capacity,
                                 live={k: alloc.block_size(h) for k, h in handles.items() if h})
    return None


def peaks(snapshot: dict[str, Any], device: int = 0) -> tuple[int, int]:
    """(reserved, requested) peaks of a snapshot's trace: the running sum of its segment entries and of its
    allocations, at their highest (what ``trace_plot -s`` and ``trace_plot`` draw)."""
    reserved = requested = top_reserved = top_requested = 0
    for e in _trace(snapshot, device):
        action = e.get("action")
        if action in RESERVE:
            reserved += RESERVE[action] * int(e["size"])
            top_reserved = max(top_reserved, reserved)
        elif action == "alloc":
            requested += int(e["size"])
            top_requested = max(top_requested, requested)
        elif action == "free_completed":
            requested -= int(e["size"])
    return top_reserved, top_requested


def series(snapshot: dict[str, Any], device: int = 0) -> list[tuple[int, int, int]]:
    """(allocation number, reserved, requested) after every ``alloc`` of the trace: a timeline two snapshots
    (predicted, real) share, since both allocate in the fit rule's order."""
    reserved = requested = n = 0
    out = []
    for e in _trace(snapshot, device):
        action = e.get("action")
        if action in RESERVE:
            reserved += RESERVE[action] * int(e["size"])
        elif action == "alloc":
            requested += int(e["size"])
            n += 1
            out.append((n, reserved, requested))
        elif action == "free_completed":
            requested -= int(e["size"])
    return out


def _trace(snapshot: dict[str, Any], device: int) -> Iterable[dict[str, Any]]:
    traces = snapshot.get("device_traces") or []
    return traces[device] if device < len(traces) else []


def write(snapshot: dict[str, Any], path: str | os.PathLike[str], *, what: str | None = None) -> None:
    """Pickle ``snapshot`` to ``path`` atomically, as ``torch.cuda.memory._dump_snapshot`` does, in protocol 4
    (the highest pytorch.org/memory_viz reads); ``what`` names the path in errors (a flag)."""
    from ..serial import write_atomic

    write_atomic(path, pickle.dumps(snapshot, protocol=4), what=what)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A snapshot written by :func:`write` or by ``torch.cuda.memory._dump_snapshot``."""
    with open(path, "rb") as f:
        data = pickle.load(f)  # noqa: S301 (a snapshot file the user names, as torch's own viewer reads it)
    if isinstance(data, list):  # segments only, as _memory_viz accepts
        data = {"segments": data, "device_traces": []}
    return data
