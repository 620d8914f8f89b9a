"""Tuning: what ``--tune`` measured, candidate by candidate, and why it kept the plan it kept."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .record import Record


@dataclass(frozen=True, kw_only=True)
class HeadToHead(Record):
    """The fastest candidate against the untuned plan, interleaved: its speed-up and the half-width of
    that ratio's ~95% interval over ``rounds`` rounds (None when it could not run, and ``why``)."""

    ratio: float | None
    uncertainty: float | None
    rounds: int = 0
    why: str = ""


@dataclass(frozen=True, kw_only=True)
class Candidate(Record):
    """One exact plan the tuner considered: its micro-batch, options, and what it measured.

    ``samples_per_s`` is None when it did not run (``why`` says so: estimated over the
    memory, ran out of memory); ``vs_baseline`` its throughput over the untuned plan's,
    measured one after the other; ``head_to_head`` set for the fastest one only.
    """

    micro_batch: int
    accumulation_steps: int
    options: dict[str, Any] = field(default_factory=dict)
    options_label: str = "defaults"
    predicted_peak_bytes: int | None = None
    fits: bool = True
    samples_per_s: float | None = None
    seconds_per_step: float | None = None
    spread: float | None = None
    timed_steps: int = 0
    why: str = ""
    baseline: bool = False
    vs_baseline: float | None = None
    head_to_head: HeadToHead | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.options_label, self.micro_batch

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Candidate:
        """A candidate from the tuner's working row (keys beyond the fields are dropped)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in known})


@dataclass(frozen=True, kw_only=True)
class Tuning(Record):
    """What the tuner measured: every candidate, the untuned plan (``baseline``), the fastest, the
    one chosen, and the head-to-head ratio that decided between them."""

    candidates: tuple[Candidate, ...]
    chosen: Candidate
    baseline: Candidate | None = None
    fastest: Candidate | None = None
    ratio: float | None = None
    uncertainty: float | None = None
    kept_baseline: bool = False
    trials: int = 0
    measured: int = 0
    storage: str | None = None
    study_name: str = ""
    timing: dict[str, Any] = field(default_factory=dict)

    def is_chosen(self, candidate: Candidate) -> bool:
        return candidate.key == self.chosen.key
