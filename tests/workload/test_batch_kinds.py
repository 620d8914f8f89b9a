"""Batches as people build them: a graph batch (three first dimensions) and a padding-free packed row are
probed, planned, run and verified with the exact n_i / N weighting, given samples= and split=."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from autotune.api import plan as make_plan
from autotune.cli import main
from autotune.devices import get_device
from autotune.errors import ProbeFileError
from autotune.probing.finder import find_max_micro_batch
from autotune.training import Batches, NoiseScale
from autotune.training.accumulate import Accumulator
from autotune.training.runner import run_plan
from autotune.workload import Workload

from ..helpers import exhaustive_max
from .batch_kinds import (
    RUN_BUDGETS,
    graph_workload,
    graphs,
    jagged_attention_workload,
    jagged_workload,
    packed_workload,
    split_graphs,
    target_tokens,
)

#: Budgets for the bisection: memory deciding well inside the search (max_batch 256).
BUDGETS = {"gnn": 800_000, "packed-lm": 8_000_000, "jagged": 1_500_000, "jagged-attention": 3_000_000}


def test_a_graph_batch_without_samples_is_refused_naming_the_fix():
    with pytest.raises(ProbeFileError, match=r"batch\(3, generator\) returned no usable batch: every tensor of a "
                                             r"batch must share its first dimension; found sizes \[2, 3, 4, \d+\]"
                                             r".*give the workload samples=.* and split="):
        graph_workload(described=False).make_batch(3, torch.Generator().manual_seed(0))


def test_samples_that_disagree_with_n_are_refused():
    w = Workload(name="gnn", model=torch.nn.Linear, batch=graphs, loss=lambda m, b: b["x"].sum(),
                 samples=lambda b: int(b["x"].shape[0]))
    with pytest.raises(ProbeFileError, match=r"batch\(3, generator\) returned \d+ samples, not 3: .*samples\(batch\)"):
        w.make_batch(3, torch.Generator().manual_seed(0))


def test_samples_without_split_cannot_slice_a_graph_batch():
    w = Workload(name="gnn", model=torch.nn.Linear, batch=graphs, loss=lambda m, b: b["x"].sum(),
                 samples=lambda b: int(b["y"].shape[0]))
    batch = w.make_batch(4, torch.Generator().manual_seed(0))
    with pytest.raises(ProbeFileError, match=r"samples 0..2 .*slicing dim 0 cannot split it: give split="):
        w.share(batch, 0, 2)


def test_a_split_that_returns_wrong_sizes_is_refused():
    w = graph_workload()
    batch = w.make_batch(5, torch.Generator().manual_seed(0))
    with pytest.raises(ProbeFileError, match=r"split\(batch, \[2, 3\]\) returned micro-batches of \[3, 2\] samples"):
        Workload(name="gnn", model=w.model, batch=w.batch, loss=w.loss, samples=w.samples,
                 split=lambda b, sizes: split_graphs(b, sizes[::-1])).share(batch, 2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("make", [graph_workload, packed_workload])
def test_accumulated_gradient_is_the_full_batch_gradient(make):
    """Micro-batches of 3, 1 and 4 samples weighted n_i / N (items: graphs, or target tokens) give the gradient
    of the whole batch's mean, to the rounding of the float32 weighted loss."""
    w = make()
    torch.manual_seed(0)
    model = w.make_model().double()
    batch = w.make_batch(8, torch.Generator().manual_seed(1))
    batch = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    w.loss(model, batch).backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), [3, 1, 4], loss=w.loss, items=w.items,
                      parts=[Batches(samples=w.samples, split=w.split), NoiseScale(measure=False)])
    out = acc.backward(batch)  # the accumulated gradient, no optimizer step
    assert out.samples == 8 and out.micro_steps == 3 and out.items == w.count_items(batch)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float((got - want).norm() / want.norm()) < 1e-6


def test_packed_items_are_target_tokens_per_micro_batch():
    w = packed_workload()
    batch = w.make_batch(5, torch.Generator().manual_seed(0))
    parts = w.split(batch, [2, 3])
    assert [int(p["position_ids"].eq(0).sum()) for p in parts] == [2, 3]  # position ids restart per sequence
    assert sum(target_tokens(p) for p in parts) == target_tokens(batch) == batch["input_ids"].shape[1] - 5


