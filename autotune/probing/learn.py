"""Learning from real runs: the probe's steps 3 and 4.

A real peak is a measurement. The real peak expected at a size is a base (the
estimate; where there is none, the peak curve through two real runs' own
timelines of live bytes) plus a :class:`~autotune.probing.search.Correction`
fitted on what the real runs measured against that base: through the two real
runs nearest the answer, with a spread that says how far it may be off. Each
real run goes to the largest size whose expected peak, spread included, fits
the usable memory (on the device alone, with no estimate: where the expected
peak meets it); the search ends where a real run fits and the next size is
expected not to, spread included (on the device alone, also by more than the
last real run was off from its expectation: samples that hold different
amounts of memory make a close curve no proof for the next one).

An out-of-memory error gives no peak, only "more than the capacity": it bounds
the bracket and the correction's error. With no real peak at all (the
estimate's max ran out of memory), one real run at the smallest size where the
estimate's peak grows with the batch measures how far off the estimate is. While
some size ran out of memory where the expectation, spread included, says it
would not, the next real run is at most the geometric mean of the largest size
that fitted and the smallest that did not. While the real runs show no memory
rising with the batch, a run is at most twice the largest size that fitted; a
line through two real peaks whose runs took different steps (no per-point
curve), not yet checked by a third run, is followed half way when it reaches
far past them. When two real runs in a row have not halved the bracket, the
next one does. Real
runs raise the device's own out-of-memory error at its capacity, so none takes
more memory than the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..errors import WorkloadError
from ..results.probe import ProbeResult
from ..units import format_bytes
from .estimates import EstimateCurve
from .search import Correction, PeakCurve, search_max
from .trials import TrialRunner

#: Guessed real runs before the search falls back to doubling and (geometric) bisection.
GUESSES = 8
#: A line through two real peaks (no per-point curve) is followed only half way when it reaches further
#: past them than this many times the distance between them.
LINE_REACH = 4
#: The calibration run: the smallest size where the estimate's peak has risen by this share above its
#: peak at the smallest size it ran (so the real peak there shows memory that grows with the batch).
CALIBRATION_RISE = 0.1
#: While the real runs show no memory rising with the batch, no run is more than this many times the
#: largest size that fitted.
GROWTH = 2
#: Relative difference between estimated and real peak worth a note.
MISMATCH_NOTE = 0.01

Base = Callable[[int], "int | None"]


def anchors(sizes: list[int], lo: int, hi: int) -> list[int]:
    """The (at most two) real runs a correction rests on: the largest that fitted (else the one nearest
    it), and the smallest that did not fit when it measured a peak, else the run farthest from the first
    (a long baseline)."""
    if not sizes:
        return []
    first = lo if lo in sizes else hi if hi in sizes else min(sizes, key=lambda b: (abs(b - lo), -b))
    rest = [b for b in sizes if b != first]
    if not rest:
        return [first]
    second = hi if hi in rest else max(rest, key=lambda b: (abs(b - first), b))
    return sorted((first, second))


def correction(peaks: dict[int, int], estimate: Base, lo: int, hi: int, rate: float = 0.0) -> Correction:
    """Real peaks minus the estimate, through the real runs nearest the bracket (lo, hi) (see :func:`anchors`)."""
    diffs = {b: p - e for b, p in peaks.items() if (e := estimate(b)) is not None}
    return Correction(tuple((b, float(diffs[b])) for b in anchors(list(diffs), lo, hi)), rate)


def expected_peak(result: ProbeResult, batch: int) -> int | None:
    """The real peak ``result``'s runs lead to expect at ``batch``: its estimate corrected by its real peaks
    (None where it has no estimate there). What a confirm run of a stored result checks one more against."""
    estimate = result.predicted_peak_at(batch)
    if estimate is None:
        return None
    real = [t for t in result.trials if t.source == "real"]
    peaks = {t.batch: t.peak_bytes for t in real if t.peak_bytes is not None}
    lo = max((t.batch for t in real if t.fits), default=0)
    hi = min((t.batch for t in real if not t.fits), default=result.max_batch + 1)
    return int(round(estimate + correction(peaks, result.predicted_peak_at, lo, hi).at(batch)))


class Learner:
    """The real search's model: expected real peaks, the next size to run, and when to stop.

    ``estimate``: the estimate as a function of the batch size (None: the
    workload cannot be estimated, and real runs' own timelines give the base).
    """

    def __init__(self, real: TrialRunner, usable: int, capacity: int, max_batch: int,
                 estimate: EstimateCurve | None = None):
        self.real, self.usable, self.capacity, self.max_batch = real, usable, capacity, max_batch
        self.estimate = estimate
        self.rate = 0.0  # what the last checked correction missed beyond its spread, per sample past its anchors
        self.missed = 0.0  # bytes the last checked expectation was off by
        self._curves: dict[tuple[int, ...], PeakCurve | None] = {}
        self._widths: list[int] = []  # the bracket's width at every guess

    def bracket(self) -> tuple[int, int]:
        """(largest size that fitted for real or 0, smallest that did not or max_batch + 1)."""
        fit = [b for b, a in self.real.by_size.items() if a.fits]
        miss = [b for b, a in self.real.by_size.items() if not a.fits]
        return max(fit, default=0), min(miss, default=self.max_batch + 1)

    def model(self, lo: int, hi: int) -> tuple[Base, Correction, bool]:
        """The base, its correction by the real peaks for the bracket (lo, hi), and whether memory rises."""
        peaks = self.real.peaks()
        if self.estimate is not None:
            return self.estimate.at, correction(peaks, self.estimate.at, lo, hi, self.rate), True
        chosen = anchors(list(peaks), lo, hi)
        curve = self._real_curve(tuple(chosen))
        base: Base = curve.peak if curve is not None else (lambda b: 0)
        fitted = Correction(tuple((b, float(peaks[b] - (base(b) or 0))) for b in chosen), self.rate)
        if curve is not None:
            return base, fitted, curve.rises()
        return base, fitted, len(chosen) == 2 and peaks[chosen[1]] > peaks[chosen[0]]

    def _real_curve(self, sizes: tuple[int, ...]) -> PeakCurve | None:
        """The peak curve through real runs' timelines (None unless two runs took the same steps)."""
        if sizes not in self._curves:
            runs = self.real.timelines()
            fitted = None
            if len(sizes) == 2 and all(b in runs for b in sizes):
                fitted = PeakCurve.try_fit({b: runs[b] for b in sizes})
            self._curves[sizes] = fitted
        return self._curves[sizes]

    def expect(self, batch: int) -> tuple[float, float] | None:
        """(expected real peak, spread) at ``batch``, or None without a base there."""
        base, fitted, _ = self.model(*self.bracket())
        value = base(batch)
        return None if value is None else (value + fitted.at(batch), fitted.spread(batch))

    def fits(self, batch: int) -> bool:
        """A real run at ``batch``; what it measured against the expectation sets how far the next may be off."""
        before = self.expect(batch)
        _, fitted, _ = self.model(*self.bracket())
        measured = self.real(batch)
        if before is None or not fitted.anchors:  # the estimate alone: the calibration run answers it
            return measured.fits
        expected, spread = before
        reach = max(1, fitted.reach(batch))
        if measured.peak_bytes is not None:
            self.missed = abs(measured.peak_bytes - expected)
            self.rate = max(0.0, self.missed - spread) / reach
        else:  # more than the capacity: the expectation was off by at least that much
            self.missed = max(0.0, self.capacity - expected)
            self.rate = max(0.0, self.capacity - expected - spread) / reach
        return measured.fits

    def _contradicted(self) -> bool:
        """Did a real run run out of memory where the expectation, spread included, is within the capacity?"""
        for b, measured in self.real.by_size.items():
            expected = self.expect(b) if measured.oom else None
            if expected is not None and expected[0] + expected[1] <= self.capacity:
                return True
        return False

    def _evaluate(self, batch: int) -> bool:
        """Evaluate the estimate at ``batch`` unless it ran there or its lines are exact; True when it ran."""
        if self.estimate is None or batch in self.estimate.runs.by_size or self.estimate.exact() \
                or not 1 <= batch <= self.max_batch:
            return False
        try:
            self.estimate.runs(batch)
        except WorkloadError:  # the estimate cannot run this size: its curve stands in
            return False
        return True

    def _predicted_max(self, lo: int, hi: int) -> tuple[int, bool]:
        """The next size to run in (lo, hi), and whether memory rises with the batch.

        Where the expected peak, spread included, fits the usable memory; but at least half way from ``lo``
        to where the expected peak alone meets it (between two real peaks on either side of the line: there),
        and never where the spread could take the run past the capacity (an out-of-memory error costs more
        than a run that peaks over the usable memory). On the device alone (no estimate), where the expected
        peak meets the usable memory: the curve through two real runs' timelines is exact where every sample
        holds the same memory, and its spread is only what the last one missed by, so a run short of the
        point costs a run for sure where one at the point, over the usable memory, brackets the answer."""
        base, fitted, rises = self.model(lo, hi)
        peaks = self.real.peaks()

        def largest(limit: float, spread: bool) -> int:
            def within(b: int) -> bool:
                value = base(b)
                return value is not None and value + fitted.at(b) + (fitted.spread(b) if spread else 0) <= limit

            return search_max(within, low=lo, high=hi - 1)  # arithmetic, no trials

        point = largest(self.usable, spread=False)
        if self.estimate is None or (lo in peaks and hi in peaks):
            careful = point
        else:
            careful = max(largest(self.usable, spread=True), lo + (point - lo) // 2)
        return min(careful, largest(self.capacity, spread=True)), rises

    def calibration(self, hi: int) -> int | None:
        """With no real peak yet: the smallest size below ``hi`` where the estimate's peak has risen by
        :data:`CALIBRATION_RISE` above its peak at the smallest size it ran, else that smallest size."""
        estimate = self.estimate
        if estimate is None or not estimate.runs.by_size or min(estimate.runs.by_size) >= hi:
            return None
        smallest = min(estimate.runs.by_size)
        floor = estimate.at(smallest) or 0

        def flat(b: int) -> bool:
            value = estimate.at(b)
            return value is None or value < floor * (1 + CALIBRATION_RISE)

        rises_at = search_max(flat, low=smallest, high=hi - 1) + 1  # arithmetic on the curve
        return rises_at if rises_at < hi else smallest

    def guess(self, lo: int, hi: int) -> int | None:
        """The next real run: where the expected peak, spread included, meets the usable memory."""
        if not self.real.peaks():
            return self.calibration(hi)
        self._widths.append(hi - lo)
        if len(self._widths) > 2 and hi <= self.max_batch and 2 * (hi - lo) > self._widths[-3]:
            # Two runs did not halve the bracket (memory moving in steps, or noise): halve it.
            return (lo + hi) // 2 if hi in self.real.peaks() else _geometric(lo, hi)
        found, rises = self._predicted_max(lo, hi)
        for _ in range(3):  # the estimate evaluated there may move it
            if not self._evaluate(max(found, lo + 1)):
                break
            found, rises = self._predicted_max(lo, hi)
        if lo > 0 and hi <= self.max_batch and self._contradicted():
            found = min(found, _geometric(lo, hi))
        if not rises and lo > 0:
            found = min(found, GROWTH * lo)
        peaks = self.real.peaks()
        if self.estimate is None and len(peaks) == 2 and self._real_curve(tuple(peaks)) is None:
            # Only a line through two peaks whose runs took different steps, unchecked: half way when that
            # is far past the two (more than LINE_REACH times the distance between them).
            baseline = max(peaks) - min(peaks)
            if found - lo > LINE_REACH * baseline:
                found = lo + (found - lo) // 2
        return found

    def settled(self, lo: int, hi: int) -> bool:
        """Is ``lo + 1`` expected not to fit, spread included (``lo`` having fitted for real)?

        On the device alone, also by more than the last real run's peak was off from its expectation: where
        samples hold different amounts of memory (routing that depends on the data), a curve that came close
        at the last run is no proof that the next sample holds what the curve says."""
        if lo not in self.real.peaks() or lo + 1 >= hi:
            return False
        self._evaluate(lo + 1)
        expected = self.expect(lo + 1)
        if expected is None:
            return False
        spread = expected[1] if self.estimate is not None else max(expected[1], self.missed)
        return expected[0] - spread > self.usable


def confirm(real: TrialRunner, estimate: EstimateCurve, m: int, usable: int, capacity: int,
            max_batch: int) -> tuple[int, str | None]:
    """The real maximum, starting with one real run at the estimate's ``m``; and a note when the
    estimate was off (and what the search did about it)."""
    learner = Learner(real, usable, capacity, max_batch, estimate)
    fitted = learner.fits(m)
    if fitted and (m == max_batch or learner.settled(m, max_batch + 1)):
        return m, _mismatch(real, estimate, m)
    low, high = (m, max_batch) if fitted else (0, m - 1)
    found = search_max(learner.fits, low=low, high=high, guess=learner.guess, guesses=GUESSES,
                       settled=learner.settled, high_fails=not fitted, split=_geometric)
    first = real.by_size[m]
    predicted = estimate.at(m)
    if first.oom:
        head = (f"the estimate under-counted: micro-batch {m} ran out of memory on the real device, estimated "
                f"peak {format_bytes(predicted)}")
        after = [t for t in real.log if t.source == "real"][1:2]
        calibrated = after[0] if after and after[0].peak_bytes is not None else None
        if calibrated is not None and (at := estimate.at(calibrated.batch)):
            head += (f"; a real run at micro-batch {calibrated.batch}, where the estimate starts to grow with the "
                     f"batch, measured {format_bytes(calibrated.peak_bytes)} against {format_bytes(at)} estimated")
    else:
        assert first.peak_bytes is not None and predicted
        error = (first.peak_bytes - predicted) / predicted
        head = (f"the estimate {'under' if error > 0 else 'over'}-counted by {abs(error):.1%}: real peak "
                f"{format_bytes(first.peak_bytes)} vs estimated {format_bytes(predicted)} at micro-batch {m} "
                f"({'room to spare' if fitted else 'does not fit'})")
    return found, (f"{head}; searched on the real device, each run where the estimate corrected by the real "
                   f"peaks so far meets the usable memory: {_runs(real)}; max micro-batch {found} in "
                   f"{len(real.by_size)} real runs ({real.misses()} did not fit), the estimate said {m}")


def search_device(real: TrialRunner, usable: int, capacity: int, max_batch: int, why: str) -> tuple[int, str]:
    """The real maximum of a workload the estimate cannot size (``why``), from real runs alone; and the
    note that says how it was found."""
    learner = Learner(real, usable, capacity, max_batch)
    if not learner.fits(1):
        found = 0
    elif max_batch == 1 or not learner.fits(2):
        found = 1
    else:
        found = search_max(learner.fits, low=2, high=max_batch, guess=learner.guess, guesses=GUESSES,
                           settled=learner.settled, split=_geometric)
    return found, (f"{why}; searched on the real device: micro-batches 1 and 2 gave a peak curve from the live "
                   "bytes they measured, and each later run went where the curve through the real runs nearest "
                   f"the answer meets the usable memory: {_runs(real)}; max micro-batch {found} in "
                   f"{len(real.by_size)} real runs ({real.misses()} did not fit)")


def _geometric(lo: int, hi: int) -> int:
    """Between a size that fitted and one that did not: their geometric mean, rounded up (a miss costs more
    than a run)."""
    return math.isqrt(lo * hi - 1) + 1


def _runs(real: TrialRunner) -> str:
    """The real runs in order, in words."""
    said = []
    for t in real.log:
        if t.source != "real":
            continue
        what = "out of memory" if t.oom else format_bytes(t.peak_bytes) + ("" if t.fits else " (over)")
        said.append(f"{t.batch}: {what}")
    return ", ".join(said)


def _mismatch(real: TrialRunner, estimate: EstimateCurve, m: int) -> str | None:
    """A note when the one real run's peak differs from the estimate's by more than :data:`MISMATCH_NOTE`."""
    peak, predicted = real.by_size[m].peak_bytes, estimate.at(m)
    if peak is None or not predicted or abs(peak - predicted) < MISMATCH_NOTE * predicted:
        return None
    error = (peak - predicted) / predicted
    return (f"the estimate {'under' if error > 0 else 'over'}-counted by {abs(error):.1%}: real peak "
            f"{format_bytes(peak)} vs estimated {format_bytes(predicted)} at micro-batch {m}")
