"""A plan for ranks that differ, run by the real frameworks on two CPU processes (gloo, torchrun): Lightning's
manual-optimization ``accumulator`` under its DDP strategy and Accelerate's ``accumulator``, each rank fed its own
share by ``PlanSampler`` (tests/integrations/mixed_worker.py). Each rank runs its own micro-batches and number of
micro-steps, synchronises once per optimizer step, and the gradient is the full batch's; a planted fault (every
rank weighting by its own items) is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..torchrun import torchrun
from .tokens import MIXED

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
FRAMEWORKS = ("lightning", "accelerate")


@pytest.fixture(scope="module")
def ranks():
    done = torchrun(str(HERE / "mixed_worker.py"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_the_plan_gives_each_rank_its_own_micro_batches_and_micro_steps(ranks):
    assert ranks["schedule"] == [[7, 8], [2, 2, 2]]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_rank_runs_its_own_share_and_the_gradient_is_the_full_batch_s(ranks, framework):
    run = ranks[framework]
    assert run["samples"] == [[15, 15], [6, 6]] and run["micro_steps"] == [[2, 2], [3, 3]]
    assert run["rounds"] == [[1, 1], [1, 1]], "not one synchronising backward per optimizer step on every rank"
    for step in range(2):  # every sample of the effective batch fed once, over both ranks, and counted once
        window = range(21 * step, 21 * (step + 1))
        fed = [i for seen in run["seen"] for i in seen if i in window]
        assert sorted(fed) == list(window)
        items = [per_rank[step] for per_rank in run["items"]]  # target tokens: a sequence of n has n - 1
        assert sum(items) == sum(MIXED[i] - 1 for i in window)
        assert {per_rank[step] for per_rank in run["total_items"]} == {sum(items)}
    assert len(set(run["digests"])) == 1
    assert max(e for errors in run["grad_error"] for e in errors) < 1e-6  # fp32 against the float64 full batch
    assert run["max_error"] < 1e-5


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_rank_weighting_by_its_own_items_is_caught(ranks, framework):
    run = ranks[f"{framework}_local_items"]
    assert run["samples"] == [[15, 15], [6, 6]] and run["rounds"] == [[1, 1], [1, 1]]
    assert min(e for errors in run["grad_error"] for e in errors) > 1e-2
    assert run["max_error"] > 1e-3


def test_lightning_steps_once_per_effective_batch_and_accelerate_runs_on_its_ddp(ranks):
    assert ranks["lightning"]["global_step"] == 2
    assert ranks["accelerate"]["type"] == "DistributedType.MULTI_CPU"
