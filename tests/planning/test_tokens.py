"""Token budgets: every step exactly the target's tokens (or the closest whole samples, stated), micro-batches
filled in order to at most the micro-batch's tokens, every token of the data counted once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.errors import PlanError
from autotune.planning.tokens import plan_tokens

LENGTHS = st.lists(st.integers(1, 60), min_size=1, max_size=80)


def _stream(plan) -> list[tuple[int, int]]:
    """(sample, token) of every token the plan's steps hold, in order."""
    return [(p.sample, p.start + t) for s in plan.steps for m in s.micro_batches for p in m for t in range(p.tokens)]


def _pieces_of(pieces) -> dict[int, list]:
    out: dict[int, list] = {}
    for p in pieces:
        out.setdefault(p.sample, []).append(p)
    return out


def _fewest_in_order(sizes: list[int], cap: int) -> int:
    """The fewest micro-batches of at most ``cap`` that ``sizes`` split into in order (by dynamic programming)."""
    best = [0] + [len(sizes) + 1] * len(sizes)
    for end in range(1, len(sizes) + 1):
        total = 0
        for start in range(end - 1, -1, -1):
            total += sizes[start]
            if total > cap:
                break
            best[end] = min(best[end], best[start] + 1)
    return best[-1]


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(1, 300), st.integers(1, 120))
def test_cut_steps_hold_exactly_the_target(lengths, target, micro):
    plan = plan_tokens(lengths, target, micro, cut=True)
    assert plan.exact and all(s.tokens == target for s in plan.steps)
    assert len(plan.steps) == sum(lengths) // target and plan.left_over == sum(lengths) % target
    # every token of the data, in order, once (up to the left-over tail)
    assert _stream(plan) == [(i, t) for i, n in enumerate(lengths) for t in range(n)][:len(plan.steps) * target]
    for step in plan.steps:
        assert max(step.micro_tokens) <= micro
        pieces = [p for m in step.micro_batches for p in m]
        # a sample is cut within a step only where it is longer than a micro-batch, and then no more micro-batches
        # than its whole pieces cut into micro-batch-sized chunks would take
        whole = _pieces_of(pieces)
        assert all(len(parts) == 1 for parts in whole.values() if sum(p.tokens for p in parts) <= micro)
        chunks = [min(micro, n - s) for parts in whole.values() for n in [sum(p.tokens for p in parts)]
                  for s in range(0, n, micro)]
        assert len(step.micro_batches) <= _fewest_in_order(chunks, micro)


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(1, 300), st.integers(60, 120))
def test_whole_samples_come_closest_to_the_target(lengths, target, micro):
    plan = plan_tokens(lengths, target, micro)
    first = 0
    for step in plan.steps:
        pieces = [p for m in step.micro_batches for p in m]
        assert [(p.sample, p.start, p.tokens) for p in pieces] == [
            (i, 0, lengths[i]) for i in range(first, first + len(pieces))]  # whole samples, in order
        # no other end of the step, after the same first sample, comes closer to the target
        ends = [sum(lengths[first:end]) for end in range(first + 1, len(lengths) + 1)]
        assert abs(step.tokens - target) == min(abs(e - target) for e in ends)
        assert len(step.micro_batches) == _fewest_in_order([p.tokens for p in pieces], micro)
        assert max(step.micro_tokens) <= micro
        first += len(pieces)
    assert plan.left_over == sum(lengths[first:]) < target
    assert plan.largest_miss == max((abs(s.tokens - target) for s in plan.steps), default=0)


def test_whole_samples_state_how_far_a_step_is_from_the_target():
    plan = plan_tokens([300, 500, 400, 200, 600, 100], 1000, 800)
    # 800 or 1200 (a tie: the step ends before), then 600 or 1200 (1200 is closer); 100 left over
    assert [s.tokens for s in plan.steps] == [800, 1200] and plan.left_over == 100
    assert plan.largest_miss == 200 and not plan.exact
    assert "steps hold 800..1200 tokens, the closest to the target 1000 (off by at most 200)" in plan.note()
    assert plan.to_dict()["steps"][1] == {"tokens": 1200, "samples": 3, "micro_batches": [600, 600]}


def test_cut_plan_is_exact_and_says_so():
    plan = plan_tokens([300, 500, 400, 200, 600, 100], 1000, 800, cut=True)
    assert [s.tokens for s in plan.steps] == [1000, 1000] and plan.left_over == 100
    assert plan.note().startswith("every step holds exactly 1000 tokens (samples cut at step boundaries)")
    assert "100 tokens at the end make no whole step" in plan.note()
    assert plan.to_dict()["target_tokens"] == 1000


def test_a_sample_longer_than_a_micro_batch_needs_cut():
    with pytest.raises(PlanError, match=r"a sample of 900 tokens is more than a micro-batch holds \(800 tokens\): "
                                        r"give cut=True"):
        plan_tokens([100, 900], 1000, 800)
    assert plan_tokens([100, 900], 1000, 800, cut=True).steps[0].micro_tokens == [800, 200]  # 100 + 700, then 200


@pytest.mark.parametrize("target,micro", [(0, 10), (10, 0), (True, 10), (2.5, 10)])
def test_budgets_must_be_whole_tokens(target, micro):
    with pytest.raises(PlanError, match="must be a whole number of tokens, at least 1"):
        plan_tokens([5], target, micro)
