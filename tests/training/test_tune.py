"""Throughput tuning: exact candidates, real timings, pruned when they do not fit."""

from __future__ import annotations

import json

import pytest
import torch

from autotune.devices import get_device
from autotune.errors import BadInput
from autotune.planning import make_plan
from autotune.results import Plan
from autotune.serial import dumps
from autotune.training import tune as tune_module
from autotune.training.timing import Samples, Timing, compare_plans, repeat_until_stable
from autotune.training.tune import candidate_sizes, tune
from autotune.workload import Workload

FAST = Timing(min_steps=2, max_steps=3, budget_s=0.01)


@pytest.mark.parametrize("target,max_micro,world,want", [
    (1024, 300, 1, [256, 205, 171, 147, 128, 114, 103, 94, 86, 79, 74, 69]),
    (64, 64, 1, [64, 32, 22, 16, 13, 11, 10, 8, 7, 6, 5, 4]),
    (1024, 48, 8, [43, 32, 26, 22, 19, 16, 15, 13, 12, 11, 10, 9]),
])
def test_candidates_are_exact_plans_from_the_largest_down(target, max_micro, world, want):
    sizes = candidate_sizes(target, max_micro, world_size=world, multiple_of=1, uniform=None)
    assert sizes == want
    for micro in sizes:
        assert make_plan(target, micro, world_size=world).micro_batch == micro


@pytest.mark.slow
def test_tune_times_candidates_and_keeps_the_target(mlp, tmp_path):
    device = get_device("cpu", memory_budget=3_000_000)
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    plan = tune(mlp, device, 256, trials=4, timing=FAST, storage=storage)
    assert plan.target_batch == 256 and sum(map(sum, plan.schedule)) == 256
    t = plan.tuning
    assert t.storage == storage and t.trials == 4 and t.measured == 4
    measured = [c for c in t.candidates if c.samples_per_s is not None]
    assert len(measured) == 4 and all(c.samples_per_s > 0 and 2 <= c.timed_steps <= 3 for c in measured)
    assert t.chosen.micro_batch == plan.micro_batch
    assert t.fastest.samples_per_s == max(c.samples_per_s for c in measured)
    assert t.chosen is t.fastest or t.chosen is t.baseline
    # The study lives in its storage: a second call resumes it and measures two more.
    again = tune(mlp, device, 256, trials=2, timing=FAST, storage=storage)
    assert again.tuning.trials == 6 and again.tuning.study_name == t.study_name
    assert len({(c.options_label, c.micro_batch) for c in again.tuning.candidates}) == 6


@pytest.mark.slow
def test_candidates_that_run_out_of_memory_are_pruned(mlp, monkeypatch):
    real = tune_module.time_plan

    def time_plan(workload, device, plan, **kw):
        if plan.micro_batch > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(workload, device, plan, **kw)

    monkeypatch.setattr(tune_module, "time_plan", time_plan)
    plan = tune(mlp, get_device("cpu", memory_budget=3_000_000), 512, trials=8, timing=FAST)
    assert plan.micro_batch <= 100
    pruned = [c for c in plan.tuning.candidates if not c.fits]
    assert pruned and all("ran out of memory" in c.why and c.micro_batch > 100 for c in pruned)
    assert plan.tuning.ratio is None and "no ratio to the untuned plan (micro-batch 256 ran out of memory)" in \
        plan.summary()


def test_tune_needs_a_real_device(mlp):
    with pytest.raises(Exception, match="real device"):
        tune(mlp, get_device("estimate", memory_budget=2**30), 64)


# ---- timing: warm-up, then repeat until the spread is small or the budget is spent -------------


class FakeClock:
    """A timer that advances by scripted step durations: each ``step()`` takes the next one."""

    def __init__(self, durations):
        self.now, self.durations, self.steps = 0.0, list(durations), 0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.durations[self.steps]
        self.steps += 1


def test_timing_stops_once_the_spread_is_small():
    clock = FakeClock([9.0] + [1.0, 1.01, 0.99, 1.0, 1.02] + [5.0] * 20)
    times = repeat_until_stable(clock.step, Timing(warmup=1, min_steps=5, threshold=0.05, budget_s=100),
                                timer=clock)
    assert clock.steps == 6  # one warm-up step, not timed, then five steady ones
    assert times.values == pytest.approx((1.0, 1.01, 0.99, 1.0, 1.02))
    assert times.median == pytest.approx(1.0) and times.spread <= 0.05


def test_timing_repeats_while_noisy_until_the_budget_is_spent():
    clock = FakeClock([1.0] + [1.0, 2.0] * 50)
    times = repeat_until_stable(clock.step, Timing(warmup=1, min_steps=5, max_steps=40, threshold=0.05,
                                                   budget_s=12.0), timer=clock)
    assert len(times.values) == 8  # 1 + 2 + 1 + 2 + 1 + 2 + 1 + 2 = 12 s of timed steps
    assert times.spread > 0.05
    clock = FakeClock([1.0] + [1.0, 2.0] * 50)
    capped = repeat_until_stable(clock.step, Timing(warmup=1, min_steps=5, max_steps=6, threshold=0.05,
                                                    budget_s=1e9), timer=clock)
    assert len(capped.values) == 6


