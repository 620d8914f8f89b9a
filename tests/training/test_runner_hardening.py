"""The runner's verdicts name the real cause, and users' errors are theirs, never "internal"."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from autotune.cli import main
from autotune.devices import get_device
from autotune.errors import DoesNotFit, ProbeFileError, WorkloadError
from autotune.planning.planner import make_plan
from autotune.training.runner import run_plan
from autotune.workload import Workload, load_workload

from .. import workloads


def test_a_nan_loss_fails_verification_saying_it_is_not_finite():
    w = workloads.nan_loss()
    result = run_plan(make_plan(64, 16), w, get_device("cpu", memory_budget=2**30), steps=1)
    grad = result.verification.check("gradient_equivalence")
    assert not grad.passed and "not finite" in grad.message, grad.message
    assert "deterministic" not in grad.message


def test_a_batch_that_ignores_its_size_is_named_before_any_training():
    w = workloads.fixed_batch(8)
    with pytest.raises(ProbeFileError, match=r"batch\(100, generator\) returned 8 samples, not 100"):
        run_plan(make_plan(100, 100), w, get_device("cpu", memory_budget=2**30), steps=1)


def test_the_cli_plan_refuses_a_batch_that_ignores_its_size(capsys, tmp_path):
    path = workloads.probe_file(tmp_path, "fixed", "fixed_batch", 8)
    code = main(["plan", "--target-batch", "100", "--probe", str(path), "--device", "cpu", "--memory-budget", "64MB"])
    err = capsys.readouterr().err
    assert code == 2 and "returned 8 samples" in err and "internal error" not in err


def test_run_leaves_the_callers_random_state_alone():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    run_plan(make_plan(64, 32), load_workload("mlp"), get_device("cpu", memory_budget=2**30), steps=1)
    assert torch.equal(torch.get_rng_state(), before)


def _loss_fails_after(calls: int) -> Workload:
    count = [0]

    def loss(model, batch):
        count[0] += 1
        if count[0] > calls:
            raise ValueError("my loss broke")
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    return replace(load_workload("mlp"), loss=loss)


def test_the_loss_raising_during_training_is_the_workloads_error_with_the_step():
    w = _loss_fails_after(12)  # verification's micro-steps and reference pass, then the run's steps
    with pytest.raises(WorkloadError, match=r"failed at step \d+ of 5 of the run: ValueError: my loss broke"):
        run_plan(make_plan(64, 32), w, get_device("cpu", memory_budget=2**30), steps=5)


def test_running_out_of_memory_during_a_run_says_the_plan_does_not_fit():
    mlp = load_workload("mlp")
    device = get_device("cpu", memory_budget=1_500_000)
    too_big = make_plan(4096, 4096)  # a plan edited by hand: the whole batch in one micro-step
    with pytest.raises(DoesNotFit, match=r"micro-batch 4096 ran out of memory .* does not fit cpu"):
        run_plan(too_big, mlp, device, steps=1, verify=False)


@pytest.mark.parametrize("factory,error,words", [
    (lambda: 3, ProbeFileError, "model() returned int, not a torch.nn.Module"),
    (lambda: (_ for _ in ()).throw(RuntimeError("no weights here")), WorkloadError,
     "model() failed: RuntimeError: no weights here"),
])
def test_a_model_factory_that_fails_is_named(factory, error, words):
    from autotune.probing.finder import find_max_micro_batch

    w = replace(load_workload("mlp"), model=factory)
    with pytest.raises(error) as info:
        find_max_micro_batch(w, get_device("cpu", memory_budget=2**30), max_batch=8)
    assert words in str(info.value)


def test_the_cli_reports_a_failing_model_factory_as_the_users_error(capsys, tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import autotune, torch\n"
                    "def build():\n"
                    "    return autotune.Workload(name='bad', model=lambda: 3, batch=lambda n, g: torch.zeros(n, 2),\n"
                    "                             loss=lambda m, b: b.sum())\n")
    code = main(["probe", "--probe", str(path), "--device", "cpu", "--memory-budget", "64MB"])
    err = capsys.readouterr().err
    assert code == 2 and "model() returned int" in err and "internal error" not in err
