"""A plan in tokens, run: every step feeds the planned samples' tokens (exactly the target, or the stated
closest whole samples), micro-batch by micro-batch; the gradient equals the one-pass gradient over the step's
samples, for a packed LM, a jagged model and a Hugging Face Llama packed by DataCollatorWithFlattening."""

from __future__ import annotations

import dataclasses
import json
import random
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.cli import main
from autotune.errors import BadInput
from autotune.planning.bytokens import token_steps
from autotune.training.bytokens import TokenFeed

from ..workload.batch_kinds import RUN_BUDGETS, packed_of, packed_workload
from ..workload.hf_configs import write_config

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60), st.integers(1, 200), st.integers(1, 6),
       st.booleans())
def test_every_step_fed_holds_the_target_or_the_stated_closest(lengths, target, max_micro_batch, cut):
    """Over length distributions: the batches fed (real packed rows, split as the run splits them) hold each
    step's planned tokens; with cut, exactly the target; with whole samples, no other end of the step comes
    closer to the target, and the plan's note states how far the farthest step is."""
    if sum(lengths) < target:
        return  # no whole step: refused by the planner (tested there)
    tokens = token_steps(lengths, target, max_micro_batch, cut=cut)
    feed = TokenFeed(tokens, packed_workload())
    gen = torch.Generator().manual_seed(0)
    for _ in tokens.steps:
        feed.next(gen)
    assert feed.check().passed, feed.check().message
    fed = [sum(c) for c in feed.counted]
    assert fed == [s.tokens for s in tokens.steps]
    if cut:
        assert fed == [target] * len(fed) and tokens.exact
    else:
        first = 0
        for step in tokens.steps:
            ends = [sum(lengths[first:end]) for end in range(first + 1, len(lengths) + 1)]
            assert abs(step.tokens - target) == min(abs(e - target) for e in ends)
            first += step.samples
        miss = max(abs(n - target) for n in fed)
        assert tokens.exact or f"off by at most {miss}" in tokens.note


def test_batches_that_do_not_hold_the_planned_lengths_fail_the_tokens_check():
    short = dataclasses.replace(packed_workload(), lengths_batch=lambda lengths, g: packed_of(
        [max(1, n - 1) for n in lengths], g))
    feed = TokenFeed(token_steps([5, 7, 6, 4, 9], 12, 2), short)
    feed.next(torch.Generator().manual_seed(0))
    check = feed.check()
    assert not check.passed and "step 1 fed 10 tokens in micro-batches of [10], the plan [12]" in check.message


def test_a_workload_that_cannot_build_given_lengths_is_refused_in_words():
    no_lengths = dataclasses.replace(packed_workload(), lengths_batch=None)
    with pytest.raises(BadInput, match=r"samples of 4..7 tokens and workload 'packed-lm' cannot build samples of "
                                       r"given lengths: give the workload lengths_batch="):
        TokenFeed(token_steps([5, 7, 6, 4, 9], 12, 2), no_lengths)


def _probe_file(tmp_path: Path, builder: str, *args: str) -> Path:
    path = tmp_path / f"{builder}.py"
    path.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.workload import batch_kinds

        def build():
            return batch_kinds.{builder}({", ".join(args)})
        """))
    return path


def _lengths(tmp_path: Path, low: int, high: int, count: int = 80) -> Path:
    rng = random.Random(0)
    path = tmp_path / "lengths.csv"
    path.write_text("length\n" + "\n".join(str(rng.randint(low, high)) for _ in range(count)))
    return path


def _plan_and_run(capsys, tmp_path: Path, workload: list[str], budget: str, *extra: str) -> dict:
    plan = tmp_path / "plan.json"
    assert main(["plan", *workload, "--device", "cpu", "--memory-budget", budget, "--output", str(plan),
                 "--quiet", *extra]) == 0
    capsys.readouterr()
    code = main(["run", "--plan", str(plan), "--steps", "3", "--json", "--quiet"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["passed"], [c["message"] for c in data["verification"]["checks"]]
    return data


@pytest.mark.slow
@pytest.mark.parametrize("builder,args,budget,low,high,cut", [
    ("packed_workload", ["worst=True"], RUN_BUDGETS["packed-lm"], 8, 40, False),
    ("packed_workload", ["worst=True"], RUN_BUDGETS["packed-lm"], 8, 40, True),
    ("jagged_workload", ["worst=True"], RUN_BUDGETS["jagged"], 4, 16, False),
])
def test_autotune_run_trains_a_plan_in_tokens(capsys, tmp_path, builder, args, budget, low, high, cut):
    """autotune plan --target-tokens over a length file, then autotune run --plan: the gradient check, the
    sample and item counts and every step's tokens hold."""
    probe = _probe_file(tmp_path, builder, *args)
    data = _plan_and_run(capsys, tmp_path, ["--probe", str(probe)], str(budget), "--target-tokens", "300",
                         "--lengths", str(_lengths(tmp_path, low, high)), *(["--cut-samples"] if cut else []))
    checks = {c["name"]: c for c in data["verification"]["checks"]}
    assert checks["gradient_equivalence"]["value"] < 1e-5 and checks["count"]["passed"]
    steps = [s["tokens"] for s in data["plan"]["tokens"]["steps"]]
    planned = [steps[i % len(steps)] for i in range(3)]  # past the plan's last step, from its first again
    assert checks["tokens"]["passed"] and checks["tokens"]["details"]["step_tokens"] == planned
    assert data["plan"]["target_tokens"] == 300 and (not cut or planned == [300] * 3)
    assert any(len(s["micro_batches"]) > 1 for s in data["plan"]["tokens"]["steps"][:3])  # accumulation


@pytest.mark.slow
@pytest.mark.parametrize("target", [["--target-batch", "31"], ["--target-tokens", "1200"]])
def test_autotune_run_verifies_a_packed_llama(capsys, tmp_path, target):
    """A Hugging Face Llama by name, its samples packed by DataCollatorWithFlattening (--padding packed): the
    accumulated gradient over micro-batches equals the one-pass gradient over the whole packed row only where
    attention stays inside each sample."""
    folder = write_config(tmp_path / "llama", "llama")
    data = _plan_and_run(capsys, tmp_path, ["--model", str(folder), "--lengths", str(_lengths(tmp_path, 8, 64)),
                                            "--padding", "packed"], "8MiB", *target)
    checks = {c["name"]: c for c in data["verification"]["checks"]}
    assert checks["gradient_equivalence"]["value"] < 1e-5 and checks["count"]["passed"]
    assert data["plan"]["accumulation_steps"] > 1
    if target[0] == "--target-tokens":
        assert checks["tokens"]["passed"] and len(data["plan"]["tokens"]["steps"][0]["micro_batches"]) > 1
