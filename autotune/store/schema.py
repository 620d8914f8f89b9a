"""The plan store's tables and the typed rows read from them. No torch here.

Six tables, in any database SQLAlchemy reaches (SQLite by default, PostgreSQL for a team):

- ``autotune_store_info``: the store's layout version (its ``schema`` row), which
  :mod:`autotune.store.migrations` brings up to date;

- ``autotune_entries``: one probe result per fingerprint, with the fingerprint's
  parts, when and on what it was measured, how often it was served, and, once a
  confirm run disagreed with it, when and why it stopped being served;
- ``autotune_plans``: the plans made from an entry, one per target batch, world
  size, ``multiple_of`` and ``uniform``;
- ``autotune_measurements``: what every real run measured (fit-rule runs of a
  probe, confirm runs, planned runs, runs reported over HTTP), against the
  fingerprint, with the estimate for the same micro-batch;
- ``autotune_claims``: who is probing a fingerprint right now, so that
  concurrent requests for it probe once and the others wait, and until when
  (the holder renews it while it probes);
- ``autotune_requests``: the requests ``autotune serve`` answered, by a digest of
  their settings, and the fingerprint each was answered with: a request seen
  before is answered from the store without taking its fingerprint again.

Times are seconds since the epoch (UTC), stored as floats.
"""

from __future__ import annotations

import datetime
import functools
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from ..errors import BadInput, first_line

if TYPE_CHECKING:
    from ..results.probe import ProbeResult

#: The layout this autotune writes; a store written by a newer one is refused, an older one brought up to
#: date (:mod:`autotune.store.migrations`).
STORE_SCHEMA = 2
#: The oldest layout this autotune reads as it is, where it may not write (a store opened read-only).
READS_FROM = 1

metadata = MetaData()

info = Table(
    "autotune_store_info", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(200), nullable=False),
)