def test_timing_validates_itself():
    with pytest.raises(ValueError, match="min_steps"):
        Timing(min_steps=1)
    with pytest.raises(ValueError, match="max_steps"):
        Timing(min_steps=5, max_steps=4)
    with pytest.raises(ValueError, match="threshold"):
        Timing(threshold=0)


# ---- the study: the baseline first, each candidate once, the pick against noise ----------------


def fake_times(per_micro: dict[int, tuple[float, ...]], calls: list[int]):
    """A stand-in for time_plan: scripted step times by micro-batch; records what it timed."""
    def time_plan(workload, device, plan, **kw):
        calls.append(plan.micro_batch)
        return Samples(per_micro.get(plan.micro_batch, (1.0, 1.0, 1.0)))
    return time_plan


def test_baseline_first_and_no_duplicates(mlp, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(tune_module, "time_plan", fake_times({}, calls))
    device = get_device("cpu", memory_budget=3_000_000)
    untuned = pipeline_plan(256, device)
    plan = tune(mlp, device, 256, trials=4, timing=FAST)
    assert calls[0] == untuned.micro_batch  # the untuned plan is measured first
    assert len(calls) == 4 and len(set(calls)) == 4
    t = plan.tuning
    assert t.baseline.micro_batch == untuned.micro_batch and t.baseline.baseline is True
    assert len([c for c in t.candidates if c.samples_per_s is not None]) == 4
    assert Plan.from_dict(json.loads(dumps(plan.to_dict()))) == plan  # the tuning record is plain JSON
    # More trials than candidates: every candidate once, then the study stops.
    calls.clear()
    sizes = candidate_sizes(256, untuned.max_micro_batch, world_size=1, multiple_of=1, uniform=None)
    plan = tune(mlp, device, 256, trials=100, timing=FAST)
    assert sorted(calls) == sorted(sizes) and calls[0] == sizes[0]
    assert plan.tuning.trials == len(sizes)


def pipeline_plan(target, device):
    from autotune.api import plan as plan_api

    return plan_api(target, probe="mlp", device=device)


def head_to_head(ratios: tuple[float, ...], calls: list[tuple[int, int]]):
    """A stand-in for compare_plans: scripted ratios of the other plan's throughput over the first's."""
    def compare_plans(workload, device, plan, other, **kw):
        calls.append((plan.micro_batch, other.micro_batch))
        return Samples(ratios)
    return compare_plans


def scripted(monkeypatch, mlp, times_of, ratios):
    """Scripted timings and head-to-head ratios around the real probe of mlp at 3 MB; returns
    (baseline micro-batch, candidate sizes, head-to-head calls)."""
    device = get_device("cpu", memory_budget=3_000_000)
    base = pipeline_plan(256, device).micro_batch
    sizes = candidate_sizes(256, base, world_size=1, multiple_of=1, uniform=None)
    compared: list[tuple[int, int]] = []
    monkeypatch.setattr(tune_module, "time_plan", fake_times(times_of(base, sizes), []))
    monkeypatch.setattr(tune_module, "compare_plans", head_to_head(ratios, compared))
    return device, base, sizes, compared


def test_a_clear_win_is_picked_with_its_ratio(mlp, monkeypatch):
    device, base, sizes, compared = scripted(
        monkeypatch, mlp, lambda base, sizes: {base: (1.0, 1.02, 0.98), sizes[2]: (0.5, 0.51, 0.49)},
        (2.0, 2.02, 1.98, 2.0, 2.01, 1.99))
    plan = tune(mlp, device, 256, trials=100, timing=FAST)
    t = plan.tuning
    assert compared == [(base, sizes[2])]  # the fastest meets the baseline head to head
    assert plan.micro_batch == sizes[2] and t.chosen.micro_batch == sizes[2] and not t.kept_baseline
    assert t.ratio == pytest.approx(2.0) and 0 < t.uncertainty < 0.05
    assert f"2.00x the baseline (±{t.uncertainty:.2f})" in plan.summary()
    assert t.fastest.vs_baseline == pytest.approx(2.0)  # measured one after the other: ranking only


def test_a_win_within_noise_keeps_the_baseline(mlp, monkeypatch):
    device, base, sizes, _ = scripted(
        monkeypatch, mlp, lambda base, sizes: {base: (1.0,) * 3, sizes[1]: (0.97,) * 3},
        (0.95, 1.1, 1.0, 1.08, 0.97, 1.05, 1.03))  # 3% faster, give or take 5%
    plan = tune(mlp, device, 256, trials=100, timing=FAST)
    t = plan.tuning
    assert plan.micro_batch == base and t.chosen.micro_batch == base and t.kept_baseline
    assert t.fastest.micro_batch == sizes[1] and t.ratio == pytest.approx(1.03)
    assert t.ratio - t.uncertainty <= 1 < t.ratio
    assert "within noise" in plan.summary()


def test_a_win_measured_under_other_load_is_not_taken(mlp, monkeypatch):
    """One after the other, a load spike during the baseline makes a slower candidate look 3x faster;
    head to head it is slower, and the baseline stays."""
    device, base, sizes, _ = scripted(
        monkeypatch, mlp, lambda base, sizes: {s: (4.0,) * 3 for s in sizes} | {base: (3.0, 3.3, 2.9),
                                                                              sizes[3]: (1.0, 1.1, 0.9)},
        (0.78, 0.77, 0.8, 0.79, 0.78))
    plan = tune(mlp, device, 256, trials=100, timing=FAST)
    t = plan.tuning
    assert t.fastest.micro_batch == sizes[3] and t.fastest.vs_baseline == pytest.approx(3.0)
    assert plan.micro_batch == base and t.kept_baseline and t.ratio == pytest.approx(0.78)
    assert "0.78x the baseline" in plan.summary() and "within noise" not in plan.summary()


@pytest.mark.parametrize("other_options", [False, True])
def test_head_to_head_measures_both_plans_in_rounds(mlp, other_options):
    device = get_device("cpu")
    workload = Workload(name="mlp2", model=mlp.model, batch=mlp.batch, loss=mlp.loss, options={"unused": [0, 1]})
    first = workload.configure(unused=0)
    other = workload.configure(unused=1) if other_options else first
    timing = Timing(warmup=1, min_steps=3, max_steps=3, budget_s=0.01)
    ratios = compare_plans(first, device, make_plan(64, 64), make_plan(64, 16), other_workload=other, timing=timing)
    assert len(ratios.values) == 3 and all(r > 0 for r in ratios.values) and ratios.half_width >= 0


# ---- storage: the study is named after everything that shapes it -------------------------------


@pytest.mark.slow
def test_storage_reused_with_other_settings_opens_another_study(mlp, monkeypatch, tmp_path):
    monkeypatch.setattr(tune_module, "time_plan", fake_times({}, []))
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    small = tune(mlp, get_device("cpu", memory_budget=3_000_000), 256, trials=2, timing=FAST, storage=storage)
    large = tune(mlp, get_device("cpu", memory_budget=2_500_000), 256, trials=2, timing=FAST, storage=storage)
    assert small.tuning.study_name != large.tuning.study_name
    assert small.probe.max_micro_batch != large.probe.max_micro_batch  # other candidates: a crash in one study
    again = tune(mlp, get_device("cpu", memory_budget=3_000_000), 256, trials=2, timing=FAST, storage=storage)
    assert again.tuning.study_name == small.tuning.study_name and again.tuning.trials == 4
    other = tune(mlp, get_device("cpu", memory_budget=3_000_000), 256, trials=2, timing=FAST, storage=storage,
                 margin=0.2)
    assert other.tuning.study_name not in (small.tuning.study_name, large.tuning.study_name)


@pytest.mark.slow
def test_a_named_study_with_other_settings_is_bad_input(mlp, monkeypatch, tmp_path):
    monkeypatch.setattr(tune_module, "time_plan", fake_times({}, []))
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    tune(mlp, get_device("cpu", memory_budget=3_000_000), 256, trials=2, timing=FAST, storage=storage,
         study_name="mine")
    with pytest.raises(BadInput, match=r"study 'mine' in sqlite:///.*tune\.db was made for other settings") as info:
        tune(mlp, get_device("cpu", memory_budget=2_500_000), 256, trials=2, timing=FAST, storage=storage,
             study_name="mine")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("url, match", [
    ("bogus://", r"storage 'bogus://' names no database driver SQLAlchemy knows"),
    ("tune.db", r"storage 'tune.db' is not a database URL: use e.g. sqlite:///tune.db"),
    ("sqlite:////no/such/folder/tune.db", (r"storage 'sqlite:////no/such/folder/tune.db': folder /no/such/folder "
                                           r"does not exist")),
    ("postgresql+pg8000://me:secret@db.example/tune", (r"storage 'postgresql\+pg8000://me:\*\*\*@db.example/tune' "
                                                       r"needs the Python driver pg8000, which is not installed")),
])
def test_bad_storage_is_found_before_any_work(mlp, monkeypatch, url, match):
    def no_probe(*args, **kwargs):
        raise AssertionError("probed before the storage was checked")

    monkeypatch.setattr(tune_module, "find_max_micro_batch", no_probe)
    with pytest.raises(BadInput, match=match) as info:
        tune(mlp, get_device("cpu", memory_budget=3_000_000), 256, storage=url)
    assert "secret" not in str(info.value) and "\n" not in str(info.value)


def test_the_plan_api_checks_storage_before_any_work(monkeypatch):
    from autotune import api as pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the storage was checked")

    monkeypatch.setattr(pipeline, "resolve", refuse)
    with pytest.raises(BadInput, match=r"^storage 'bogus://' names no database driver"):
        pipeline.plan(64, workload="mlp", device="cpu", memory_budget=3_000_000, tune=True, storage="bogus://")
    with pytest.raises(BadInput, match=r"storage needs tune=True"):
        pipeline.plan(64, workload="mlp", device="cpu", memory_budget=3_000_000, storage="sqlite:///tune.db")
