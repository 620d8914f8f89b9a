"""ProbeResult: what the probe found, how, and every trial it ran. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from .serial import envelope, invalid, open_envelope, read_fields, read_record
from .units import format_bytes

TRIAL_COLUMNS = ("batch", "source", "peak_bytes", "fits", "seconds", "oom")
TRIAL_TYPES = {"batch": int, "source": str, "peak_bytes": int | None, "fits": bool, "seconds": float, "oom": bool}


def trials_frame(rows: list[dict[str, Any]] | None = None) -> pd.DataFrame:
    """The trials table: one row per fit-rule run, in the order they ran."""
    frame = pd.DataFrame(rows or [], columns=list(TRIAL_COLUMNS))
    return frame.astype({"batch": "int64", "source": "object", "peak_bytes": "Int64", "fits": "bool",
                         "seconds": "float64", "oom": "bool"})


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
    """

    workload: str
    device: dict[str, Any]
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
    trials: pd.DataFrame = field(default_factory=trials_frame, compare=False, repr=False)
    seconds: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # how to load the workload again (probe file or module), when known
    ranks: tuple[int, ...] = ()  # under torchrun: every rank's own max micro-batch, in rank order
    data_parallel: bool = False  # the fit rule held DDP's gradient buckets (plans for world size > 1)

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.max_micro_batch < 1 or self.max_batch < self.max_micro_batch:
            raise ValueError(f"max_micro_batch {self.max_micro_batch} must be in [1, max_batch={self.max_batch}]")
        if self.usable_bytes > self.capacity_bytes or self.usable_bytes <= 0:
            raise ValueError(f"usable {self.usable_bytes} must be in (0, capacity {self.capacity_bytes}]")
        if self.limited_by not in ("memory", "max_batch"):
            raise ValueError(f"limited_by must be 'memory' or 'max_batch', got {self.limited_by!r}")
        if not isinstance(self.trials, pd.DataFrame) or list(self.trials.columns) != list(TRIAL_COLUMNS):
            raise ValueError(f"trials must be a DataFrame with columns {TRIAL_COLUMNS}")
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "curve", tuple((int(b), int(p)) for b, p in self.curve))
        object.__setattr__(self, "curve_lines", tuple((float(a), float(c)) for a, c in self.curve_lines))

    @property
    def headroom_bytes(self) -> int:
        """Usable memory left at the max micro-batch."""
        return self.usable_bytes - self.peak_bytes

    @property
    def real_runs(self) -> int:
        return int((self.trials["source"] == "real").sum())

    @property
    def real_ooms(self) -> int:
        return int(((self.trials["source"] == "real") & self.trials["oom"]).sum())

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
        limit = "the largest size allowed (--max-batch)" if self.limited_by == "max_batch" else "memory"
        return (
            f"max micro-batch {self.max_micro_batch} on {self.device.get('name')} ({status}; limited by {limit}): "
            f"peak {format_bytes(self.peak_bytes)} of {format_bytes(self.usable_bytes)} usable "
            f"({format_bytes(self.capacity_bytes)} capacity, margin {self.margin:.0%})"
        )

    def to_dict(self) -> dict[str, Any]:
        trials = self.trials.astype(object).where(self.trials.notna(), None)
        return envelope("ProbeResult", {
            "workload": self.workload,
            "device": self.device,
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
            "trials": trials.to_dict(orient="records"),
            "real_runs": self.real_runs,
            "real_ooms": self.real_ooms,
            "seconds": self.seconds,
            "options": self.options,
            "source": self.source,
            "ranks": list(self.ranks),
            "data_parallel": self.data_parallel,
        })

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "data") -> ProbeResult:
        _, body = open_envelope(data, "ProbeResult", source=source)
        for derived in ("headroom_bytes", "real_runs", "real_ooms"):
            body.pop(derived, None)
        body = read_fields(cls, body, kind="ProbeResult", source=source)
        rows = body.get("trials", [])
        if not isinstance(rows, list):
            raise invalid("ProbeResult", source, "trials is not a list of trial objects")
        types = {c: TRIAL_TYPES.get(c, Any) for c in TRIAL_COLUMNS}
        rows = [read_record(row, types, kind="ProbeResult", source=source, where=f"trials[{i}]")
                for i, row in enumerate(rows)]
        try:
            body["trials"] = trials_frame(rows)
            return cls(**body)
        except (TypeError, ValueError) as exc:
            raise invalid("ProbeResult", source, str(exc)) from None
