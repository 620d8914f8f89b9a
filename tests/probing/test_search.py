"""The search logic and the peak curve, as plain arithmetic."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.probing.search import Correction, PeakCurve, search_max

from .synthetic import estimate_max, true_max


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
    curve = PeakCurve({2: t2, 3: t3})
    assert not curve.bends and curve.rises()
    assert curve.peak(1) == 1000 and curve.peak(90) == 1000 and curve.peak(91) == 1010
    assert curve.max_fitting(1000, limit=10_000) == 90
    assert curve.max_fitting(999, limit=10_000) == 0
    assert curve.max_fitting(10**9, limit=500) == 500
    assert dict(curve.points(200, count=5))[200] == 2100


def test_peak_curve_needs_matching_timelines():
    assert PeakCurve.try_fit({2: [1, 2, 3], 3: [1, 2]}) is None
    assert PeakCurve.try_fit({2: [1, 2]}) is None
    assert PeakCurve.try_fit({2: [1, 2], 3: [1, 2], 4: [1, 2], 5: [1, 2]}) is None


def test_three_timelines_give_each_point_its_quadratic():
    # The optimizer step (flat 5000) and a B x B similarity (100 + 10 b + 3 b^2), at 2, 3 and 40.
    def line(b):
        return [5000, 100 + 10 * b + 3 * b * b]

    curve = PeakCurve({2: line(2), 3: line(3), 40: line(40)})
    assert curve.bends and curve.lines() == []  # no lines describe it
    for b in (1, 7, 39, 40, 41, 100, 1000):
        assert curve.peak(b) == max(line(b))
    assert curve.max_fitting(10_000, limit=4096) == true_max(line, 10_000, 4096) == 55
    # Through two of them, lines under-count past the second: the guess a line gives is too large.
    assert PeakCurve({2: line(2), 3: line(3)}).max_fitting(10_000, limit=4096) == 396  # 7x too large


@pytest.mark.parametrize("a,c,q,usable,expected", [
    (100, 10, 0, 1000, 90),          # a line
    (100, 0, 0, 1000, 4096),         # flat: the limit
    (100, -5, 0, 1000, 4096),        # falling
    (100, 10, 1, 1000, 25),          # 100 + 10 b + b^2 <= 1000: b <= 25.4
    (1000, 0, 0, 999, 0),            # even 1 does not fit
    (0, 200, -1, 5000, 29),          # opening downwards, over the line from 29.3 to 170.7
    (0, 20, -1, 5000, 4096),         # opening downwards, its top (100) under the line
])
def test_max_fitting_of_one_point(a, c, q, usable, expected):
    curve = PeakCurve({1: [a + c + q], 2: [a + 2 * c + 4 * q], 3: [a + 3 * c + 9 * q]})
    assert curve.max_fitting(usable, limit=4096) == expected


@pytest.mark.parametrize("anchors,rate,batch,at,spread", [
    ((), 0.0, 50, 0.0, 0.0),
    (((10, 100.0),), 0.0, 10, 100.0, 0.0),                 # at the real run: what it measured
    (((10, 100.0),), 0.0, 30, 200.0, 100.0),               # between 100 (an offset) and 300 (per sample)
    (((10, -100.0),), 0.0, 30, -200.0, 100.0),
    (((10, 100.0), (20, 300.0)), 0.0, 30, 500.0, 0.0),     # the line through two
    (((10, 100.0), (20, 300.0)), 5.0, 26, 420.0, 30.0),    # give or take what the last one missed per sample
])
def test_correction_through_real_runs(anchors, rate, batch, at, spread):
    c = Correction(anchors, rate)
    assert c.at(batch) == pytest.approx(at) and c.spread(batch) == pytest.approx(spread)


def test_correction_rejects_what_it_cannot_rest_on():
    with pytest.raises(ValueError, match="at most two"):
        Correction(((1, 0.0), (2, 0.0), (3, 0.0)))
    with pytest.raises(ValueError, match="different sizes"):
        Correction(((1, 0.0), (1, 5.0)))
    with pytest.raises(ValueError, match="rate"):
        Correction(((1, 0.0),), -1.0)


def test_settled_stops_the_search_without_the_next_trial():
    fits, calls = oracle(40)
    assert search_max(fits, low=0, high=100, guess=lambda lo, hi: 40, settled=lambda lo, hi: lo == 40) == 40
    assert calls == [40]


# -- the estimate search on curves whose answer is known ------------------------------------------

def _lines(*pairs):
    return lambda b: [a + c * b for a, c in pairs]


SHAPES = {
    # name: (timeline, usable budgets)
    "linear": (_lines((1000, 0), (100, 10)), [1_000, 5_000, 40_000]),
    # the optimizer step sets the peak at 2 and 3 (equal peaks), activations from 490 on
    "flat-then-rising": (_lines((5000, 0), (100, 10), (50, 9)), [5_000, 5_100, 9_000, 30_000]),
    # a B x B similarity on top of per-sample activations
    "quadratic": (lambda b: [5000, 200 + 40 * b, 100 + 20 * b + 2 * b * b], [10_000, 40_000, 1_000_000]),
    # the in-batch-negatives shape: (B, B, Lq, Ld) scores, a little of it, and a flat optimizer step
    "flat-then-quadratic": (lambda b: [300_000, 1_000 + 4_000 * b + 2_300 * b * b], [400_000, 22_649_241]),
}


@pytest.mark.parametrize("shape,budget", [(s, u) for s, (_, budgets) in SHAPES.items() for u in budgets])
def test_the_estimate_search_is_exact(shape, budget):
    timeline = SHAPES[shape][0]
    found, evaluations, note = estimate_max(timeline, budget)
    assert found == true_max(timeline, budget, 4096)
    bends = shape.endswith("quadratic")
    # Lines that hold: 2, 3 and their guess; a curve that bends: the answer and the next size evaluated too.
    assert evaluations <= (6 if bends else 3), evaluations
    assert (note is not None) == (bends and found != PeakCurve(
        {2: timeline(2), 3: timeline(3)}).max_fitting(budget, limit=4096))
    if note is not None:
        assert "bends" in note and f"fits {found}" in note


@pytest.mark.parametrize("shape,budget", [(s, u) for s, (_, budgets) in SHAPES.items() for u in budgets])
def test_the_estimate_search_brackets_the_answer_where_the_allocator_is_simulated(shape, budget):
    # Not an exact engine: the answer and the size above it are both evaluated, nothing is taken on trust.
    timeline = SHAPES[shape][0]
    found, evaluations, _ = estimate_max(timeline, budget, exact=False)
    assert found == true_max(timeline, budget, 4096)
    assert evaluations <= 6
