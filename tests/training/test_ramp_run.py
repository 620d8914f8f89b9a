"""A run with a batch ramp: each phase verified, the planted faults each check exists for caught, the record
written and read back, the command line's flags."""

from __future__ import annotations

import json

import pytest

from autotune.devices import get_device
from autotune.planning.planner import make_plan
from autotune.results.run import RunResult
from autotune.training import ramp as running
from autotune.training import runner
from autotune.training.runner import run_plan

from .accumulators import DropsASample, NaiveOneOverK
from .ramp_workload import FAST, PLAN, regression


@pytest.fixture(scope="module")
def cpu():
    return get_device("cpu", memory_budget=512 * 2**20)


@pytest.mark.slow
def test_a_ramped_run_verifies_every_phase(cpu):
    result = run_plan(PLAN, regression(100.0), cpu, steps=30, ramp=FAST)
    sizes = [p.effective_batch for p in result.batch_schedule]
    assert sizes[0] == 9 and sizes[-1] == 60 and sizes == sorted(sizes) and len(sizes) >= 3
    assert result.passed, [c.message for c in result.verification.failed]
    names = [c.name for c in result.verification.checks]
    assert {"gradient_equivalence", "batch_schedule", "phase_gradients", "count", "memory"} <= set(names)
    phases = result.verification.check("phase_gradients").details["phases"]
    assert [p["effective_batch"] for p in phases] == sizes and all(p["relative_error"] < 1e-5 for p in phases)
    assert result.samples_per_s > 0 and result.ramp == FAST


def test_the_record_reads_back_from_its_own_json(cpu):
    result = run_plan(PLAN, regression(30.0), cpu, steps=8, ramp=FAST, verify=False)
    data = json.loads(json.dumps(result.to_dict()))
    assert [set(p) >= {"first_step", "effective_batch", "b_simple", "lr_scale"} for p in data["batch_schedule"]]
    assert data["batch_schedule"][0]["first_step"] == 0 and len(data["losses"]) == 8
    again = RunResult.from_dict(data)
    assert again == result and again.to_dict() == result.to_dict()
    assert "batch ramp: 9 (step 1, lr x" in result.summary()


def grows_past_the_target(current, *, target, **kwargs):
    return 2 * target


def ignores_memory(batch, base):
    return make_plan(batch, 2 * base.max_micro_batch) if batch != base.target_batch else base


def grows_on_any_reading(current, *, target, steps_in_phase, config, **kwargs):
    return min(target, 2 * current) if steps_in_phase >= config.min_steps else current


@pytest.mark.parametrize("where,fault,noise,failing", [
    (running, ("next_batch", grows_past_the_target), 30.0, {"batch_schedule"}),
    (running, ("phase_plan", ignores_memory), 30.0, {"batch_schedule"}),
    (running, ("next_batch", grows_on_any_reading), 0.0, {"batch_schedule"}),  # noise scale ~9: readings below 18
    (runner, ("Accumulator", NaiveOneOverK), 30.0, {"gradient_equivalence", "phase_gradients"}),
    (runner, ("Accumulator", DropsASample), 30.0, {"gradient_equivalence", "phase_gradients", "count"}),
])
def test_planted_faults_fail_the_run(cpu, monkeypatch, where, fault, noise, failing):
    monkeypatch.setattr(where, *fault)
    result = run_plan(PLAN, regression(noise), cpu, steps=10, ramp=FAST)
    assert not result.passed
    assert {c.name for c in result.verification.failed} == failing


def test_without_a_fault_a_quiet_noise_scale_keeps_the_start(cpu):
    result = run_plan(PLAN, regression(0.0), cpu, steps=10, ramp=FAST)
    assert result.passed and [p.effective_batch for p in result.batch_schedule][:1] == [9]


