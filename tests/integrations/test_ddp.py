"""Two CPU processes (gloo, torchrun): Lightning's DDP strategy and Accelerate, for real; and a plan for ranks that
differ run by both: Lightning's manual-optimization ``accumulator`` under its DDP strategy and Accelerate's
``accumulator``, each rank fed its own share by ``PlanSampler`` (tests/integrations/mixed_worker.py). Each rank runs
its own micro-batches and number of micro-steps, synchronises once per optimizer step, and the gradient is the full
batch's; a planted fault (every rank weighting by its own items) is caught. Both workers run in one torchrun job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..torchrun import torchrun
from .tokens import MIXED

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def job() -> list[dict]:
    """What rank 0 of ddp_worker.py's job printed: its own cases', then mixed_worker.py's."""
    done = torchrun(str(HERE / "ddp_worker.py"), "300KiB", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(printed) == 2, done.stdout[-3000:]
    return printed


@pytest.fixture(scope="module")
def ranks(job):
    return job[0]


@pytest.fixture(scope="module")
def mixed(job):
    return job[1]


@pytest.mark.slow
def test_lightning_callback_plans_for_both_ranks(ranks):
    cb = ranks["callback"]
    assert cb["arithmetic"] == ["40 = 5 x 4 steps x 2 ranks"] * 2 and cb["probe_ranks"] == [5, 5]
    assert cb["batch_size"] == [5, 5] and cb["accumulate"] == [4, 4] and cb["global_step"] == [2, 2]
    assert cb["seen"] == [[5] * 8] * 2 and len(set(cb["digests"])) == 1


@pytest.mark.slow
def test_lightning_manual_optimization_stays_in_sync_only_with_the_accumulator(ranks):
    """A plain Accumulator in a LightningModule under DDP calls backward outside DDP's reducer: the ranks
    drift apart silently (or, with its check, it refuses); autotune's accumulator keeps them equal,
    all-reduces once per optimizer step (not once per micro-step) and matches full-batch SGD in float64."""
    assert ranks["plan"] == "21 = 3 x 3 + 3 x 4 over 3 steps x 2 ranks"
    good, naive = ranks["autotune"], ranks["naive"]
    assert len(set(naive["digests"])) == 2 and naive["rounds"] == [[0, 0], [0, 0]] and naive["max_error"] > 1e-3
    assert "2 ranks are training but the model (ManualLM) is not wrapped" in ranks["checked"]["error"]
    assert len(set(good["digests"])) == 1 and good["rounds"] == [[1, 1], [1, 1]] and good["max_error"] < 1e-5
    every = ranks["every"]  # right, but all-reducing after each of the 3 micro-steps
    assert len(set(every["digests"])) == 1 and every["rounds"] == [[3, 3], [3, 3]] and every["max_error"] < 1e-5


@pytest.mark.slow
def test_accelerate_with_the_accelerators_backward(ranks):
    run = ranks["accelerate"]
    assert run["type"] == "DistributedType.MULTI_CPU"
    assert len(set(run["digests"])) == 1 and run["rounds"] == [[1, 1], [1, 1]] and run["max_error"] < 1e-5


FRAMEWORKS = ("lightning", "accelerate")


@pytest.mark.slow
def test_the_plan_gives_each_rank_its_own_micro_batches_and_micro_steps(mixed):
    assert mixed["schedule"] == [[7, 8], [2, 2, 2]]


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_rank_runs_its_own_share_and_the_gradient_is_the_full_batch_s(mixed, framework):
    run = mixed[framework]
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


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_rank_weighting_by_its_own_items_is_caught(mixed, framework):
    run = mixed[f"{framework}_local_items"]
    assert run["samples"] == [[15, 15], [6, 6]] and run["rounds"] == [[1, 1], [1, 1]]
    assert min(e for errors in run["grad_error"] for e in errors) > 1e-2
    assert run["max_error"] > 1e-3


@pytest.mark.slow
def test_lightning_steps_once_per_effective_batch_and_accelerate_runs_on_its_ddp(mixed):
    assert mixed["lightning"]["global_step"] == 2
    assert mixed["accelerate"]["type"] == "DistributedType.MULTI_CPU"