@pytest.mark.slow
@pytest.mark.parametrize("make", [graph_workload, packed_workload, jagged_workload])
def test_probe_equals_a_real_bisection(make):
    w = make()
    device = get_device("cpu", memory_budget=BUDGETS[w.name])
    result = find_max_micro_batch(w, device, max_batch=256)
    expected = exhaustive_max(w, device, result.usable_bytes, 256)
    assert 4 < expected < 256  # memory, not the limit, decides
    assert abs(result.max_micro_batch - expected) <= 1
    assert result.real_runs <= 2 and result.real_ooms == 0
    assert not [t for t in result.trials if t.source == "real" and not t.fits]  # no miss


@pytest.mark.slow
@pytest.mark.parametrize("make", [graph_workload, packed_workload])
@pytest.mark.parametrize("worst", [True, False])
def test_run_verifies_the_plan(make, worst):
    """Planned at a target no micro-batch holds (uneven micro-batches), run: the gradient equals the one-pass
    gradient over the same samples and every sample and item is counted once. The run's memory is held to the
    probe's only where batch(n) is the worst case of n samples (every graph or sequence of the most nodes or
    tokens): a micro-batch of smaller graphs probed stands for nothing about one of larger graphs."""
    w = make(worst=worst)
    device = get_device("cpu", memory_budget=RUN_BUDGETS[w.name])
    plan = make_plan(31, probe=w, device=device)
    assert plan.accumulation_steps > 1
    result = run_plan(plan, w, device, steps=2)
    v = result.verification
    assert v.gradient_relative_error < 1e-5
    assert v.check("gradient_equivalence").passed and v.check("count").passed
    if worst:
        assert result.passed, v.failed


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["graph_workload", "packed_workload", "jagged_workload",
                                     "jagged_attention_workload"])
def test_autotune_run_verifies_a_probe_file_of_each_kind(capsys, tmp_path, builder):
    """``autotune run`` on a probe file whose workload gives samples= and split=: plan, train, verify."""
    path = tmp_path / f"{builder}.py"
    path.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.workload import batch_kinds

        def build():
            return batch_kinds.{builder}(worst=True)
        """))
    budget = RUN_BUDGETS[{"graph_workload": "gnn", "packed_workload": "packed-lm",
                          "jagged_attention_workload": "jagged-attention"}.get(builder, "jagged")]
    code = main(["run", "--target-batch", "31", "--probe", str(path), "--device", "cpu", "--memory-budget",
                 str(budget), "--steps", "2", "--json", "--quiet"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["passed"], data["verification"]
    checks = {c["name"]: c for c in data["verification"]["checks"]}
    assert checks["gradient_equivalence"]["value"] < 1e-5 and checks["count"]["passed"]
    assert data["plan"]["accumulation_steps"] > 1


@pytest.mark.slow
def test_a_jagged_batch_is_estimated_confirmed_and_verified():
    """Nested tensors of jagged layout: the estimate builds the NJT on meta from the batch, one real run
    confirms its answer; the run splits by the workload's split and verifies."""
    w = jagged_workload()
    device = get_device("cpu", memory_budget=RUN_BUDGETS["jagged"])
    plan = make_plan(31, probe=w, device=device)
    assert plan.accumulation_steps > 1
    assert not any("cannot run" in note for note in plan.probe.notes), plan.probe.notes
    assert plan.probe.real_runs == 1 and plan.probe.real_ooms == 0
    result = run_plan(plan, w, device, steps=2)
    assert result.passed, result.verification.failed
    assert result.verification.gradient_relative_error < 1e-5


@pytest.mark.slow
def test_attention_over_a_jagged_batch_is_searched_on_the_device_and_says_why():
    """SDPA over NJTs takes the math backend on the CPU, over nested tensors of strided layout, which no
    shape-only engine holds: the probe says so and searches on the device, every real run counted (more than
    the two an estimate's answer takes), and lands within one sample of a real bisection; the run verifies."""
    w = jagged_attention_workload()
    device = get_device("cpu", memory_budget=BUDGETS[w.name])
    result = find_max_micro_batch(w, device, max_batch=256)
    assert abs(result.max_micro_batch - exhaustive_max(w, device, result.usable_bytes, 256)) <= 1
    real = [t for t in result.trials if t.source == "real"]
    assert result.real_runs == len(real) > 2 and not any(t.source == "estimate" for t in result.trials)
    why = "the estimate cannot run this workload (NotShapeOnly: attention over a nested tensor of jagged layout"
    assert any(note.startswith(why) and f"in {len(real)} real runs" in note for note in result.notes)
    plan = make_plan(31, probe=w, device=get_device("cpu", memory_budget=RUN_BUDGETS[w.name]))
    assert plan.accumulation_steps > 1
    run = run_plan(plan, w, get_device("cpu", memory_budget=RUN_BUDGETS[w.name]), steps=2)
    assert run.verification.gradient_relative_error < 1e-5 and run.verification.check("count").passed
