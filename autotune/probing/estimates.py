"""The estimate as a function of the batch size, and the search on it (the probe's step 2).

An evaluation of the estimate costs a fraction of a second, so the largest size
that fits by the estimate is found by evaluating it, never by extrapolating a
line from two points. The peak curve through the evaluated runs nearest the
answer guesses where the usable line is crossed (lines through two runs; a
quadratic through three once a run lies off the lines: memory that bends), an
evaluation at the guess checks it, and the search ends when evaluated sizes
next to each other bracket the answer. On an engine whose figures are exact (no
caching-allocator simulation), a size the lines predicted to the byte needs no
evaluation of the next one: the lines hold there too.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..units import format_bytes
from .search import PeakCurve, search_max
from .trials import Trials

#: A run whose peak is off the lines through two others by more than this share of it: memory bends.
BEND = 1e-3
#: Guessed evaluations before the search falls back to bisection.
GUESSES = 8


class EstimateCurve:
    """The estimate's peak at any batch size: as evaluated where it ran, from the peak curve elsewhere.

    ``exact``: the engine's figures are exact live bytes (no caching-allocator simulation), so lines
    that predict a run to the byte can be trusted next to it.
    """

    def __init__(self, runs: Trials, *, exact: bool):
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
        if self._misses_at[0] != len(self.runs.done):
            self._misses_at = (len(self.runs.done), self._find_misses())
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
        m = self.runs.done[b].measurement
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
        peak = self.runs.done[s].peak_bytes
        return 0 if peak is None else peak - curve.peak(s)

    def at(self, batch: int) -> int | None:
        """The estimated peak at ``batch``: measured when it ran there, else from the curve around it."""
        done = self.runs.done.get(batch)
        if done is not None and done.peak_bytes is not None:
            return done.peak_bytes
        curve = self.curve(batch)
        return None if curve is None else curve.peak(batch) + self.shift(curve, batch)


def search_estimate(runs: Trials, curve: EstimateCurve, usable: int, max_batch: int) -> tuple[int, str | None]:
    """The largest size that fits by the estimate, micro-batches 2 and 3 having run and fitted; and a note
    when the lines through them were wrong about it."""

    def near(lo: int, hi: int) -> int:
        ran = [b for b in (lo, hi) if runs.done.get(b) is not None and runs.done[b].peak_bytes is not None]
        return min(ran, key=lambda b: abs(usable - (runs.done[b].peak_bytes or 0)), default=lo)

    def guess(lo: int, hi: int) -> int | None:
        around = near(lo, hi)
        c = curve.curve(around)
        return None if c is None else c.max_fitting(usable - curve.shift(c, around), limit=max_batch)

    def settled(lo: int, hi: int) -> bool:
        if not (lo in runs.done and curve.exact()):
            return False
        after = curve.at(lo + 1)
        return after is not None and after > usable

    first_guess = guess(3, max_batch + 1)
    found = search_max(runs.fits, low=3, high=max_batch, guess=guess, guesses=GUESSES, settled=settled)
    if first_guess is None or first_guess == found:
        return found, None
    at_guess = runs.done.get(first_guess)
    there = "" if at_guess is None or at_guess.peak_bytes is None else \
        f" where the estimate peaks at {format_bytes(at_guess.peak_bytes)}"
    how = ("memory grows faster than linearly in the batch (a curve that bends), so the estimate was fitted "
           "through three sizes" if curve.bends() else "the lines did not hold there")
    return found, (f"the lines through micro-batches 2 and 3 predicted max micro-batch {first_guess}{there}; "
                   f"{how}, and evaluated at {len(runs.done)} sizes the estimate fits {found}")
