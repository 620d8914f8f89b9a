"""The search for the largest micro-batch that fits, as plain functions of ``fits(b)``.

No torch here. Two pieces:

- :class:`PeakCurve`: from the fit rule's live-bytes timeline at two batch sizes,
  every point of the timeline is an affine function of the batch size (each
  storage's size is), so the peak at any size is the maximum of those lines:
  piecewise linear, set by the optimizer step at small sizes and by
  activations at large ones. It predicts the largest size that fits.
- :func:`search_max`: the bracketed search, guided by a guess and safeguarded by
  bisection, so a good guess costs two trials (the guess fits, one more does not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class PeakCurve:
    """Peak bytes as a function of batch size: ``max_t(a_t + c_t * b)``."""

    def __init__(self, b1: int, timeline1: Sequence[int], b2: int, timeline2: Sequence[int]):
        if b1 == b2 or len(timeline1) != len(timeline2) or not len(timeline1):
            raise ValueError("two timelines of equal, non-zero length at different batch sizes are needed")
        t1 = np.asarray(timeline1, dtype=np.float64)
        t2 = np.asarray(timeline2, dtype=np.float64)
        self.c = (t2 - t1) / (b2 - b1)
        self.a = t1 - self.c * b1
        # Only the upper envelope matters; drop dominated points to keep evaluation cheap.
        order = np.lexsort((-self.a, self.c))
        keep = np.ones(len(order), dtype=bool)
        best_a = -np.inf
        for i in range(len(order) - 1, -1, -1):  # by slope, highest first
            if self.a[order[i]] <= best_a:
                keep[i] = False
            else:
                best_a = self.a[order[i]]
        self.a, self.c = self.a[order[keep]], self.c[order[keep]]

    @classmethod
    def try_fit(cls, b1: int, timeline1: Sequence[int], b2: int, timeline2: Sequence[int]) -> PeakCurve | None:
        """The curve, or None when the two runs did not take the same steps."""
        try:
            return cls(b1, timeline1, b2, timeline2)
        except ValueError:
            return None

    def peak(self, batch: int) -> int:
        return int(round(float(np.max(self.a + self.c * batch))))

    def max_fitting(self, usable: int, *, limit: int) -> int:
        """Largest batch in [0, limit] whose predicted peak is at most ``usable``."""
        if self.peak(1) > usable:
            return 0
        rising = self.c > 0
        if not rising.any():
            return limit
        bound = np.floor((usable - self.a[rising]) / self.c[rising] + 1e-9).min()
        return int(max(0, min(limit, bound)))

    def lines(self) -> list[tuple[float, float]]:
        """(intercept, slope) of every line that can be the maximum."""
        return [(float(a), float(c)) for a, c in zip(self.a, self.c)]

    def points(self, upto: int, count: int = 48) -> list[tuple[int, int]]:
        """(batch, predicted peak) at ``count`` sizes from 1 to ``upto``."""
        sizes = sorted({max(1, int(round(x))) for x in np.linspace(1, max(1, upto), count)})
        return [(b, self.peak(b)) for b in sizes]


def search_max(fits: Callable[[int], bool], *, low: int, high: int,
               guess: Callable[[int, int], int | None] | None = None, guesses: int = 4, growth: int | None = None,
               high_fails: bool = False) -> int:
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

    ``growth``: while no size is known not to fit, never try more than
    ``growth`` times the largest size known to fit (1 when none is), whatever
    the guess says: a search that cannot trust its guesses climbs 1, 2, 4, ...
    A guess overruled that way does not count as one of the ``guesses``.
    """
    if low < 0 or high < low:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    lo, hi = low, high + 1
    known = high_fails  # hi is a size known not to fit, not just past the limit
    left = guesses if guess is not None else 0
    while hi - lo > 1:
        guessed = guess(lo, hi) if left and guess is not None else None
        if guessed is not None:
            left -= 1
            b = min(max(int(guessed), lo + 1), hi - 1)
        elif not known and lo > 0:
            b = max(lo + 1, min(2 * lo, hi - 1))
        else:
            b = (lo + hi) // 2
        if growth is not None and not known and b > max(lo + 1, growth * lo):
            b = max(lo + 1, growth * lo)
            left += guessed is not None  # the guess was overruled, not tried
        if fits(b):
            lo = b
        else:
            hi, known = b, True
    return lo
