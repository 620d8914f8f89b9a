"""The batch ramp's rules as pure arithmetic: when it grows and to what, each phase's exact plan, the learning rate."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.errors import BadInput, PlanError
from autotune.planning.planner import make_plan
from autotune.planning.ramp import (
    RampConfig,
    Reading,
    default_start,
    first_batch,
    lr_scale,
    next_batch,
    phase_lr_scale,
    phase_micro_limit,
    phase_plan,
    uniform_base,
    window_reading,
)

CONFIG = RampConfig()  # min_steps 10, growth 2


def read(b, low, high=None):
    return Reading(b_simple=b, low=low, high=high)


@pytest.mark.parametrize("current,reading,steps,quantum,want", [
    (32, read(50, 40), 10, 1, 50),             # the 95% lower bound is above the batch: grow to about B_simple
    (32, read(500, 40), 10, 1, 64),            # at most `growth` x the batch per change
    (32, read(500, 40), 9, 1, 32),             # the phase has not run min_steps steps yet
    (32, read(50, None), 30, 1, 32),           # too noisy to bound: no growth on a noisy reading
    (32, read(50, 31), 30, 1, 32),             # the lower bound is not above the batch
    (32, read(50, 32), 30, 1, 32),             # ... nor equal to it
    (32, read(None, None), 30, 1, 32),         # nothing measured
    (32, None, 30, 1, 32),
    (32, read(39, 33), 30, 1, 32),             # less than 25% more: no change (no oscillation in small steps)
    (32, read(40, 33), 30, 1, 40),             # 25% more: grows
    (32, read(60, 40), 10, 8, 56),             # rounded down to the sizes allowed
    (32, read(39, 33), 10, 8, 32),             # ... and 32 is the largest of them below 39
    (200, read(300, 250), 10, 1, 256),         # never above the target
    (240, read(255, 250), 10, 1, 240),         # 255 is less than 25% more and not the target: no change
    (250, read(1e6, 1e5), 10, 1, 256),         # the target is reached though it is less than 25% more
    (256, read(1e6, 1e5), 10, 1, 256),         # at the target: stays
])
def test_the_next_batch(current, reading, steps, quantum, want):
    assert next_batch(current, target=256, quantum=quantum, reading=reading, steps_in_phase=steps,
                      config=CONFIG) == want


@given(current=st.integers(2, 5000), target=st.integers(2, 5000), b=st.floats(0.1, 1e7), low=st.floats(0.1, 1e7),
       steps=st.integers(0, 50), quantum=st.integers(1, 16))
@settings(max_examples=300, deadline=None)
def test_the_batch_never_shrinks_never_passes_the_target_and_grows_only_above_its_lower_bound(
        current, target, b, low, steps, quantum):
    current = min(current, target)
    got = next_batch(current, target=target, quantum=quantum, reading=read(max(b, low), low), steps_in_phase=steps,
                     config=CONFIG)
    assert current <= got <= target
    if got > current:
        assert low > current and steps >= CONFIG.min_steps
        assert got == target or (got % quantum == 0 and got <= CONFIG.growth * current and got <= max(b, low))


@pytest.mark.parametrize("rule,batch,noise,exponent,want", [
    ("noise", 100, 10.0, 1.0, (1 + 10 / 1000) / (1 + 10 / 100)),  # near 1 above B_noise: 0.918
    ("noise", 10, 1000.0, 1.0, (1 + 1000 / 1000) / (1 + 1000 / 10)),  # below it: about 2 B / B_noise
    ("noise", 100, 10.0, 0.5, math.sqrt((1 + 10 / 1000) / (1 + 10 / 100))),
    ("noise", 100, None, 1.0, 100 / 1000),  # nothing measured: the conservative end (B_noise far above B)
    ("noise", 100, None, 0.5, (100 / 1000) ** 0.5),
    ("noise", 1000, 50.0, 1.0, 1.0),  # at the target: the rate tuned for it
    ("linear", 100, 10.0, 1.0, 0.1),
    ("sqrt", 100, 10.0, 1.0, math.sqrt(0.1)),
    ("none", 100, 10.0, 1.0, 1.0),
])
def test_the_learning_rate_rules(rule, batch, noise, exponent, want):
    assert lr_scale(rule, batch=batch, target=1000, noise_scale=noise, exponent=exponent) == pytest.approx(want)


def test_a_phase_never_runs_at_a_lower_rate_than_the_smaller_phase_before():
    # A reading of a much larger noise scale would lower the rule's factor as the batch grows: the phase keeps it.
    first = phase_lr_scale("noise", batch=128, target=4096, noise_scale=128.0, exponent=0.5)
    grown = phase_lr_scale("noise", batch=256, target=4096, noise_scale=1e5, exponent=0.5, before=first)
    assert lr_scale("noise", batch=256, target=4096, noise_scale=1e5, exponent=0.5) < first == grown
    assert phase_lr_scale("noise", batch=4096, target=4096, noise_scale=1e5, before=first) == 1.0
    for noise in (1.0, 1e3, 1e6):  # no reading can take the rate below the conservative start
        assert lr_scale("noise", batch=64, target=4096, noise_scale=noise) >= lr_scale(
            "noise", batch=64, target=4096, noise_scale=None)


def test_the_noise_rule_keeps_the_rate_where_linear_would_divide_it_by_sixteen():
    target, b_noise = 4096, 64.0
    assert lr_scale("linear", batch=target // 16, target=target, noise_scale=b_noise) == 1 / 16
    assert lr_scale("noise", batch=target // 16, target=target, noise_scale=b_noise) > 0.8


@pytest.mark.parametrize("target,world,m,quantum,want", [
    (1024, 1, 32, 1, 33),    # m + 1: the fewest-step plan splits it in two micro-batches
    (1024, 4, 32, 4, 128),   # W x m: one micro-batch of m on each of the 4 ranks
    (1024, 1, 32, 8, 40),    # rounded up to a multiple of 8
    (1024, 2, 30, 16, 48),   # rounded down to a multiple of 8 x 2 ranks: 24 a rank
    (1024, 1, 1, 1, 2),      # two micro-batches of one
])
def test_the_default_start(target, world, m, quantum, want):
    assert default_start(target, world_size=world, max_micro_batch=m, quantum=quantum) == want


@pytest.mark.parametrize("target,world,m,quantum,want", [
    (1024, 1, 1024, 1, 256),  # memory holds the target in one micro-batch: a quarter of it, in two micro-batches
    (100, 1, 100, 1, 25),     # R8 / issue 3: the target caps the limit at 100 (memory holds 160)
    (100, 1, 160, 8, 24),     # rounded down to a multiple of 8
    (64, 4, 32, 4, 16),       # 4 ranks hold 128 at once: a quarter of 64
    (6, 1, 6, 1, 2),          # never below two micro-batches of one
])
def test_the_default_start_when_memory_holds_the_target_in_one_step(target, world, m, quantum, want):
    assert default_start(target, world_size=world, max_micro_batch=m, quantum=quantum) == want


@pytest.mark.parametrize("target,world,quantum,words", [
    (2, 1, 1, "the target 2 leaves no batch below it to start from: the smallest a ramp runs is 2 (two "
              "micro-batches on one rank, so the noise scale can be measured)"),
    (16, 1, 8, "the smallest a ramp runs is 16 (two micro-batches on one rank, in multiples of 8"),
    (4, 4, 4, "the smallest a ramp runs is 4 (one micro-batch on each of 4 ranks"),
])
def test_no_default_start_when_no_batch_a_ramp_runs_is_below_the_target(target, world, quantum, words):
    with pytest.raises(PlanError, match=re.escape(words)) as caught:
        default_start(target, world_size=world, max_micro_batch=target, quantum=quantum)
    assert "ramp toward a larger target, or train at" in str(caught.value)
    assert "memory limit" not in str(caught.value)


@pytest.mark.parametrize("start,world,q,words", [
    (2000, 1, 1, "ramp start 2000 is above the target batch 1024"),
    (1, 1, 1, "ramp start 1 is too small: the noise scale needs two micro-batches per step on one rank"),
    (3, 4, 1, "one per rank on 4 ranks"),
    (6, 4, 1, "ramp start 6 is not a multiple of 4 (every rank an equal share): start at 4 or 8"),
    (12, 1, 8, "ramp start 12 is too small"),
    (36, 1, 8, "ramp start 36 is not a multiple of 8: start at 32 or 40"),
])
def test_a_start_that_cannot_be(start, world, q, words):
    plan = make_plan(1024, 32, world_size=world, multiple_of=q)
    with pytest.raises(PlanError, match=words.replace("(", r"\(").replace(")", r"\)")):
        first_batch(plan, RampConfig(start=start))


@pytest.mark.parametrize("field,value,words", [
    ("lr_scaling", "cubic", "lr_scaling 'cubic' must be one of noise, linear, sqrt, none"),
    ("growth", 1.0, "growth 1.0 must be a number above 1"),
    ("min_steps", 0, "min_steps 0 must be at least 1"),
    ("window", 1, "window 1 must be at least 2"),
    ("window", 10**12, "window 1000000000000 must be at most 1000 steps"),  # R28
    ("growth", "2", "growth '2' is text, not a number: give a number above 1, e.g. 2.0"),  # R28: not coerced
    ("growth", True, "growth True must be a number above 1"),
    ("start", 0, "start 0 must be at least 1"),
])
def test_settings_are_checked_once(field, value, words):
    with pytest.raises(BadInput, match=words):
        RampConfig(**{field: value})


@given(target=st.integers(8, 5000), m=st.integers(1, 600), world=st.integers(1, 8), q=st.sampled_from([1, 2, 8]),
       frac=st.floats(0.0, 1.0))
@settings(max_examples=300, deadline=None)
def test_every_phase_is_an_exact_plan_within_the_memory_limit_that_the_noise_scale_can_measure(
        target, m, world, q, frac):
    units = target // q
    try:
        base = make_plan(units * q, m, world_size=world, multiple_of=q)
    except PlanError:
        return  # no plan of the target at all
    quantum = q * world
    batch = quantum * max(2 if world == 1 else 1, round(frac * units / world))
    if batch >= base.target_batch:
        batch = base.target_batch
    phase = phase_plan(batch, base)
    assert phase.target_batch == batch == sum(map(sum, phase.schedule))
    assert phase.micro_batch <= m and all(b % q == 0 for row in phase.schedule for b in row)
    if batch < base.target_batch:  # below the target (the plan itself), two micro-batches: the noise is measurable
        assert phase.world_size * phase.accumulation_steps >= 2
    assert phase_micro_limit(batch, world_size=world, max_micro_batch=m, multiple_of=q) <= m


def test_a_uniform_ramp_takes_whole_micro_batches_of_the_plans():
    base, quantum = uniform_base(make_plan(512, 160, uniform="force"))
    assert (base.max_micro_batch, quantum) == (128, 128)
    assert phase_plan(first_batch(base, RampConfig(), quantum=quantum), base).schedule == ((128, 128),)
    assert phase_plan(384, base).schedule == ((128, 128, 128),)
    with pytest.raises(PlanError, match=r"this plan's differ \(255, 256\): plan with uniform='force'"):
        uniform_base(make_plan(1021, 300))


def test_the_phase_at_the_target_is_the_plan_itself():
    base = make_plan(1000, 300, uniform="force")
    assert phase_plan(1000, base) is base


def test_the_window_reading_is_the_ratio_of_means_with_an_interval_only_when_the_data_bound_it():
    steady = [(1.0 + 0.01 * (i % 3), 100.0 + (i % 5)) for i in range(20)]
    r = window_reading(steady)
    assert r.b_simple == pytest.approx(102 / 1.01, rel=0.01)
    assert r.low is not None and r.high is not None and r.low < r.b_simple < r.high
    noisy = [(g, 100.0) for g in [5.0, -4.0, 3.0, -2.5, 1.0, -0.9, 0.2, 0.3]]  # |G|² not told apart from 0
    r = window_reading(noisy)
    assert r.high is None  # unbounded above: the data bound only the lower end (or nothing)
    assert window_reading(steady[:1]) == Reading(b_simple=None, low=None, high=None)
