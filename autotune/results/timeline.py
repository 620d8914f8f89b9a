"""MemoryTimeline: where the peak of the fit rule comes from, its timeline, and allocator settings compared.

Attached to a ProbeResult (``memory``) when a memory snapshot was asked for
(``--memory-snapshot``). Plain numbers and words only: no torch, no pandas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..units import format_bytes
from .record import Record, Whole, one_of

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
    it cannot beat the user's there)."""

    setting: str
    conf: str
    reserved_bytes: int
    allocated_bytes: int
    retries: int
    max_micro_batch: int | None = None

    @property
    def fragmentation_bytes(self) -> int:
        """The reserved peak minus the allocated peak (as a ProbeResult's ``fragmentation_bytes``)."""
        return self.reserved_bytes - self.allocated_bytes


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

    ``parts`` sum to ``reserved_peak_bytes`` (``context`` is extra: outside the allocator). ``series`` holds
    sampled points ``(event, *SERIES)`` (bytes by kind; ``allocator`` is reserved minus the tensors); ``phases``
    ``(event, name)`` where each phase of the fit rule starts. ``lowering`` says in one sentence what would
    lower the peak most, with the figure the estimate computed (``lowering_bytes``). ``options`` compares
    allocator settings, ``advice`` says which one helps.
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

    def top(self, n: int = 5) -> list[PeakPart]:
        """The ``n`` largest parts inside the allocator."""
        inside = [p for p in self.parts if p.kind != "context"]
        return sorted(inside, key=lambda p: -p.bytes)[:n]

    def lines(self, n: int = 5) -> list[str]:
        """For a terminal: the peak, its top parts, the lowering sentence and the advice."""
        peak = "reserved" if self.simulated else "live"
        out = [f"memory at micro-batch {self.batch}: {peak} peak {format_bytes(self.reserved_peak_bytes)} in "
               f"{self.peak_phase}; largest parts:"]
        for p in self.top(n):
            share = p.bytes / self.reserved_peak_bytes if self.reserved_peak_bytes else 0.0
            out.append(f"  {p.label}: {format_bytes(p.bytes)} ({share:.0%})")
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
