"""The runner: trains by the plan, measures it, and fails when a check fails."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autotune.api import plan as make_full_plan
from autotune.devices import get_device
from autotune.results.run import RunResult
from autotune.training import runner
from autotune.training.runner import run_plan

from .accumulators import DropsASample, NaiveOneOverK

BUDGET = 3_000_000


@pytest.fixture(scope="module")
def uneven(request):
    from autotune.workload import load_workload

    mlp = load_workload("mlp")
    device = get_device("cpu", memory_budget=BUDGET)
    return mlp, device, make_full_plan(1021, workload=mlp, device=device)


def test_run_passes_and_measures(uneven):
    mlp, device, plan = uneven
    result = run_plan(plan, mlp, device, steps=3)
    assert result.passed and len(result.losses) == 3
    v = result.verification
    assert v.gradient_relative_error < 1e-6
    assert {c.name for c in v.checks} == {"gradient_equivalence", "memory", "count"}
    assert result.peak_bytes <= result.usable_bytes
    assert result.memory_ratio == pytest.approx(1.0, abs=0.02)  # the fit rule predicts the run
    assert result.samples_per_s > 0


@pytest.mark.parametrize("fault,failing", [(NaiveOneOverK, {"gradient_equivalence"}),
                                           (DropsASample, {"gradient_equivalence", "count"})])
def test_planted_faults_fail_the_run(uneven, fault, failing, monkeypatch):
    mlp, device, plan = uneven
    monkeypatch.setattr(runner, "Accumulator", fault)  # the accumulation the runner trains and verifies with
    result = run_plan(plan, mlp, device, steps=2)
    assert not result.passed
    assert {c.name for c in result.verification.failed} == failing


def test_over_budget_run_fails_the_memory_check(uneven):
    mlp, device, plan = uneven
    tight = replace(plan, probe=replace(plan.probe, usable_bytes=plan.probe.peak_bytes // 2))
    result = run_plan(tight, mlp, device, steps=1)
    memory = result.verification.check("memory")
    assert not memory.passed and not result.passed


def test_no_verify_still_runs(uneven):
    mlp, device, plan = uneven
    result = run_plan(plan, mlp, device, steps=1, verify=False)
    assert result.verification is None and result.passed


def test_run_result_json_round_trip(uneven):
    mlp, device, plan = uneven
    result = run_plan(plan, mlp, device, steps=2)
    data = json.loads(json.dumps(result.to_dict()))
    again = RunResult.from_dict(data)
    assert again.to_dict() == result.to_dict()
    assert data["verification"]["gradient_relative_error"] == result.verification.gradient_relative_error


@pytest.mark.slow
@pytest.mark.parametrize("workload,budget,parallel", [("gpt", "6MB", "ddp"), ("mlp", "2200KB", "fsdp")])
def test_a_run_holds_no_more_than_the_fit_rule_however_many_micro_steps(workload, budget, parallel):
    # The plan's micro-batch is the probe's max: the run holds exactly the fit rule's peak, whatever the number
    # of micro-steps (13, 16) and steps, so a plan with little room left still passes its memory check.
    from autotune import api

    result = api.run(target_batch=61, probe=workload, device="cpu", memory_budget=budget, parallel=parallel,
                     steps=3)
    assert result.plan.accumulation_steps >= 13
    assert result.peak_bytes == result.predicted_peak_bytes
    assert result.passed, [c.message for c in result.verification.checks if not c.passed]


def _offload_plan(tmp_path):
    """A plan whose chosen setting is FSDP syncing every micro-step with CPU offload, on one CPU rank."""
    from autotune import api
    from autotune.results.search import TrainSetting

    plan = api.plan(400, probe="mlp", device="cpu", memory_budget="2600KB", parallel="fsdp", fsdp_sync="every")
    return replace(plan, setting=TrainSetting(parallel="fsdp", fsdp_sync="every", offload=True))


@pytest.mark.slow
def test_a_plan_with_offload_trains_under_fsdp2s_cpu_offload_and_verifies(tmp_path, monkeypatch):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from autotune import api
    from autotune.probing import fsdpoffload

    policies: list = []
    real = fsdpoffload.offload_policy
    monkeypatch.setattr(fsdpoffload, "offload_policy", lambda kind: policies.append(real(kind)) or policies[-1])
    plan = _offload_plan(tmp_path)
    assert plan.accumulation_steps >= 4
    result = api.run(plan=plan, probe="mlp", device="cpu", steps=2)
    assert result.passed, [c.message for c in result.verification.checks if not c.passed]
    assert policies and all(isinstance(p, CPUOffloadPolicy) and not p.pin_memory for p in policies)
    assert any("CPU offload" in n for n in result.notes)


@pytest.mark.slow
def test_the_verification_catches_offloaded_gradients_not_accumulated(tmp_path, monkeypatch):
    """Plant the bug: each reduce-scatter's gradient replaces the host's sum instead of adding to it."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from autotune import api

    reduce = _fsdp_param_group.foreach_reduce

    def replacing(fsdp_params, *args, **kwargs):
        for param in fsdp_params:
            param.sharded_param.grad = None
        return reduce(fsdp_params, *args, **kwargs)

    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", replacing)
    result = api.run(plan=_offload_plan(tmp_path), probe="mlp", device="cpu", steps=1)
    assert not result.passed
    assert not next(c for c in result.verification.checks if c.name == "gradient_equivalence").passed
