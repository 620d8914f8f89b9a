"""Test helpers shared by several test files."""

from __future__ import annotations

from autotune.probing import exhaustive_max


def true_max(workload, device, usable: int, high: int) -> tuple[int, int]:
    """The largest micro-batch that fits by exhaustive real search under the fit rule; (max, real runs)."""
    peaks: dict[int, int | None] = {}
    return exhaustive_max(workload, device, usable, high, peaks=peaks), len(peaks)