def test_the_command_line_ramps_and_writes_the_record(tmp_path, capsys):
    from autotune.cli import main

    out = tmp_path / "run.json"
    code = main(["run", "--target-batch", "64", "--probe", "mlp", "--device", "cpu", "--memory-budget", "2.6MB",
                 "--steps", "3", "--ramp", "--ramp-from", "32", "--lr-scaling", "sqrt", "--output", str(out), "-q"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["ramp"]["start"] == 32 and data["ramp"]["lr_scaling"] == "sqrt"
    assert data["batch_schedule"][0] == {**data["batch_schedule"][0], "first_step": 0, "effective_batch": 32,
                                         "lr_scale": pytest.approx(0.5 ** 0.5)}
    assert "batch ramp: 32 (step 1, lr x0.71)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [
    (["--ramp-from", "8"], "--ramp-from is for a batch ramp: add --ramp"),
    (["--lr-scaling", "linear"], "--lr-scaling is for a batch ramp: add --ramp"),
    (["--ramp", "--ramp-from", "100"], "ramp start 100 is above the target batch 64"),
    (["--ramp", "--lr-scaling", "cubic"], "invalid choice: 'cubic'"),
    (["--ramp", "--memory-budget", "8MiB,3MiB"], "--memory-budget per rank (2 given) is for a plan of several "
                                                 "ranks, or for each rank of a torchrun job"),  # R19
])
def test_the_command_line_refuses_a_ramp_it_cannot_run_before_any_probe(argv, words, capsys, monkeypatch):
    # R2, R19: before torch is even imported (the seconds that import takes looked like a probe).
    from autotune.cli import main, run_cmd

    def no_torch(**kwargs):
        raise AssertionError("torch imported before the inputs were refused")

    monkeypatch.setattr(run_cmd, "import_torch", no_torch)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        code = main(["run", "--target-batch", "64", "--probe", "mlp", "--device", "cpu", *argv])
        raise SystemExit(code)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "probing" not in err


def test_a_ramp_on_ranks_that_differ_is_refused_with_the_fix():
    """A ramp's phases run every rank alike: on a mixed plan a phase of 600 per rank would put rank 1 (max 259)
    past its memory. Refused before any training, naming uniform_ranks=True; with it, the ramp starts."""
    import autotune
    from autotune.errors import PlanError
    from autotune.planning.ramp import first_batch
    from autotune.results.ramp import RampConfig

    mixed = autotune.plan(1800, probe="mlp", device="cpu", memory_budget="8MiB,3MiB")
    assert mixed.mixed is not None
    with pytest.raises(PlanError, match=r"^ramp: the ranks differ \(max micro-batch per rank: \d+, \d+\) .* pass "
                                        r"uniform_ranks=True to ramp"):
        first_batch(mixed, RampConfig(start=1200))
    alike = autotune.plan(1800, probe="mlp", device="cpu", memory_budget="8MiB,3MiB", uniform_ranks=True)
    assert first_batch(alike, RampConfig(start=600)) == 600 and alike.max_micro_batch < 300


def test_the_learning_rate_never_falls_when_the_batch_grows():
    # Issue 4: on the mlp (AdamW, noise ~1e4) from 64 toward 1024, step 1 ran at x0.73 (B_noise assumed = 64) and
    # the first reading's growth to 128 dropped it to x0.36. Now step 1 runs at the rule's conservative end,
    # sqrt(64 / 1024), and each phase's factor is at least the one before.
    import autotune

    result = autotune.run(target_batch=1024, probe="mlp", device="cpu", memory_budget="2.4MB", steps=24,
                          verify=False, ramp=autotune.RampConfig(start=64, min_steps=2, window=4))
    phases = result.batch_schedule
    assert len(phases) >= 3 and phases[0].lr_scale == pytest.approx((64 / 1024) ** 0.5)
    for before, after in zip(phases, phases[1:]):
        assert after.effective_batch > before.effective_batch and after.lr_scale >= before.lr_scale, phases


def test_a_target_memory_holds_in_one_step_ramps_from_the_default_start():
    # Issue 3 / R8: target 100 at a limit of 160 was refused unless --ramp-from was given.
    import autotune

    result = autotune.run(target_batch=100, probe="mlp", device="cpu", memory_budget="2.4MB", steps=2,
                          ramp=True)
    assert result.passed and result.batch_schedule[0].effective_batch == 25
    assert result.batch_schedule[0].schedule == ((12, 13),)  # smaller micro-batches than the plan's 100


def test_uniform_holds_in_every_phase():
    # R14: --uniform ramped through 161 = 80 + 81 and 322 = 2 x 107 + 1 x 108 without a word.
    import autotune

    result = autotune.run(target_batch=512, probe="mlp", device="cpu", memory_budget="2.4MB", steps=12,
                          uniform="force", ramp=autotune.RampConfig(min_steps=2, window=4))
    phases = result.batch_schedule
    assert result.passed and len(phases) >= 2 and result.plan.uniform
    for phase in phases:  # whole micro-batches of the plan's 128
        assert {n for row in phase.schedule for n in row} == {result.plan.micro_batch}, phase.schedule
