"""Test helpers shared by several test files."""

from __future__ import annotations

from autotune.fitrule import run_trial


def true_max(workload, device, usable: int, high: int) -> tuple[int, int]:
    """The largest micro-batch that fits by exhaustive real bisection under the fit rule.

    Every step measures the fit rule for real (capacity not enforced, so nothing
    is skipped); returns (max, real runs it took).
    """
    runs = 0

    def fits(b: int) -> bool:
        nonlocal runs
        runs += 1
        trial = run_trial(device, workload, b, usable, source="real", capacity_guard=False)
        return trial.fits

    lo, hi = 0, high + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, runs
