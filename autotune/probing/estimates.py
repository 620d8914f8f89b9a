"""The estimate as a function of the batch size, and the search on it (the probe's step 2).

An evaluation of the estimate costs a fraction of a second, so the largest size
that fits by the estimate is found by evaluating it, never by extrapolating a
line from two points. The peak curve through the evaluated runs nearest the
answer guesses where the usable line is crossed (lines through two runs; a
quadratic through three once a run lies off the lines: memory that bends), an
evaluation at the guess checks it, and the search ends when evaluated sizes
next to each other bracket the answer. On an engine whose figures are exact (no
caching-allocator simulation), a size the lines predicted to the byte needs no
evaluation of the next one: the lines hold there too. Standing in for a GPU, the
same holds of the allocation traces (:mod:`autotune.probing.tracelines`): where
the traces at 2 and 3 are lines, their replay gives the size to evaluate, and
an evaluated trace on them to the byte settles the next size by its replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..devices.estimate import EstimateDevice
from ..units import format_bytes
from .search import PeakCurve, search_max
from .tracelines import TraceLines
from .trials import TrialRunner

#: A run whose peak is off the lines through two others by more than this share of it: memory bends.
BEND = 1e-3
#: Guessed evaluations before the search falls back to bisection.
GUESSES = 8


class EstimateCurve:
    """The estimate's peak at any batch size: as evaluated where it ran, from the peak curve elsewhere.

    ``exact``: the engine's figures are exact live bytes (no caching-allocator simulation), so lines
    that predict a run to the byte can be trusted next to it.
    """

    def __init__(self, runs: TrialRunner, *, exact: bool):
        self.runs, self.engine_exact = runs, exact
        self._curves: dict[tuple[int, ...], PeakCurve | None] = {}  # by the sizes fitted through
        self._misses_at: tuple[int, list[tuple[int, int]]] = (-1, [])  # (runs seen, misses): runs only add up

    def _pick(self, near: int, count: int) -> dict[int, Sequence[int]]:
        """Timelines of up to ``count`` runs for a curve around ``near``: the nearest run, the one farthest
        from it (a long baseline), then the next nearest; all of one length (the same steps)."""
        runs = self.runs.timelines()
        if not runs:
            return {}
        first = min(runs, key=lambda b: (abs(b - near), -b))
        same = [b for b in runs if len(runs[b]) == len(runs[first])]
        chosen = [first]
        if len(same) > 1:
            chosen.append(max((b for b in same if b != first), key=lambda b: (abs(b - first), b)))
        rest = [b for b in same if b not in chosen]
        if count > 2 and rest:
            chosen.append(min(rest, key=lambda b: (abs(b - near), -b)))
        return {b: runs[b] for b in chosen}

    def _misses(self) -> list[tuple[int, int]]:
        """(batch, bytes off) of every run against the lines through the two smallest runs of its length."""
        if self._misses_at[0] != len(self.runs.by_size):
            self._misses_at = (len(self.runs.by_size), self._find_misses())
        return self._misses_at[1]

    def _find_misses(self) -> list[tuple[int, int]]:
        runs = self.runs.timelines()
        out = []
        for b, line in runs.items():
            same = sorted(s for s in runs if s != b and len(runs[s]) == len(line))[:2]
            curve = PeakCurve.try_fit({s: runs[s] for s in same}) if len(same) == 2 else None
            if curve is not None and b > max(same):
                out.append((b, abs(self._tracked(b) - curve.peak(b))))
        return out

    def bends(self) -> bool:
        """Does some run lie off the lines through smaller ones (memory growing faster than linearly)?"""
        return any(off > BEND * self._tracked(b) for b, off in self._misses())

    def exact(self) -> bool:
        """Exact engine, and the lines through the two smallest runs predict at least one other to the byte
        and every other within it."""
        misses = self._misses()
        return self.engine_exact and bool(misses) and all(off <= 1 for _, off in misses)

    def _tracked(self, b: int) -> int:
        m = self.runs.by_size[b].measurement
        return m.tracked_peak_bytes if m is not None else 0

    def curve(self, near: int) -> PeakCurve | None:
        """The peak curve for sizes around ``near``: a quadratic through three runs when memory bends."""
        picked = self._pick(near, 3 if self.bends() else 2)
        if len(picked) < 2:
            return None
        key = tuple(sorted(picked))
        if key not in self._curves:
            self._curves[key] = PeakCurve.try_fit(picked)
        return self._curves[key]

    def shift(self, curve: PeakCurve, near: int) -> int:
        """Measured minus curve at the curve's run nearest ``near``: 0 on exact engines; standing in for a
        GPU, the simulated allocator's rounding, cache and workspaces there."""
        s = min(curve.sizes, key=lambda b: (abs(b - near), -b))
        peak = self.runs.by_size[s].peak_bytes
        return 0 if peak is None else peak - curve.peak(s)

    def at(self, batch: int) -> int | None:
        """The estimated peak at ``batch``: measured when it ran there, else from the curve around it."""
        ran = self.runs.by_size.get(batch)
        if ran is not None and ran.peak_bytes is not None:
            return ran.peak_bytes
        curve = self.curve(batch)
        return None if curve is None else curve.peak(batch) + self.shift(curve, batch)


