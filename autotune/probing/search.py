"""The search for the largest micro-batch that fits, as plain functions of ``fits(b)``.

No torch here. Three pieces:

- :class:`PeakCurve`: from the fit rule's live-bytes timeline at two batch sizes,
  every point of the timeline is an affine function of the batch size (each
  storage's size is), so the peak at any size is the maximum of those lines:
  piecewise linear, set by the optimizer step at small sizes and by
  activations at large ones. From three sizes every point is a quadratic in the
  batch size, so memory that grows with B x B (a similarity of every sample with
  every other) comes out exact too. It predicts the largest size that fits.
- :class:`Correction`: what real runs measured against a prediction, as a
  function of the batch size, and how far it may be off.
- :func:`search_max`: the bracketed search, guided by a guess and safeguarded by
  bisection, so a good guess costs two trials (the guess fits, one more does
  not), or one when the caller can tell that one more would not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


class PeakCurve:
    """Peak bytes as a function of batch size: ``max_t(a_t + c_t * b + q_t * b * b)``.

    Fitted through the timelines at two sizes (``q_t`` = 0: lines) or three
    (each point a quadratic through its three values).
    """

    def __init__(self, runs: Mapping[int, Sequence[int]]):
        sizes = sorted(runs)
        lengths = {len(runs[b]) for b in sizes}
        if len(sizes) not in (2, 3) or len(lengths) != 1 or 0 in lengths:
            raise ValueError("two or three timelines of equal, non-zero length at different batch sizes are needed")
        b = [float(s) for s in sizes]
        t = [np.asarray(runs[s], dtype=np.float64) for s in sizes]
        slope = (t[1] - t[0]) / (b[1] - b[0])
        q = np.zeros_like(slope)
        if len(sizes) == 3:
            q = ((t[2] - t[1]) / (b[2] - b[1]) - slope) / (b[2] - b[0])
            q[np.abs(q) * b[2] * b[2] < 0.5] = 0.0  # rounding, not a bend: under half a byte at the largest size
        # Newton's form t0 + slope (b - b0) + q (b - b0)(b - b1), as a + c b + q b^2.
        self.a = t[0] - slope * b[0] + q * b[0] * b[1]
        self.c = slope - q * (b[0] + b[1])
        self.q = q
        self.sizes = tuple(sizes)
        if not self.bends:
            self._keep_upper_lines()

    def _keep_upper_lines(self) -> None:
        """Only the upper envelope of lines matters; drop dominated ones to keep evaluation cheap."""
        order = np.lexsort((-self.a, self.c))
        keep = np.ones(len(order), dtype=bool)
        best_a = -np.inf
        for i in range(len(order) - 1, -1, -1):  # by slope, highest first
            if self.a[order[i]] <= best_a:
                keep[i] = False
            else:
                best_a = self.a[order[i]]
        self.a, self.c, self.q = self.a[order[keep]], self.c[order[keep]], self.q[order[keep]]

    @classmethod
    def try_fit(cls, runs: Mapping[int, Sequence[int]]) -> PeakCurve | None:
        """The curve, or None when the runs did not take the same steps."""
        try:
            return cls(runs)
        except ValueError:
            return None

    @property
    def bends(self) -> bool:
        """Does some point of the timeline grow faster than linearly in the batch size?"""
        return bool(np.any(self.q != 0))

    def peak(self, batch: int) -> int:
        return int(round(float(np.max(self.a + (self.c + self.q * batch) * batch))))

    def max_fitting(self, usable: int, *, limit: int) -> int:
        """Largest batch in [0, limit] whose predicted peak is at most ``usable`` (and at every size below)."""
        if self.peak(1) > usable:
            return 0
        a, c, q = self.a - usable, self.c, self.q  # each point fits while a + c b + q b^2 <= 0
        bound = np.full(len(a), np.inf)
        line = (q == 0) & (c > 0)
        bound[line] = -a[line] / c[line]
        with np.errstate(invalid="ignore", divide="ignore"):
            root = np.sqrt(np.maximum(c * c - 4 * q * a, 0.0))
            up = q > 0  # the larger root: it fits at 1, so 1 lies between the roots
            bound[up] = (-c[up] + root[up]) / (2 * q[up])
            # Opening downwards: it stops fitting at the smaller root when its top is over the line past 1.
            down = (q < 0) & (-c / (2 * q) > 1) & (a - c * c / (4 * q) > 0)
            bound[down] = (-c[down] + root[down]) / (2 * q[down])
        lowest = float(bound.min())
        return limit if lowest == np.inf else int(max(0, min(limit, np.floor(lowest + 1e-9))))

    def lines(self) -> list[tuple[float, float]]:
        """(intercept, slope) of every line that can be the maximum; none when the curve bends."""
        return [] if self.bends else [(float(a), float(c)) for a, c in zip(self.a, self.c)]

    def rises(self) -> bool:
        """Does memory grow with the batch size anywhere on the curve?"""
        return bool(np.any((self.c > 0) | (self.q > 0)))

    def points(self, upto: int, count: int = 48) -> list[tuple[int, int]]:
        """(batch, predicted peak) at ``count`` sizes from 1 to ``upto``."""
        sizes = sorted({max(1, int(round(x))) for x in np.linspace(1, max(1, upto), count)})
        return [(b, self.peak(b)) for b in sizes]


@dataclass(frozen=True)
class Correction:
    """Real peak minus predicted peak, as a function of the batch size, fitted on real runs.

    ``anchors``: (batch, real - predicted) of one or two real runs. Through two,
    the line through them. From one, ``d`` at ``b1``: somewhere between the
    constant ``d`` (memory the prediction misses whatever the batch) and
    ``d * b / b1`` (a share of every sample's): the middle of the two, give or
    take half their difference. ``rate``: bytes the previous correction was off
    by per sample it reached past its nearest anchor, added to the spread the
    same way (0 until a correction has been checked by a real run).
    """

    anchors: tuple[tuple[int, float], ...] = ()
    rate: float = 0.0

    def __post_init__(self) -> None:
        if len(self.anchors) > 2 or len({b for b, _ in self.anchors}) != len(self.anchors):
            raise ValueError(f"a correction rests on at most two real runs at different sizes, got {self.anchors}")
        if self.rate < 0:
            raise ValueError(f"rate must be >= 0, got {self.rate}")

    def at(self, batch: int) -> float:
        if not self.anchors:
            return 0.0
        if len(self.anchors) == 1:
            (b1, d1), = self.anchors
            return d1 * (1 + (batch - b1) / (2 * b1))
        (b1, d1), (b2, d2) = self.anchors
        return d1 + (d2 - d1) * (batch - b1) / (b2 - b1)

    def spread(self, batch: int) -> float:
        """How far the real peak at ``batch`` may be from the prediction plus :meth:`at`."""
        if not self.anchors:
            return 0.0
        reach = min(abs(batch - b) for b, _ in self.anchors)
        if len(self.anchors) == 1:
            (b1, d1), = self.anchors
            return abs(d1) * reach / (2 * b1) + self.rate * reach
        return self.rate * reach

    def reach(self, batch: int) -> int:
        """Samples from ``batch`` to the nearest anchor."""
        return min((abs(batch - b) for b, _ in self.anchors), default=batch)


def search_max(fits: Callable[[int], bool], *, low: int, high: int,
               guess: Callable[[int, int], int | None] | None = None, guesses: int = 4, growth: int | None = None,
               high_fails: bool = False, settled: Callable[[int, int], bool] | None = None,
               split: Callable[[int, int], int] | None = None) -> int:
    """Largest ``b`` in ``[low, high]`` with ``fits(b)``, assuming fits is monotone.

    ``low`` is known to fit (0 when nothing is known, then the answer may be 0).
    ``guess(lo, hi)`` proposes the answer inside the open bracket ``(lo, hi)``,
    where ``lo`` is the largest size known to fit and ``hi`` the smallest known
    not to (``high + 1`` stands for "past the limit"); it is asked again after
    every trial, so it can learn from them, and may answer None (no guess yet:
    the plain step is taken and no guess is spent). A right guess costs two trials (it
    fits, one more does not). After ``guesses`` guessed trials the search doubles
    while no size is known not to fit and bisects otherwise, so a useless guess
    costs at most ``guesses`` trials more than plain search.

    ``high_fails``: ``high + 1`` is known not to fit (it was tried).

    ``settled(lo, hi)``: the caller knows, without a trial, that ``lo + 1`` does
    not fit; asked before every trial once ``lo`` fits. A right guess then costs one trial.

    ``growth``: while no size is known not to fit, never try more than
    ``growth`` times the largest size known to fit (1 when none is), whatever
    the guess says: a search that cannot trust its guesses climbs 1, 2, 4, ...
    A guess overruled that way does not count as one of the ``guesses``.

    ``split(lo, hi)``: where to bisect a bracket with both ends known (default the
    middle; a search whose misses cost more than its trials may split lower).
    """
    if low < 0 or high < low:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    lo, hi = low, high + 1
    known = high_fails  # hi is a size known not to fit, not just past the limit
    left = guesses if guess is not None else 0
    while hi - lo > 1:
        if settled is not None and lo > 0 and settled(lo, hi):
            break
        guessed = guess(lo, hi) if left and guess is not None else None
        if guessed is not None:
            left -= 1
            b = min(max(int(guessed), lo + 1), hi - 1)
        elif not known and lo > 0:
            b = max(lo + 1, min(2 * lo, hi - 1))
        else:
            b = split(lo, hi) if split is not None and known and lo > 0 else (lo + hi) // 2
            b = min(max(b, lo + 1), hi - 1)
        if growth is not None and not known and b > max(lo + 1, growth * lo):
            b = max(lo + 1, growth * lo)
            left += guessed is not None  # the guess was overruled, not tried
        if fits(b):
            lo = b
        else:
            hi, known = b, True
    return lo
