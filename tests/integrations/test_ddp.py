"""Two CPU processes (gloo, torchrun): Lightning's DDP strategy and Accelerate, for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..torchrun import torchrun

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ranks():
    done = torchrun(str(HERE / "ddp_worker.py"), "300KiB", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


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