entries = Table(
    "autotune_entries", metadata,
    Column("fingerprint", String(64), primary_key=True),
    Column("workload", String(200), nullable=False),
    Column("device", String(300), nullable=False),
    Column("device_kind", String(16), nullable=False),
    Column("estimated", Boolean, nullable=False),
    Column("max_micro_batch", Integer, nullable=False),
    Column("max_batch", Integer, nullable=False),
    Column("limited_by", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("hits", Integer, nullable=False),
    Column("last_hit_at", Float),
    Column("invalidated_at", Float),
    Column("invalid_reason", Text),
    Column("components", Text, nullable=False),
    Column("probe", Text, nullable=False),
    Column("autotune_version", String(32), nullable=False),
    Index("autotune_entries_created_at", "created_at"),  # layout 2
)

plans = Table(
    "autotune_plans", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("fingerprint", String(64), nullable=False),
    Column("key", String(100), nullable=False),
    Column("target_batch", Integer, nullable=False),
    Column("world_size", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("plan", Text, nullable=False),
    UniqueConstraint("fingerprint", "key", name="autotune_plans_fingerprint_key"),
)

measurements = Table(
    "autotune_measurements", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("fingerprint", String(64), nullable=False),
    Column("recorded_at", Float, nullable=False),
    Column("source", String(16), nullable=False),
    Column("device", String(300), nullable=False),
    Column("device_kind", String(16), nullable=False),
    Column("batch", Integer, nullable=False),
    Column("peak_reserved_bytes", BigInteger),
    Column("peak_allocated_bytes", BigInteger),
    Column("estimated_peak_bytes", BigInteger),
    Column("oom", Boolean, nullable=False),
    Column("retries", Integer, nullable=False),
    Column("throughput", Float),
    Column("seconds", Float),
    Column("note", Text),
    Index("autotune_measurements_fingerprint", "fingerprint"),
    Index("autotune_measurements_recorded_at", "recorded_at"),  # layout 2
)

claims = Table(
    "autotune_claims", metadata,
    Column("fingerprint", String(64), primary_key=True),
    Column("owner", String(200), nullable=False),
    Column("claimed_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)

requests = Table(  # layout 2
    "autotune_requests", metadata,
    Column("key", String(64), primary_key=True),
    Column("fingerprint", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    Index("autotune_requests_fingerprint", "fingerprint"),
)

#: Where a measurement came from.
SOURCES = ("probe", "confirm", "run", "reported")


class DamagedEntry(BadInput):
    """A stored entry that cannot be read back (a row changed or cut short outside autotune)."""


def when(seconds: float | None) -> str:
    """A stored time as people read it: ``2025-01-31 14:02 UTC``."""
    if seconds is None or isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "-"
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A stored probe result and what is known about it.

    A row that cannot be read back (its probe result or parts are not the JSON autotune wrote, or its
    columns disagree with them) is *damaged*: :attr:`damage` says why, it answers no probe, and
    :meth:`probe` raises :class:`DamagedEntry`. It can still be listed and removed.
    """

    fingerprint: str
    workload: str
    device: str
    device_kind: str
    estimated: bool
    max_micro_batch: int
    max_batch: int
    limited_by: str
    created_at: float
    hits: int
    last_hit_at: float | None
    invalidated_at: float | None
    invalid_reason: str | None
    components: dict[str, Any] = field(repr=False)
    probe_json: str = field(repr=False)
    autotune_version: str
    unreadable: str | None = field(default=None, repr=False)  # why the row's parts could not be read

    @property
    def valid(self) -> bool:
        return self.invalidated_at is None

    @property
    def short(self) -> str:
        return str(self.fingerprint)[:12]

    @cached_property
    def _read(self) -> ProbeResult | str:
        """The stored ProbeResult, read once, or why the row cannot be read back."""
        if self.unreadable is not None:
            return self.unreadable
        try:
            result = _probe_result(self.probe_json, self.short)
        except (ValueError, TypeError, BadInput) as exc:  # JSONDecodeError is a ValueError
            return f"its probe result cannot be read ({first_line(exc)})"
        for name in ("max_micro_batch", "limited_by"):
            if getattr(result, name) != getattr(self, name):
                return (f"its {name} column ({getattr(self, name)!r}) disagrees with its probe result "
                        f"({getattr(result, name)!r})")
        return result

    @property
    def damage(self) -> str | None:
        """Why this entry cannot be read back, or None when it can."""
        return self._read if isinstance(self._read, str) else None

    def probe(self) -> ProbeResult:
        """The stored ProbeResult; DamagedEntry when the row cannot be read back."""
        if isinstance(self._read, str):
            raise DamagedEntry(f"the store's entry {self.short} is damaged: {self._read}; it is probed again "
                               f"and replaced the next time it is asked for, or remove it with autotune store rm "
                               f"{self.short}")
        return self._read

    def answers(self, max_batch: int) -> bool:
        """Does this entry answer a probe limited to ``max_batch`` (per rank)? A maximum that memory
        set answers every limit (a smaller one with that limit); one that its own limit set answers that
        limit and every smaller one."""
        if not self.valid or self.damage is not None:
            return False
        if self.limited_by == "memory":
            return True
        return max_batch <= self.max_batch

    def to_dict(self, *, probe: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "fingerprint": self.fingerprint, "workload": self.workload, "device": self.device,
            "device_kind": self.device_kind, "estimated": self.estimated, "max_micro_batch": self.max_micro_batch,
            "max_batch": self.max_batch, "limited_by": self.limited_by, "created_at": self.created_at,
            "measured": when(self.created_at), "hits": self.hits, "last_hit_at": self.last_hit_at,
            "valid": self.valid, "invalidated_at": self.invalidated_at, "invalid_reason": self.invalid_reason,
            "damaged": self.damage, "autotune_version": self.autotune_version, "components": self.components,
        }
        if probe:
            out["probe"] = None if self.damage is not None else json.loads(self.probe_json)
        return out

    @classmethod
    def from_row(cls, row: Any) -> Entry:
        """The entry in a row of ``autotune_entries``; never raises for what the row holds (see :attr:`damage`)."""
        data = dict(row._mapping)
        data["probe_json"] = data.pop("probe")
        try:
            components = json.loads(data["components"])
        except (TypeError, ValueError):
            components = None
        data["components"] = components if isinstance(components, dict) else {}
        if components is None or not isinstance(components, dict):
            data["unreadable"] = "its fingerprint's parts are not a JSON object"
        for name in ("max_micro_batch", "max_batch", "hits"):
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int):
                data["unreadable"] = f"its {name} column holds {value!r}, not a whole number"
        if not isinstance(data["probe_json"], str):
            data["unreadable"] = "its probe result is not text"
        return cls(**data)


@functools.lru_cache(maxsize=256)
def _probe_result(text: str, short: str) -> ProbeResult:
    """The ProbeResult a stored row's JSON holds, read once per process for the same text (a service reads
    the same entries for every request; the result is frozen)."""
    from ..results.probe import ProbeResult

    return ProbeResult.from_dict(json.loads(text), source=f"the store's entry {short}")


@dataclass(frozen=True, kw_only=True)
class Observation:
    """What one real run measured, against a fingerprint.

    ``peak_reserved_bytes`` is the device's own peak (``max_memory_reserved`` on
    CUDA, live tensor bytes on the CPU), ``peak_allocated_bytes`` the live tensor
    bytes at the peak (about ``max_memory_allocated`` on CUDA); both None after an
    out-of-memory error (``oom``). ``estimated_peak_bytes`` is the estimate's peak
    for the same micro-batch. ``runs_before``: real runs before this one in the
    same probe (0 for the first, and for a run of a plan; the table's column
    ``retries`` holds it). ``throughput``: samples per second, for runs of a plan.
    """

    fingerprint: str
    source: str
    device: str
    device_kind: str
    batch: int
    peak_reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    estimated_peak_bytes: int | None = None
    oom: bool = False
    runs_before: int = 0
    throughput: float | None = None
    seconds: float | None = None
    note: str | None = None
    recorded_at: float | None = None
    id: int | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"measurement source must be one of {SOURCES}, got {self.source!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"measurement batch must be a whole number of at least 1, got {self.batch!r}")
        for name in ("peak_reserved_bytes", "peak_allocated_bytes", "estimated_peak_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"measurement {name} must be a whole number of bytes >= 0, got {value!r}")
        if self.runs_before < 0:
            raise ValueError(f"measurement runs_before must be >= 0, got {self.runs_before}")

    @property
    def error(self) -> float | None:
        """(measured - estimated) / estimated peak, when both are known."""
        if self.oom or self.peak_reserved_bytes is None or not self.estimated_peak_bytes:
            return None
        return (self.peak_reserved_bytes - self.estimated_peak_bytes) / self.estimated_peak_bytes

    def row(self) -> dict[str, Any]:
        """The table's row (no ``id``: the table gives it); ``runs_before`` in its column ``retries``."""
        data = {_COLUMNS.get(k, k): v for k, v in self.__dict__.items() if k != "id"}
        return data

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "error": self.error}

    @classmethod
    def from_row(cls, row: Any) -> Observation:
        return cls(**{_FIELDS.get(k, k): v for k, v in row._mapping.items()})


#: The fields of an Observation whose column in ``autotune_measurements`` has another name, and back.
_COLUMNS = {"runs_before": "retries"}
_FIELDS = {column: name for name, column in _COLUMNS.items()}
