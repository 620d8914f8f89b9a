"""The search logic and the peak curve, as plain arithmetic."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.probing.search import PeakCurve, search_max


def oracle(threshold: int):
    calls = []

    def fits(b: int) -> bool:
        calls.append(b)
        return b <= threshold

    return fits, calls


@pytest.mark.parametrize("threshold,high", [(0, 10), (1, 10), (7, 10), (10, 10), (300, 4096), (4095, 4096)])
def test_perfect_guess_costs_two_trials(threshold, high):
    fits, calls = oracle(threshold)
    assert search_max(fits, low=0, high=high, guess=lambda lo, hi: threshold) == threshold
    assert len(calls) <= 2


@pytest.mark.parametrize("threshold,high", [(0, 1), (1, 1), (5, 100), (99, 100), (1000, 65536), (65536, 65536)])
def test_without_guess_it_bisects(threshold, high):
    fits, calls = oracle(threshold)
    assert search_max(fits, low=0, high=high) == threshold
    assert len(calls) <= math.ceil(math.log2(high + 1)) + 1


@given(threshold=st.integers(0, 5000), high=st.integers(1, 5000), bad=st.integers(-10, 10000))
@settings(max_examples=300, deadline=None)
def test_any_guess_finds_the_threshold_within_a_bound(threshold, high, bad):
    threshold = min(threshold, high)
    fits, calls = oracle(threshold)
    assert search_max(fits, low=0, high=high, guess=lambda lo, hi: bad) == threshold
    # A guess that never helps costs at most its four guessed trials more than plain search
    # (doubling, then bisection).
    assert len(calls) <= 4 + 2 * math.ceil(math.log2(high + 1)) + 1


def test_known_low_is_not_tried_again():
    fits, calls = oracle(40)
    assert search_max(fits, low=40, high=100, guess=lambda lo, hi: 40) == 40
    assert calls == [41]


def test_bad_bracket_is_rejected():
    with pytest.raises(ValueError, match="low"):
        search_max(lambda b: True, low=5, high=3)


def test_peak_curve_is_the_max_of_lines():
    # Two points in time: the optimizer step (flat, 1000 bytes) and activations (100 + 10 b).
    t2 = [1000, 120]
    t3 = [1000, 130]
    curve = PeakCurve(2, t2, 3, t3)
    assert curve.peak(1) == 1000 and curve.peak(90) == 1000 and curve.peak(91) == 1010
    assert curve.max_fitting(1000, limit=10_000) == 90
    assert curve.max_fitting(999, limit=10_000) == 0
    assert curve.max_fitting(10**9, limit=500) == 500
    assert dict(curve.points(200, count=5))[200] == 2100


def test_peak_curve_needs_matching_timelines():
    assert PeakCurve.try_fit(2, [1, 2, 3], 3, [1, 2]) is None
    assert PeakCurve.try_fit(2, [1, 2], 2, [1, 2]) is None