class Replayed:
    """The simulated allocator's peak at sizes never evaluated, from the allocation traces of the evaluations
    at 2 and 3 where they are lines (see :mod:`autotune.probing.tracelines`); nothing on other engines."""

    def __init__(self, runs: TrialRunner, usable: int):
        self.runs, self.usable = runs, usable
        self.lines: TraceLines | None = None
        self.peaks: dict[int, int | None] = {}
        device = runs.device
        traces = {b: a.measurement.trace for b, a in runs.by_size.items() if a.measurement is not None}
        if isinstance(device, EstimateDevice) and device.simulates and traces.get(2) and traces.get(3):
            self.device: EstimateDevice = device
            self.lines = TraceLines.through(2, traces[2], 3, traces[3])

    def peak(self, batch: int) -> int | None:
        """The reserved peak of the trace the lines give at ``batch`` (None without lines there)."""
        if self.lines is None:
            return None
        if batch not in self.peaks:
            trace = self.lines.at(batch)
            self.peaks[batch] = None if trace is None else self.device.replay(trace).reserved_peak
        return self.peaks[batch]

    def fits(self, batch: int) -> bool:
        peak = self.peak(batch)
        return peak is not None and peak <= self.usable

    def max(self, max_batch: int, guess: Callable[[int, int], int | None]) -> int | None:
        """The largest size whose replayed trace fits: the size to evaluate first (None without lines)."""
        if self.lines is None:
            return None
        return search_max(self.fits, low=3, high=max_batch, guess=guess, guesses=GUESSES)

    def next_over(self, lo: int) -> bool:
        """Was ``lo`` evaluated apart from the lines' own sizes, its trace on the lines to the byte, and the
        trace they give at ``lo + 1`` over the usable memory? Then ``lo + 1`` does not fit, unevaluated."""
        ran = self.runs.by_size.get(lo)
        if self.lines is None or lo <= 3 or ran is None or ran.measurement is None:
            return False
        if not self.lines.hold(lo, ran.measurement.trace):
            return False
        after = self.peak(lo + 1)
        return after is not None and after > self.usable


def search_estimate(runs: TrialRunner, curve: EstimateCurve, usable: int, max_batch: int) -> tuple[int, str | None]:
    """The largest size that fits by the estimate, micro-batches 2 and 3 having run and fitted; and a note
    when the lines through them were wrong about it, or when the size past it was replayed, not evaluated."""

    def near(lo: int, hi: int) -> int:
        ran = [b for b in (lo, hi) if runs.by_size.get(b) is not None and runs.by_size[b].peak_bytes is not None]
        return min(ran, key=lambda b: abs(usable - (runs.by_size[b].peak_bytes or 0)), default=lo)

    def guess(lo: int, hi: int) -> int | None:
        around = near(lo, hi)
        c = curve.curve(around)
        return None if c is None else c.max_fitting(usable - curve.shift(c, around), limit=max_batch)

    replayed = Replayed(runs, usable)
    predicted = replayed.max(max_batch, guess)

    def guess_replayed(lo: int, hi: int) -> int | None:
        return predicted if predicted is not None and lo < predicted < hi else guess(lo, hi)

    by_replay: list[int] = []

    def settled(lo: int, hi: int) -> bool:
        if lo in runs.by_size and curve.exact():
            after = curve.at(lo + 1)
            return after is not None and after > usable
        if lo + 1 < hi and replayed.next_over(lo):
            by_replay.append(lo)
            return True
        return False

    first_guess = predicted if predicted is not None else guess(3, max_batch + 1)
    found = search_max(runs.fits, low=3, high=max_batch, guess=guess_replayed, guesses=GUESSES, settled=settled)
    notes = [_replay_note(found, replayed)] if found in by_replay else []
    if first_guess is not None and first_guess != found:
        notes.append(_missed_note(runs, curve, first_guess, found))
    return found, "; ".join(notes) or None


def _replay_note(found: int, replayed: Replayed) -> str:
    peak = replayed.peak(found + 1)
    return (f"micro-batch {found + 1} was not evaluated: every allocation of the estimate at {found} lay to the "
            f"byte on the lines through micro-batches 2 and 3, and their trace at {found + 1} replayed through the "
            f"simulated allocator reserves {format_bytes(peak or 0)}, over the usable {format_bytes(replayed.usable)}")


def _missed_note(runs: TrialRunner, curve: EstimateCurve, first_guess: int, found: int) -> str:
    at_guess = runs.by_size.get(first_guess)
    there = "" if at_guess is None or at_guess.peak_bytes is None else \
        f" where the estimate peaks at {format_bytes(at_guess.peak_bytes)}"
    how = ("memory grows faster than linearly in the batch (a curve that bends), so the estimate was fitted "
           "through three sizes" if curve.bends() else "the lines did not hold there")
    return (f"the lines through micro-batches 2 and 3 predicted max micro-batch {first_guess}{there}; "
            f"{how}, and evaluated at {len(runs.by_size)} sizes the estimate fits {found}")
