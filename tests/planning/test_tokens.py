"""Token budgets: every step exactly the target's tokens (or the closest whole samples, stated), micro-batches
filled in order to at most the micro-batch's tokens, every token of the data counted once."""

from __future__ import annotations

import json

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


# --- target_tokens in autotune.plan and autotune plan: the wiring of the planner above ---------------------------

BUDGET = {"device": "cpu", "memory_budget": "64MiB"}


@pytest.mark.parametrize(("target", "steps_tokens", "exact"), [(60, [60], True), (64, [66], False)])
def test_the_api_plans_steps_of_the_target_tokens_from_the_workloads_tokens_per_sample(target, steps_tokens, exact):
    import autotune
    from autotune.results.plan import Plan
    from tests.workloads import tokens

    plan = autotune.plan(target_tokens=target, probe=tokens(6), **BUDGET)
    assert plan.tokens is not None and plan.target_tokens == target and plan.tokens.tokens_per_sample == 6
    assert [s.tokens for s in plan.tokens.steps] == steps_tokens and plan.tokens.exact is exact
    assert plan.target_batch == steps_tokens[0] // 6 and sum(plan.schedule[0]) == plan.target_batch
    assert plan.tokens.micro_tokens == plan.max_micro_batch * 6 and plan.tokens.note in plan.notes
    data = plan.to_dict()
    assert data["target_tokens"] == target and [s["tokens"] for s in data["tokens"]["steps"]] == steps_tokens
    assert Plan.from_dict(data) == plan


def test_given_lengths_make_steps_of_the_closest_whole_samples_or_exact_ones_cut():
    import autotune
    from tests.workloads import tokens

    lengths = [5, 7, 6, 4, 9, 3, 6]
    plan = autotune.plan(target_tokens=12, lengths=lengths, probe=tokens(9), **BUDGET)
    assert plan.tokens is not None and [s.tokens for s in plan.tokens.steps] == [12, 10, 12]
    assert "off by at most 2" in plan.tokens.note and plan.target_batch == 2
    cut = autotune.plan(target_tokens=12, lengths=lengths, cut_samples=True, probe=tokens(9), **BUDGET)
    assert cut.tokens is not None and cut.tokens.exact and [s.tokens for s in cut.tokens.steps] == [12] * 3
    assert cut.tokens.left_over == sum(lengths) - 36


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"target_batch": 8, "target_tokens": 60}, "give one of them"),
    ({"lengths": [3, 4]}, "give target_tokens too"),
    ({"target_tokens": 60, "tune": True}, "drop tune"),
    ({"target_tokens": 60, "workload": "gpt"}, "its samples hold different tokens"),
    ({"target_tokens": 100, "lengths": [3, 4]}, "less than one step of 100"),
    ({"target_tokens": 8, "lengths": [2] * 8, "world_size": 2}, "the plan is for 2 ranks"),
])
def test_a_plan_in_tokens_refuses_what_it_cannot_hold(kwargs, words):
    import autotune
    from autotune.errors import BadInput

    with pytest.raises(BadInput, match=words):
        autotune.plan(**{"device": "cpu", "memory_budget": "64MiB", **kwargs})


def test_the_cli_plans_in_tokens_refuses_both_targets_and_runs_it(capsys, tmp_path):
    from autotune.cli import main
    from tests.workloads import probe_file

    probe = str(probe_file(tmp_path, "toks", "tokens", 6))
    flags = ["--probe", probe, "--device", "cpu", "--memory-budget", "64MiB", "--quiet"]
    path = tmp_path / "plan.json"
    assert main(["plan", "--target-tokens", "60", *flags, "--json", "--output", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target_tokens"] == 60 and [s["tokens"] for s in data["tokens"]["steps"]] == [60]
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("length\n5\n7\n6\n4\n9\n3\n6\n")
    assert main(["plan", "--target-tokens", "12", "--lengths", str(lengths), "--cut-samples", *flags, "--json"]) == 0
    assert [s["tokens"] for s in json.loads(capsys.readouterr().out)["tokens"]["steps"]] == [12, 12, 12]
    for argv, words in [(["plan", "--target-tokens", "60", "--target-batch", "10", *flags],
                         "argument --target-batch: not allowed with argument --target-tokens"),
                        (["plan", "--cut-samples", "--target-batch", "10", *flags], "add --target-tokens N")]:
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and words in err and err.count("\n") == 1, err
    assert main(["run", "--plan", str(path), "--steps", "2", "--json", "--quiet"]) == 0  # every sample 6 tokens
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["verification"]["checks"]}
    assert checks["tokens"]["passed"] and checks["tokens"]["details"]["step_tokens"] == [60, 60]
