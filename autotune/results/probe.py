"""ProbeResult: what the probe found, how, and every trial it ran. No torch, no pandas here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from ..options import PARALLEL, Parallel
from ..units import format_bytes, format_margin
from .device import DeviceInfo
from .model import ModelFacts
from .record import Margin, Record, Whole, derived, memory_only, one_of, written_fields
from .timeline import MemoryTimeline

SOURCES = ("estimate", "real")
LIMITS = ("memory", "max_batch", "host_memory")
#: How the note of a probe that chose FSDP's gradient sync begins (a plan shows it under its FSDP line).
FSDP_CHOICE = "FSDP gradient sync "


@dataclass(frozen=True, kw_only=True)
class Trial(Record):
    """One run of the fit rule at ``batch``: its peak, or why it stopped.

    ``peak_bytes`` is None when the run stopped before finishing (an
    out-of-memory error, ``oom``); ``why`` says why a run that does not fit
    did not, in words. On CUDA (measured, or simulated by an estimate standing
    in for a GPU) ``peak_bytes`` is the caching allocator's reserved peak,
    ``allocated_bytes`` its allocated peak and ``retries`` how often it freed
    its cache to retry a cudaMalloc; both None where no caching allocator decides.

    ``measurement``: the device's :class:`~autotune.devices.measurement.Measurement` of the run, when it ran to
    the end (its breakdown, timeline and allocation trace), which the probe reads while it searches. It stays in
    this process: never written to JSON, read back, compared or shown (a trial read from a file has None).
    """

    batch: Whole
    source: Annotated[str, one_of(SOURCES)]
    peak_bytes: int | None
    fits: bool
    seconds: float
    oom: bool = False
    why: str | None = None
    allocated_bytes: int | None = None
    retries: int | None = None
    measurement: Any = memory_only()  # a devices.measurement.Measurement (results import no device code)

    def validate(self) -> None:
        if self.peak_bytes is None and not self.oom:
            raise ValueError("a trial without a peak must be one that ran out of memory")
        if self.oom and self.fits:
            raise ValueError("a trial that ran out of memory does not fit")
        object.__setattr__(self, "seconds", float(self.seconds))


TRIAL_COLUMNS = tuple(f.name for f in written_fields(Trial))


@dataclass(frozen=True, kw_only=True)
class ProbeResult(Record):
    """The largest micro-batch that fits a device, and the evidence.

    ``estimated`` is True when no real device confirmed the figure (``--device
    estimate``). ``peak_bytes`` is the measured peak at ``max_micro_batch``
    (the estimate's, when estimated); ``predicted_peak_bytes`` the estimate's.
    ``limited_by`` is "memory", "max_batch" when the largest size allowed fits, or "host_memory" when
    the next size's batch is more than the host can build (a note says how much).
    ``curve`` holds (batch, estimated peak bytes) pairs, ``curve_lines`` the
    (intercept, slope) lines whose maximum is the estimated peak at any size;
    ``trials`` one row per run.

    Where a CUDA caching allocator decides (a GPU, or an estimate standing in
    for one), ``peak_bytes`` is its *reserved* peak, ``allocated_peak_bytes``
    its allocated peak at ``max_micro_batch`` and ``alloc_retries`` its
    release-and-retry count there (measured on a GPU, simulated by an
    estimate); ``predicted_allocated_peak_bytes`` is the simulation's allocated
    peak when a GPU measured the rest. All None where no allocator decides.
    """

    KIND = "ProbeResult"

    workload: str
    device: DeviceInfo
    estimated: bool
    max_micro_batch: Whole
    max_batch: int
    capacity_bytes: int
    usable_bytes: int
    margin: Margin
    peak_bytes: int
    predicted_peak_bytes: int
    breakdown: dict[str, int]
    limited_by: Annotated[str, one_of(LIMITS)]
    estimate_error: float | None = None
    notes: tuple[str, ...] = ()
    curve: tuple[tuple[int, int], ...] = ()
    curve_lines: tuple[tuple[float, float], ...] = ()
    trials: tuple[Trial, ...] = field(default=(), repr=False)
    seconds: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # how to load the workload again (probe file or module), when known
    ranks: tuple[int, ...] = ()  # under torchrun: every rank's own max micro-batch, in rank order
    data_parallel: bool = False  # the fit rule held DDP's gradient buckets (plans for world size > 1)
    allocated_peak_bytes: int | None = None
    alloc_retries: int | None = None
    predicted_allocated_peak_bytes: int | None = None
    # "fsdp": the fit rule of one rank of a model sharded over world_size ranks
    parallel: Annotated[Parallel, one_of(PARALLEL)] = "ddp"
    world_size: Whole | None = None  # the ranks an FSDP probe sharded over (its figures hold for that many)
    # an FSDP probe's gradient sync: a reduce-scatter after "every" micro-step, or at the "last" one only
    fsdp_sync: Annotated[str | None, one_of(("every", "last"))] = None
    fingerprint: str | None = None  # the plan store's key for this probe, when a store was used
    from_store: bool = False  # answered from the plan store (confirmed by one real run on a real device)
    memory: MemoryTimeline | None = None  # where the peak comes from, when a memory snapshot was asked for
    model: ModelFacts | None = None  # a Hugging Face model by name: its parameter counts, the formula's figures

    def validate(self) -> None:
        if self.max_batch < self.max_micro_batch:
            raise ValueError(f"max_micro_batch {self.max_micro_batch} must be in [1, max_batch={self.max_batch}]")
        if self.usable_bytes > self.capacity_bytes or self.usable_bytes <= 0:
            raise ValueError(f"usable {self.usable_bytes} must be in (0, capacity {self.capacity_bytes}]")
        if self.parallel == "fsdp" and self.world_size is None:
            raise ValueError("an FSDP probe needs the world size it sharded over, got None")
        if self.fsdp_sync is not None and self.parallel != "fsdp":
            raise ValueError(f"fsdp_sync {self.fsdp_sync} is for an FSDP probe, this one is {self.parallel}")
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "curve", tuple((int(b), int(p)) for b, p in self.curve))
        object.__setattr__(self, "curve_lines", tuple((float(a), float(c)) for a, c in self.curve_lines))

    @property
    @derived(after="predicted_peak_bytes")
    def headroom_bytes(self) -> int:
        """Usable memory left at the max micro-batch."""
        return self.usable_bytes - self.peak_bytes

    @property
    @derived(after="predicted_allocated_peak_bytes")
    def fragmentation_bytes(self) -> int | None:
        """The reserved peak minus the allocated peak: memory the allocator held beyond its tensors' blocks
        (cached, unsplit or rounded), as two peaks that can come at different moments; not the cached free blocks
        at the reserved peak (a memory timeline's ``cache`` part)."""
        return None if self.allocated_peak_bytes is None else self.peak_bytes - self.allocated_peak_bytes

    @property
    @derived(after="trials")
    def real_runs(self) -> int:
        return sum(t.source == "real" for t in self.trials)

    @property
    @derived(after="trials")
    def real_ooms(self) -> int:
        return sum(t.source == "real" and t.oom for t in self.trials)

    def predicted_peak_at(self, batch: int) -> int | None:
        """The estimated peak at ``batch``: exact from the curve's lines, else interpolated
        between the curve's points (None outside them)."""
        if self.curve_lines:
            return int(round(max(a + c * batch for a, c in self.curve_lines)))
        points = sorted(self.curve)
        for (b0, p0), (b1, p1) in zip(points, points[1:]):
            if b0 <= batch <= b1:
                return int(round(p0 + (p1 - p0) * (batch - b0) / (b1 - b0)))
        return next((p for b, p in points if b == batch), None)

    def to_dict(self) -> dict[str, Any]:
        """As every record writes itself, but ``model`` only for a model by name (other files read as before)."""
        data = super().to_dict()
        if data.get("model", ...) is None:
            del data["model"]
        return data

    def summary(self) -> str:
        status = "estimated, not confirmed on a real device" if self.estimated else "confirmed by a real run"
        limit = f"the largest size allowed ({self.max_batch})" if self.limited_by == "max_batch" else \
            "the host's memory (the batch built on the host)" if self.limited_by == "host_memory" else "memory"
        peak = "reserved peak" if self.allocated_peak_bytes is not None else "peak"
        source = self.device.capacity_source
        fraction = f": {source.split(';')[0]}" if source.startswith("per_process_memory_fraction") else ""
        return (
            f"max micro-batch {self.max_micro_batch} on {self.device.name} ({status}; limited by {limit}): "
            f"{peak} {format_bytes(self.peak_bytes)} of {format_bytes(self.usable_bytes)} usable "
            f"({format_bytes(self.capacity_bytes)} capacity{fraction}, margin {format_margin(self.margin)})"
        )

    def allocator_line(self) -> str | None:
        """The caching allocator's figures at the max micro-batch, in words (None where none decides)."""
        if self.allocated_peak_bytes is None:
            return None
        how = "simulated" if self.estimated else "measured"
        frag = self.fragmentation_bytes or 0
        share = f": {frag / self.peak_bytes:.1%} of reserved" if self.peak_bytes else ""
        text = (f"caching allocator ({how}): reserved peak {format_bytes(self.peak_bytes)}, allocated peak "
                f"{format_bytes(self.allocated_peak_bytes)}, fragmentation {format_bytes(frag)} (reserved peak minus "
                f"allocated peak{share}), {self.alloc_retries or 0} release-and-retries")
        if not self.estimated and self.predicted_allocated_peak_bytes is not None:
            text += (f"; simulated: reserved peak {format_bytes(self.predicted_peak_bytes)}, allocated peak "
                     f"{format_bytes(self.predicted_allocated_peak_bytes)}")
        return text
