"""Memory as plain functions of the batch size, searched the way the probe searches real workloads.

A timeline function ``f(b) -> [live bytes at each point of the step]`` stands in
for the fit rule's tracker at micro-batch ``b``; :class:`SyntheticTrialRunner` serves
it through the :class:`~autotune.probing.trials.TrialRunner` interface (real ones run
out of memory past a capacity, as a device does), so the estimate search and the
real search run unchanged on curves whose answer is known exactly.
"""

from __future__ import annotations

from collections.abc import Callable

from autotune.devices.base import Measurement
from autotune.probing import learn
from autotune.probing.estimates import EstimateCurve, search_estimate
from autotune.probing.trials import TrialRunner
from autotune.results.probe import Trial

Timeline = Callable[[int], list[int]]


class SyntheticTrialRunner(TrialRunner):
    """Trials of ``timeline(b)``; with a ``capacity``, a peak past it is an out-of-memory error."""

    def __init__(self, timeline: Timeline, usable: int, source: str, log: list[Trial] | None = None,
                 capacity: int | None = None, reserve: Callable[[int], int] | None = None):
        super().__init__(None, None, usable, source, [] if log is None else log, False)  # type: ignore[arg-type]
        self.timeline, self.capacity, self.reserve = timeline, capacity, reserve

    def __call__(self, batch: int) -> Trial:
        if batch not in self.by_size:
            line = [int(x) for x in self.timeline(batch)]
            tracked = max(line)
            peak = tracked if self.reserve is None else self.reserve(tracked)  # what a caching allocator holds
            if self.capacity is not None and peak > self.capacity:
                trial = Trial(batch=batch, source=self.source, peak_bytes=None, fits=False,
                              seconds=0.0, oom=True, why="synthetic out of memory")
            else:
                trial = Trial(batch=batch, source=self.source, peak_bytes=peak, fits=peak <= self.usable, seconds=0.0,
                              measurement=Measurement(peak_bytes=peak, tracked_peak_bytes=tracked, breakdown={},
                                                      seconds=0.0, timeline=tuple(line)))
            self.by_size[batch] = trial
            self.log.append(trial)
        return self.by_size[batch]


def true_max(timeline: Timeline, usable: int, limit: int, reserve: Callable[[int], int] = int) -> int:
    """The largest size whose peak, and every smaller size's, is at most ``usable``."""
    b = 0
    while b < limit and reserve(max(timeline(b + 1))) <= usable:
        b += 1
    return b


def estimate_max(timeline: Timeline, usable: int, limit: int = 4096, *, exact: bool = True
                 ) -> tuple[int, int, str | None]:
    """The estimate search's answer, its evaluations and its note (2 and 3 fitting, as the probe requires)."""
    runs = SyntheticTrialRunner(timeline, usable, "estimate")
    assert runs.fits(2) and runs.fits(3)
    found, note = search_estimate(runs, EstimateCurve(runs, exact=exact), usable, limit)
    return found, len(runs.by_size), note


def probe_max(estimate: Timeline | None, real: Timeline, capacity: int, limit: int = 4096, margin: float = 0.1,
              reserve: Callable[[int], int] | None = None) -> tuple[int, int, int, str | None]:
    """What the probe finds on a device whose real timelines are ``real`` (out of memory past ``capacity``),
    estimated by ``estimate`` (None: not estimable): (answer, real runs, misses, note). ``reserve``: the
    peak a caching allocator holds for a live-bytes peak, on the device and in the estimate alike (the
    estimate's figures are then not exact)."""
    usable = int(capacity * (1 - margin))
    log: list[Trial] = []
    real_runs = SyntheticTrialRunner(real, usable, "real", log, capacity=capacity, reserve=reserve)
    if estimate is None:
        found, note = learn.search_device(real_runs, usable, capacity, limit, why="not estimable")
    else:
        est = SyntheticTrialRunner(estimate, usable, "estimate", log, reserve=reserve)
        curve = EstimateCurve(est, exact=reserve is None)
        assert est.fits(2) and est.fits(3)
        m, _ = search_estimate(est, curve, usable, limit)
        found, note = learn.confirm(real_runs, curve, m, usable, capacity, limit)
    return found, len(real_runs.by_size), real_runs.misses(), note
