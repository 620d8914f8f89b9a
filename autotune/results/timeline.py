"""MemoryTimeline: where the peak of the fit rule comes from, its timeline, and allocator settings compared.

Attached to a ProbeResult (``memory``) when a memory snapshot was asked for
(``--memory-snapshot``). Plain numbers and words only: no torch, no pandas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..units import format_bytes
from .record import Record, Whole, derived, one_of

#: What a part of the peak is. Tensors: parameters, gradients, optimizer_state, activations (activations, the
#: batch and every temporary, by the module that made them). The allocator's own: workspace (cuBLAS, kernel
#: scratch), rounding (blocks larger than requested), cache (the cached free blocks: reserved then, in no live
#: block; not the fragmentation, which is the reserved peak minus the allocated peak, two moments).
#: context: outside the allocator (CUDA context and libraries).
KINDS = ("parameters", "gradients", "optimizer_state", "activations", "workspace", "rounding", "cache", "context")
#: The stacked timeline's series, in order (bytes of each at every sampled point).
SERIES = ("parameters", "gradients", "optimizer_state", "activations", "workspace", "allocator")


@dataclass(frozen=True, kw_only=True)
class PeakPart(Record):
    """Bytes of one kind at the peak, held by ``name`` (a module family such as ``blocks.*.attn`` for
    activations, the workspace's name, ``""`` for all of a kind)."""

    kind: Annotated[str, one_of(KINDS)]
    name: str
    bytes: int

    @property
    def label(self) -> str:
        words = {"optimizer_state": "optimizer state", "rounding": "allocator rounding",
                 "context": "CUDA context (outside the allocator)"}
        what = words.get(self.kind, self.kind)
        if self.kind == "cache":
            return "cached free blocks"
        if self.kind == "activations" and self.name:
            return f"activations {self.name}" if self.name.startswith("(") else f"activations of {self.name}"
        return f"{what}: {self.name}" if self.name else what


@dataclass(frozen=True, kw_only=True)
class AllocatorOption(Record):
    """The fit rule at the timeline's micro-batch under one allocator setting (the simulation's figures).

    ``setting`` is what was added to the user's settings (``""`` for the user's own), ``conf`` the whole
    setting evaluated; ``max_micro_batch`` the largest micro-batch that fits under it (None when not searched:
    it cannot beat the user's there). ``out_of_memory``: the micro-batch runs out of the GPU's memory under it
    (the peaks are then those of a replay without a limit)."""

    setting: str
    conf: str
    reserved_bytes: int
    allocated_bytes: int
    retries: int
    max_micro_batch: int | None = None
    out_of_memory: bool = False

    @property
    def fragmentation_bytes(self) -> int:
        """The reserved peak minus the allocated peak (as a ProbeResult's ``fragmentation_bytes``)."""
        return self.reserved_bytes - self.allocated_bytes


@dataclass(frozen=True, kw_only=True)
class OutOfMemory(Record):
    """Where the fit rule at the timeline's micro-batch runs out of the simulated GPU's memory, and what it asks
    for there: the allocation that fails (``request``: its kind, holder and requested bytes), the blocks live
    then (``allocated_bytes``), what the allocator still holds once it has released what it can
    (``reserved_bytes``: the live blocks and the cached free blocks of segments split by them), the new segment
    it asks the device for (``segment_bytes``) and the capacity. ``parts``: what is live then, by kind and
    holder, with the allocator's rounding and cache; they sum to ``reserved_bytes``."""

    event: int
    phase: str
    request: PeakPart
    allocated_bytes: int
    reserved_bytes: int
    segment_bytes: int
    capacity_bytes: int
    parts: tuple[PeakPart, ...] = ()

    @property
    @derived(after="request")
    def requested_bytes(self) -> int:
        """The bytes the failing allocation asks for."""
        return self.request.bytes

    @property
    @derived(after="capacity_bytes")
    def needed_bytes(self) -> int:
        """At least what the GPU must hold there: the live blocks and the request."""
        return self.allocated_bytes + self.requested_bytes

    @property
    def cache_bytes(self) -> int:
        """Cached free blocks the allocator cannot release (segments split by live blocks)."""
        return self.reserved_bytes - self.allocated_bytes

    def headline(self) -> str:
        """It does not fit: where, the request, what is live, and what it would need."""
        need, short = self.needed_bytes, self.needed_bytes - self.capacity_bytes
        text = (f"does not fit: the simulated GPU (capacity {format_bytes(self.capacity_bytes)}) runs out of memory "
                f"in {self.phase}, asking for {format_bytes(self.requested_bytes)} ({self.request.label}) with "
                f"{format_bytes(self.allocated_bytes)} live in blocks and {format_bytes(self.cache_bytes)} of cached "
                "free blocks the allocator cannot release; ")
        if short > 0:
            return text + f"it would need at least {format_bytes(need)} there, {format_bytes(short)} over the capacity"
        return text + f"the live blocks and the request come to {self.shortfall()}"

    def shortfall(self) -> str:
        """Why the request fails, in a clause: more than the capacity, or a new segment with no room beside what
        the allocator holds."""
        need, short, capacity = self.needed_bytes, self.needed_bytes - self.capacity_bytes, self.capacity_bytes
        if short > 0:
            return f"at least {format_bytes(need)}, {format_bytes(short)} over the {format_bytes(capacity)} capacity"
        return (f"{format_bytes(need)}, within the {format_bytes(capacity)} capacity, but the allocator asks the "
                f"device for a new {format_bytes(self.segment_bytes)} segment, and the "
                f"{format_bytes(self.reserved_bytes)} it holds leave no room for it")


@dataclass(frozen=True, kw_only=True)
class RealTimeline(Record):
    """A real GPU's recorded snapshot (``torch.cuda.memory._record_memory_history``) of the fit rule at the
    same micro-batch, beside the prediction: (allocation number, reserved, requested bytes) points of each."""

    reserved_peak_bytes: int
    requested_peak_bytes: int
    predicted_reserved_peak_bytes: int
    real: tuple[tuple[int, int, int], ...] = ()
    predicted: tuple[tuple[int, int, int], ...] = ()
    snapshot_file: str | None = None

    @property
    def difference_bytes(self) -> int:
        """Real minus predicted reserved peak."""
        return self.reserved_peak_bytes - self.predicted_reserved_peak_bytes


@dataclass(frozen=True, kw_only=True)
class MemoryTimeline(Record):
    """The fit rule at ``batch`` allocation by allocation (the estimate's, ``simulated`` through the caching
    allocator when it stands in for a GPU): the peak, what is live there, and the timeline.

    ``parts`` sum to ``reserved_peak_bytes`` (``context`` is extra: outside the allocator): what is live at
    ``peak_event``, the moment that limits the micro-batch (the most allocated while the reserved peak is held).
    ``series`` holds sampled points ``(event, *SERIES)`` (bytes by kind; ``allocator`` is reserved minus the
    tensors); ``phases`` ``(event, name)`` where each phase of the fit rule starts. ``lowering`` says in one
    sentence what would lower the peak most, with the figure the estimate computed (``lowering_bytes``). ``options``
    compares allocator settings, ``advice`` says which one helps.

    ``out_of_memory``: where the simulated GPU runs out of memory at ``batch`` (a size that does not fit), and
    what it asks for there; ``lowering`` and ``advice`` are then about that demand. The snapshot goes on past it
    without a limit, as a GPU large enough would: the peaks and ``parts`` are that replay's.
    """

    batch: Whole
    simulated: bool
    reserved_peak_bytes: int
    allocated_peak_bytes: int
    peak_event: int
    peak_phase: str
    events: int
    parts: tuple[PeakPart, ...] = ()
    phases: tuple[tuple[int, str], ...] = ()
    series: tuple[tuple[int, int, int, int, int, int, int], ...] = ()
    lowering: str = ""
    lowering_bytes: int | None = None
    options: tuple[AllocatorOption, ...] = ()
    advice: tuple[str, ...] = ()
    snapshot_file: str | None = None
    real: RealTimeline | None = field(default=None)
    out_of_memory: OutOfMemory | None = None

    def top(self, n: int = 5) -> list[PeakPart]:
        """The ``n`` largest parts inside the allocator."""
        inside = [p for p in self.parts if p.kind != "context"]
        return sorted(inside, key=lambda p: -p.bytes)[:n]

    def lines(self, n: int = 5, *, capacity: int | None = None) -> list[str]:
        """For a terminal: the peak, its top parts, the lowering sentence and the advice. ``capacity``: the
        device's; a live peak (no allocator simulated) above it is said not to fit."""
        oom = self.out_of_memory
        if oom is not None:
            demand = oom.reserved_bytes + oom.requested_bytes
            out = [f"memory at micro-batch {self.batch}: {oom.headline()}; the demand there, {format_bytes(demand)}, "
                   "is the request and what the allocator holds then (live blocks, cached free blocks):",
                   f"  the request, {oom.request.label}: {format_bytes(oom.requested_bytes)} "
                   f"({share(oom.requested_bytes, demand)})"]
            out += [f"  {'held' if p.kind in ('cache', 'rounding') else 'live'}, {p.label}: {format_bytes(p.bytes)} "
                    f"({share(p.bytes, demand)})" for p in sorted(oom.parts, key=lambda p: -p.bytes)[:n]]
            out.append(f"past that point the snapshot goes on without a limit, as on a GPU large enough: there the "
                       f"fit rule's blocks peak at {format_bytes(self.allocated_peak_bytes)} (allocated peak), the "
                       f"least such a GPU must hold for micro-batch {self.batch}")
        else:
            peak = "reserved" if self.simulated else "live"
            over = not self.simulated and capacity is not None and self.reserved_peak_bytes > capacity
            verdict = f"does not fit: the {format_bytes(capacity or 0)} capacity runs out before it (the device " \
                "stops the fit rule with its out-of-memory error there), " if over else ""
            out = [f"memory at micro-batch {self.batch}: {verdict}{peak} peak {format_bytes(self.reserved_peak_bytes)} "
                   f"in {self.peak_phase}; largest parts:"]
            for p in self.top(n):
                out.append(f"  {p.label}: {format_bytes(p.bytes)} ({share(p.bytes, self.reserved_peak_bytes)})")
        if self.lowering:
            out.append(self.lowering)
        out += list(self.advice)
        if self.real is not None:
            r = self.real
            out.append(f"real GPU at micro-batch {self.batch}: reserved peak {format_bytes(r.reserved_peak_bytes)}, "
                       f"predicted {format_bytes(r.predicted_reserved_peak_bytes)} "
                       f"({r.difference_bytes:+,} bytes)")
        if self.snapshot_file:
            out.append(f"memory snapshot: {self.snapshot_file} (python -m torch.cuda._memory_viz trace_plot "
                       f"{self.snapshot_file} -o memory.html, or pytorch.org/memory_viz)")
        return out


def share(part: int, total: int) -> str:
    """``part`` as a whole percentage of ``total``, never rounded to 0% or 100% when it is neither."""
    if not total or not part:
        return "0%"
    if part >= total:
        return f"{part / total:.0%}"
    found = f"{part / total:.0%}"
    return "<1%" if found == "0%" else ">99%" if found == "100%" else found
