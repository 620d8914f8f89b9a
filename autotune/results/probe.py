"""ProbeResult: what the probe found, how, and every trial it ran. No torch, no pandas here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..serial import envelope, invalid, open_envelope, read_dataclass, read_fields
from ..units import format_bytes
from .device import DeviceInfo
from .timeline import MemoryTimeline

SOURCES = ("estimate", "real")
PARALLEL = ("ddp", "fsdp")


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One run of the fit rule at ``batch``: its peak, or why it stopped.

    ``peak_bytes`` is None when the run stopped before finishing (an
    out-of-memory error, ``oom``); ``why`` says why a run that does not fit
    did not, in words. On CUDA (measured, or simulated by an estimate standing
    in for a GPU) ``peak_bytes`` is the caching allocator's reserved peak,
    ``allocated_bytes`` its allocated peak and ``retries`` how often it freed
    its cache to retry a cudaMalloc; both None where no caching allocator decides.
    """

    batch: int
    source: str  # "estimate" or "real"
    peak_bytes: int | None
    fits: bool
    seconds: float
    oom: bool = False
    why: str | None = None
    allocated_bytes: int | None = None
    retries: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"trial batch must be a whole number of at least 1, got {self.batch!r}")
        if self.source not in SOURCES:
            raise ValueError(f"trial source must be one of {SOURCES}, got {self.source!r}")
        if self.peak_bytes is None and not self.oom:
            raise ValueError("a trial without a peak must be one that ran out of memory")
        if self.oom and self.fits:
            raise ValueError("a trial that ran out of memory does not fit")
        object.__setattr__(self, "seconds", float(self.seconds))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trial:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


TRIAL_COLUMNS = tuple(f.name for f in fields(Trial))


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """The largest micro-batch that fits a device, and the evidence.

    ``estimated`` is True when no real device confirmed the figure (``--device
    estimate``). ``peak_bytes`` is the measured peak at ``max_micro_batch``
    (the estimate's, when estimated); ``predicted_peak_bytes`` the estimate's.
    ``limited_by`` is "memory", or "max_batch" when the largest size allowed fits.
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

    workload: str
    device: DeviceInfo
    estimated: bool
    max_micro_batch: int
    max_batch: int
    capacity_bytes: int
    usable_bytes: int
    margin: float
    peak_bytes: int
    predicted_peak_bytes: int
    breakdown: dict[str, int]
    limited_by: str
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
    parallel: str = "ddp"  # "fsdp": the fit rule of one rank of a model sharded over world_size ranks
    world_size: int | None = None  # the ranks an FSDP probe sharded over (its figures hold for that many)
    fingerprint: str | None = None  # the plan store's key for this probe, when a store was used
    from_store: bool = False  # answered from the plan store (confirmed by one real run on a real device)
    memory: MemoryTimeline | None = None  # where the peak comes from, when a memory snapshot was asked for

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.max_micro_batch < 1 or self.max_batch < self.max_micro_batch:
            raise ValueError(f"max_micro_batch {self.max_micro_batch} must be in [1, max_batch={self.max_batch}]")
        if self.usable_bytes > self.capacity_bytes or self.usable_bytes <= 0:
            raise ValueError(f"usable {self.usable_bytes} must be in (0, capacity {self.capacity_bytes}]")
        if self.limited_by not in ("memory", "max_batch"):
            raise ValueError(f"limited_by must be 'memory' or 'max_batch', got {self.limited_by!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if self.parallel == "fsdp" and (not isinstance(self.world_size, int) or self.world_size < 1):
            raise ValueError(f"an FSDP probe needs the world size it sharded over, got {self.world_size!r}")
        if not isinstance(self.device, DeviceInfo):
            raise ValueError(f"device must be a DeviceInfo, got {type(self.device).__name__}")
        object.__setattr__(self, "trials", tuple(self.trials))
        if not all(isinstance(t, Trial) for t in self.trials):
            raise ValueError("trials must be Trial objects")
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "curve", tuple((int(b), int(p)) for b, p in self.curve))
        object.__setattr__(self, "curve_lines", tuple((float(a), float(c)) for a, c in self.curve_lines))

    @property
    def headroom_bytes(self) -> int:
        """Usable memory left at the max micro-batch."""
        return self.usable_bytes - self.peak_bytes

    @property
    def fragmentation_bytes(self) -> int | None:
        """Reserved but not allocated at the peak (cached, unsplit or rounded memory): reserved - allocated."""
        return None if self.allocated_peak_bytes is None else self.peak_bytes - self.allocated_peak_bytes

    @property
    def real_runs(self) -> int:
        return sum(t.source == "real" for t in self.trials)

    @property
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

    def summary(self) -> str:
        status = "estimated, not confirmed on a real device" if self.estimated else "confirmed by a real run"
        limit = f"the largest size allowed ({self.max_batch})" if self.limited_by == "max_batch" else "memory"
        peak = "reserved peak" if self.allocated_peak_bytes is not None else "peak"
        return (
            f"max micro-batch {self.max_micro_batch} on {self.device.name} ({status}; limited by {limit}): "
            f"{peak} {format_bytes(self.peak_bytes)} of {format_bytes(self.usable_bytes)} usable "
            f"({format_bytes(self.capacity_bytes)} capacity, margin {self.margin:.0%})"
        )

    def allocator_line(self) -> str | None:
        """The caching allocator's figures at the max micro-batch, in words (None where none decides)."""
        if self.allocated_peak_bytes is None:
            return None
        how = "simulated" if self.estimated else "measured"
        frag = self.fragmentation_bytes or 0
        share = f" ({frag / self.peak_bytes:.1%} of reserved)" if self.peak_bytes else ""
        text = (f"caching allocator ({how}): reserved {format_bytes(self.peak_bytes)}, allocated "
                f"{format_bytes(self.allocated_peak_bytes)}, fragmentation {format_bytes(frag)}{share}, "
                f"{self.alloc_retries or 0} release-and-retries")
        if not self.estimated and self.predicted_allocated_peak_bytes is not None:
            text += (f"; simulated: reserved {format_bytes(self.predicted_peak_bytes)}, allocated "
                     f"{format_bytes(self.predicted_allocated_peak_bytes)}")
        return text

    def to_dict(self) -> dict[str, Any]:
        return envelope("ProbeResult", {
            "workload": self.workload,
            "device": self.device.to_dict(),
            "estimated": self.estimated,
            "max_micro_batch": self.max_micro_batch,
            "max_batch": self.max_batch,
            "capacity_bytes": self.capacity_bytes,
            "usable_bytes": self.usable_bytes,
            "margin": self.margin,
            "peak_bytes": self.peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "breakdown": self.breakdown,
            "limited_by": self.limited_by,
            "estimate_error": self.estimate_error,
            "notes": list(self.notes),
            "curve": [list(p) for p in self.curve],
            "curve_lines": [list(p) for p in self.curve_lines],
            "trials": [t.to_dict() for t in self.trials],
            "real_runs": self.real_runs,
            "real_ooms": self.real_ooms,
            "seconds": self.seconds,
            "options": self.options,
            "source": self.source,
            "ranks": list(self.ranks),
            "data_parallel": self.data_parallel,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "alloc_retries": self.alloc_retries,
            "predicted_allocated_peak_bytes": self.predicted_allocated_peak_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "parallel": self.parallel,
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "from_store": self.from_store,
            "memory": self.memory.to_dict() if self.memory is not None else None,
        })

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "data") -> ProbeResult:
        _, body = open_envelope(data, "ProbeResult", source=source)
        for derived in ("headroom_bytes", "real_runs", "real_ooms", "fragmentation_bytes"):
            body.pop(derived, None)
        body = read_fields(cls, body, kind="ProbeResult", source=source)
        body["device"] = DeviceInfo.from_dict(body["device"], kind="ProbeResult", source=source)
        if body.get("memory") is not None:
            body["memory"] = MemoryTimeline.from_dict(body["memory"], kind="ProbeResult", source=source)
        rows = [read_dataclass(Trial, row, kind="ProbeResult", source=source, where=f"trials[{i}]")
                for i, row in enumerate(body.get("trials", ()))]
        try:
            body["trials"] = tuple(Trial(**row) for row in rows)
            return cls(**body)
        except (TypeError, ValueError) as exc:
            raise invalid("ProbeResult", source, str(exc)) from None
