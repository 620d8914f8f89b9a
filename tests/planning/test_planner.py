"""The planner: exact arithmetic, fewest steps, clear errors, exact JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.errors import NoUniformPlan, PlanError, ResultFileError
from autotune.planning.planner import (
    MAX_MICRO_BATCHES,
    MAX_TARGET_BATCH,
    Plan,
    make_plan,
    nearest_uniform_targets,
    world_size_from,
)
from autotune.results.device import DeviceInfo
from autotune.results.probe import ProbeResult, Trial
from autotune.results.tuning import Candidate, HeadToHead, Tuning
from autotune.serial import dumps
from autotune.units import format_bytes

MiB = 2**20


# ---- brute force: what a valid plan is, checked without the planner's arithmetic ---------------


def reachable_after(slots: int, sizes: range, target: int) -> int:
    """Bit s set when some ``slots`` sizes from ``sizes`` sum to s (s <= target)."""
    mask, reach = (1 << (target + 1)) - 1, 1
    for _ in range(slots):
        reach = _step(reach, sizes, mask)
    return reach


def _step(reach: int, sizes: range, mask: int) -> int:
    nxt = 0
    for size in sizes:
        nxt |= reach << size
    return nxt & mask


def brute_steps(target: int, m: int, world: int, q: int) -> int | None:
    """Fewest steps k such that world x k micro-batches, each a multiple of q in [1, m], sum to target."""
    sizes = range(q, min(m, target) + 1, q)
    if not sizes:
        return None
    mask, reach = (1 << (target + 1)) - 1, 1
    for slot in range(1, target + 1):
        reach = _step(reach, sizes, mask)
        if not reach:
            return None
        if slot % world == 0 and reach >> target & 1:
            return slot // world
    return None


def uniform_at(target: int, m: int, world: int, q: int, k: int) -> bool:
    """Some equal size (a multiple of q in [1, m]) gives target over world x k slots."""
    return any(world * k * s == target for s in range(q, m + 1, q))


def check_plan(plan: Plan, target: int, m: int, world: int, q: int) -> None:
    sizes = [b for rank in plan.schedule for b in rank]
    assert sum(sizes) == target
    assert all(1 <= b <= m and b % q == 0 for b in sizes)
    assert len(plan.schedule) == world
    assert {len(rank) for rank in plan.schedule} == {plan.accumulation_steps}
    assert max(sizes) - min(sizes) <= q
    assert plan.micro_batch == max(sizes)
    assert plan.uniform == (len(set(sizes)) == 1)
    assert sum(plan.per_rank_batch) == target


# ---- properties ---------------------------------------------------------------------------------

numbers = dict(world=st.integers(1, 16), m=st.integers(1, 600), q=st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=200, deadline=None)
@given(target=st.integers(1, 5000), **numbers)
def test_plan_is_exact_and_minimal(target, world, m, q):
    try:
        plan = make_plan(target, m, world_size=world, multiple_of=q)
    except PlanError:
        # No k gives world x k multiples of q in [q, m] summing to target.
        assert target < world or m < q or target % q or not any(
            world * k * q <= target <= world * k * (m // q) * q for k in range(1, target + 1))
        return
    check_plan(plan, target, m, world, q)
    k = plan.accumulation_steps
    assert k == 1 or target > world * (k - 1) * (m // q) * q, "fewer steps would hold the target"
    if uniform_at(target, m, world, q, k):
        assert plan.uniform


@settings(max_examples=200, deadline=None)
@given(target=st.integers(1, 200), **numbers)
def test_plan_matches_brute_force(target, world, m, q):
    best = brute_steps(target, m, world, q)
    try:
        plan = make_plan(target, m, world_size=world, multiple_of=q)
    except PlanError:
        assert best is None
        return
    check_plan(plan, target, m, world, q)
    assert plan.accumulation_steps == best
    assert plan.uniform == uniform_at(target, m, world, q, best)


@settings(max_examples=200, deadline=None)
@given(units=st.integers(1, 200), **numbers)
def test_uniform_demand_matches_brute_force(units, world, m, q):
    target = units * q
    least = brute_steps(target, m, world, q)
    try:
        plan = make_plan(target, m, world_size=world, multiple_of=q, uniform=True)
    except PlanError:
        assert least is None or not any(uniform_at(target, m, world, q, k) for k in range(least, 2 * least + 1))
        return
    check_plan(plan, target, m, world, q)
    k = plan.accumulation_steps
    assert plan.uniform and least <= k <= 2 * least
    assert not any(uniform_at(target, m, world, q, j) for j in range(least, k))


@settings(max_examples=200, deadline=None)
@given(units=st.integers(1, 200), **numbers)
def test_forced_uniform_matches_brute_force(units, world, m, q):
    """uniform='force': equal micro-batches with the fewest steps that allow them, however many."""
    target = units * q
    least = brute_steps(target, m, world, q)
    try:
        plan = make_plan(target, m, world_size=world, multiple_of=q, uniform="force")
    except PlanError:
        assert least is None or not any(uniform_at(target, m, world, q, k) for k in range(least, target + 1))
        return
    check_plan(plan, target, m, world, q)
    k = plan.accumulation_steps
    assert plan.uniform and k >= least
    assert not any(uniform_at(target, m, world, q, j) for j in range(least, k))
    try:
        within = make_plan(target, m, world_size=world, multiple_of=q, uniform=True)
    except NoUniformPlan:
        assert k > 2 * least
    else:
        assert within == plan  # the same plan wherever uniform=True finds one


def test_forced_uniform_takes_as_many_steps_as_it_needs():
    plan = make_plan(1021, 300, uniform="force")  # 1021 is prime
    assert plan.arithmetic == "1021 = 1 x 1021 steps x 1 rank"
    assert "equal micro-batches take 1021 steps instead of the 4 that micro-batches of 300 allow" in plan.notes
    assert make_plan(1000, 7, uniform="force").arithmetic == "1000 = 5 x 200 steps x 1 rank"
    assert make_plan(3 * 1021, 300, world_size=3, uniform="force").arithmetic == "3063 = 1 x 1021 steps x 3 ranks"


def test_forced_uniform_errors_name_the_fix():
    with pytest.raises(PlanError, match=r"uniform='force': target 1021 does not split into equal micro-batches on "
                                        r"2 ranks: every step takes a multiple of 2 samples: use target 1020 or 1022"):
        make_plan(1021, 300, world_size=2, uniform="force")
    with pytest.raises(PlanError, match=r"uniform='force' needs 999999937 steps for target 999999937: "
                                        r"999,999,937 micro-batches per optimizer step"):
        make_plan(999_999_937, 10**6, uniform="force")  # prime: one sample a step, more steps than a plan may hold


def test_no_uniform_plan_carries_its_numbers_and_offers_the_forced_plan():
    with pytest.raises(NoUniformPlan) as info:
        make_plan(1021, 300, world_size=1, uniform=True)
    error = info.value
    assert (error.target, error.max_micro_batch, error.world_size, error.multiple_of) == (1021, 300, 1, 1)
    assert "uniform='force' for 1021 = 1 x 1021 steps x 1 rank" in str(error)


# ---- arithmetic people check by hand ------------------------------------------------------------


@pytest.mark.parametrize("target, m, world, q, schedule, arithmetic", [
    (1024, 300, 1, 1, ((256,) * 4,), "1024 = 256 x 4 steps x 1 rank"),
    (1000, 300, 1, 1, ((250,) * 4,), "1000 = 250 x 4 steps x 1 rank"),
    (1021, 300, 1, 1, ((255, 255, 255, 256),), "1021 = 3 x 255 + 1 x 256 over 4 steps x 1 rank"),
    (1024, 32, 8, 1, ((32,) * 4,) * 8, "1024 = 32 x 4 steps x 8 ranks"),
    (100, 300, 1, 1, ((100,),), "100 = 100 x 1 step x 1 rank"),
    (1024, 1024, 4, 1, ((256,),) * 4, "1024 = 256 x 1 step x 4 ranks"),
    (10, 2, 4, 1, ((1, 1), (1, 1), (1, 2), (1, 2)), "10 = 6 x 1 + 2 x 2 over 2 steps x 4 ranks"),
    (40, 12, 1, 8, ((8,) * 5,), "40 = 8 x 5 steps x 1 rank"),
    (40, 16, 1, 8, ((8, 16, 16),), "40 = 1 x 8 + 2 x 16 over 3 steps x 1 rank"),
    (48, 300, 2, 8, ((24,), (24,)), "48 = 24 x 1 step x 2 ranks"),
])
def test_arithmetic_table(target, m, world, q, schedule, arithmetic):
    plan = make_plan(target, m, world_size=world, multiple_of=q)
    assert plan.schedule == schedule
    assert plan.arithmetic == arithmetic
    assert plan.accumulation_steps == len(schedule[0])


def test_fewest_steps_beats_uniform_by_default():
    # 128 per rank with at most 48: 3 uneven steps (42/43) rather than 4 equal ones of 32.
    plan = make_plan(1024, 48, world_size=8)
    assert (plan.accumulation_steps, plan.micro_batch, plan.uniform) == (3, 43, False)
    assert plan.arithmetic == "1024 = 8 x 42 + 16 x 43 over 3 steps x 8 ranks"
    assert any("equal micro-batches would give 1024 = 32 x 4 steps x 8 ranks" in note for note in plan.notes)
    assert make_plan(1024, 48, world_size=8, uniform=False) == plan
    uniform = make_plan(1024, 48, world_size=8, uniform=True)
    assert uniform.arithmetic == "1024 = 32 x 4 steps x 8 ranks"
    assert any("4 steps instead of the 3" in note for note in uniform.notes)


def test_k_one_summary_says_no_accumulation():
    plan = make_plan(64, 300)
    assert plan.accumulation_steps == 1
    assert "k = 1: the whole per-rank batch fits, no accumulation" in plan.summary()
    assert "k = 1" not in make_plan(1024, 300).summary()


def test_nearest_uniform_targets():
    assert nearest_uniform_targets(1021, 300) == (1020, 1022)
    assert nearest_uniform_targets(1021, 300, world_size=8, multiple_of=8) == (960, 1024)


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_batch=0), r"target_batch 0 must be at least 1"),
    (dict(target_batch=-8), r"target_batch -8 must be at least 1"),
    (dict(target_batch=1.5), r"target_batch 1\.5 is not a whole number"),
    (dict(target_batch="8"), r"target_batch '8' is a string, not a whole number: give the number itself, 8"),
    (dict(target_batch=True), r"target_batch True is not a whole number"),
    (dict(max_micro_batch=0), r"max_micro_batch 0 must be at least 1"),
    (dict(world_size=0), r"world_size 0 must be at least 1"),
    (dict(target_batch=4, world_size=8), r"target_batch 4 is smaller than the world size 8: every rank needs at least "
                                         r"one sample per step"),
    (dict(multiple_of=0), r"multiple_of 0 must be at least 1"),
    (dict(max_micro_batch=6, multiple_of=8), r"max micro-batch 6 is smaller than multiple_of 8.*multiple_of 6"),
    (dict(target_batch=1023, multiple_of=8), r"target_batch 1023 is not a multiple of multiple_of 8: use target 1016 "
                                             r"or 1024"),
    (dict(target_batch=4, multiple_of=8), r"target_batch 4 is not a multiple of multiple_of 8: use target 8,"),
    (dict(target_batch=8, world_size=4, multiple_of=4), r"every rank needs at least 4 samples per step \(16 in all\)"),
    (dict(target_batch=5, max_micro_batch=1, world_size=4), r"every step takes 4 samples over 4 ranks: "
                                                            r"use target 4 or 8"),
    (dict(uniform="yes"), r"uniform 'yes' must be True, False, None or 'force'"),
])
def test_errors(kwargs, match):
    args = dict(target_batch=1024, max_micro_batch=300) | kwargs
    with pytest.raises(PlanError, match=match) as info:
        make_plan(args.pop("target_batch"), args.pop("max_micro_batch"), **args)
    assert info.value.field in ("target_batch", "max_micro_batch", "world_size", "multiple_of", "uniform")
    if len(kwargs) == 1 and "must be at least 1" in str(info.value):  # a value below its limit: all of it as data
        [(name, value)] = kwargs.items()
        assert (info.value.field, info.value.value, info.value.limit) == (name, value, 1)


def test_uniform_prime_target_names_nearest_targets_and_the_uneven_plan():
    with pytest.raises(PlanError) as info:
        make_plan(1021, 300, uniform=True)
    message = str(info.value)
    assert "\n" not in message
    assert "1020 (1020 = 255 x 4 steps x 1 rank)" in message
    assert "1022 (1022 = 146 x 7 steps x 1 rank)" in message
    assert "drop uniform=True for 1021 = 3 x 255 + 1 x 256 over 4 steps x 1 rank" in message


def test_target_is_never_changed():
    for target in (1, 7, 1021, 4099):
        assert make_plan(target, 300).target_batch == target


# ---- world size -------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, env, expected", [
    (8, {"WORLD_SIZE": "4"}, (8, "flag")),
    (None, {"WORLD_SIZE": "4"}, (4, "WORLD_SIZE")),
    (None, {"WORLD_SIZE": " 2 "}, (2, "WORLD_SIZE")),
    (None, {}, (1, "default")),
])
def test_world_size_from(flag, env, expected):
    assert world_size_from(flag, env) == expected


@pytest.mark.parametrize("flag, env, match", [
    (None, {"WORLD_SIZE": "abc"}, r"WORLD_SIZE='abc' is not a whole number"),
    (None, {"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' is not a whole number of at least 1"),
    (None, {"WORLD_SIZE": ""}, r"WORLD_SIZE='' is not"),
    (0, {}, r"world_size 0 must be"),
])
def test_world_size_from_errors(flag, env, match):
    with pytest.raises(PlanError, match=match):
        world_size_from(flag, env)


# ---- the Plan dataclass -----------------------------------------------------------------------


def probe_result(**overrides) -> ProbeResult:
    fields = dict(
        workload="mlp", device=DeviceInfo(name="cpu", kind="cpu", estimated=False, capacity_bytes=1024 * MiB,
                                          capacity_source="memory budget", measured_by="live tensor-storage bytes",
                                          summary="cpu, capacity 1.0 GiB (memory budget)", torch="2.13.0",
                                          budget_bytes=1024 * MiB),
        estimated=False, max_micro_batch=256, max_batch=1024, capacity_bytes=1024 * MiB,
        usable_bytes=921 * MiB, margin=0.1, peak_bytes=800 * MiB, predicted_peak_bytes=792 * MiB,
        breakdown={"parameters": 10 * MiB, "activations": 700 * MiB}, limited_by="memory",
        estimate_error=-0.0125, notes=("estimate within 1.3% of the real peak",),
        curve=((2, 30 * MiB), (3, 33 * MiB)), curve_lines=((24.0 * MiB, 3.0 * MiB),),
        trials=(
            Trial(batch=256, source="estimate", peak_bytes=792 * MiB, fits=True, seconds=0.02),
            Trial(batch=512, source="real", peak_bytes=None, fits=False, seconds=0.5, oom=True,
                  why="CUDA out of memory. Tried to allocate 2.00 GiB"),
            Trial(batch=256, source="real", peak_bytes=800 * MiB, fits=True, seconds=0.3),
        ),
        seconds=1.25, options={"margin": 0.1, "max_batch": 1024},
    )
    return ProbeResult(**(fields | overrides))


TUNED = Candidate(micro_batch=128, accumulation_steps=8, samples_per_s=1234.5, seconds_per_step=0.83,
                  baseline=True, head_to_head=HeadToHead(ratio=1.0, uncertainty=0.0, rounds=3))


def roundtrip(plan: Plan) -> Plan:
    return Plan.from_dict(json.loads(dumps(plan.to_dict())), source="plan.json")


@pytest.mark.parametrize("plan", [
    make_plan(1021, 300, world_size=1),
    make_plan(1024, 48, world_size=8, world_size_source="WORLD_SIZE"),
    make_plan(1024, 256, probe=probe_result()),
    make_plan(1000, 256, probe=probe_result(estimated=True)),
    Plan(target_batch=1024, world_size=1, micro_batch=128, accumulation_steps=8, schedule=((128,) * 8,),
         uniform=True, max_micro_batch=256, probe=probe_result(), notes=("tuned",),
         tuning=Tuning(candidates=(TUNED,), chosen=TUNED, baseline=TUNED, fastest=TUNED, ratio=1.0, trials=1,
                       measured=1, study_name="s")),
], ids=["uneven", "ranks", "probe", "estimated-probe", "tuned"])
def test_json_roundtrip_is_exact(plan):
    again = roundtrip(plan)
    assert again == plan
    assert again.to_dict() == plan.to_dict()
    data = plan.to_dict()
    assert data["kind"] == "autotune.Plan" and data["arithmetic"] == plan.arithmetic
    assert data["per_rank_batch"] == list(plan.per_rank_batch)


def test_memory_figures_from_the_probe():
    probe = probe_result()
    at_max = make_plan(1024, 256, probe=probe)
    assert at_max.predicted_peak_bytes == 800 * MiB  # measured, not estimated
    assert at_max.headroom_bytes == 121 * MiB
    smaller = make_plan(1000, 256, probe=probe)  # 250 x 4
    assert smaller.predicted_peak_bytes == 24 * MiB + 3 * MiB * 250
    estimated = make_plan(1024, 256, probe=probe_result(estimated=True))
    assert estimated.predicted_peak_bytes == 24 * MiB + 3 * MiB * 256
    bare = make_plan(1024, 256)
    assert bare.predicted_peak_bytes is None and bare.headroom_bytes is None


def test_summary_with_probe():
    plan = make_plan(1024, 256, probe=probe_result(), world_size_source="flag")
    text = plan.summary()
    assert text.splitlines()[0] == "plan: 1024 = 256 x 4 steps x 1 rank"
    for part in (format_bytes(800 * MiB), format_bytes(921 * MiB), format_bytes(121 * MiB), "mlp",
                 "cpu, capacity 1.0 GiB (memory budget)", "confirmed by a real run",
                 "world size 1 from the world size given"):
        assert part in text
    assert "estimated, not confirmed" in make_plan(1024, 256, probe=probe_result(estimated=True)).summary()


def test_note_when_max_is_above_the_probe():
    plan = make_plan(1024, 512, probe=probe_result())
    assert any("above the probed 256" in note for note in plan.notes)


@pytest.mark.parametrize("change, match", [
    (dict(schedule=((256, 256, 256, 255),)), r"sums to 1023"),
    (dict(schedule=((256, 256, 256), (256,))), r"ranks"),
    (dict(world_size=2, schedule=((256, 256, 256), (256,))), r"every rank must run"),
    (dict(max_micro_batch=200), r"in \[1, 200\]"),
    (dict(micro_batch=300), r"not the largest size 256"),
    (dict(uniform=False), r"uniform=False"),
    (dict(multiple_of=3), r"multiple of 3"),
    (dict(target_batch=True), r"target_batch True is not a whole number"),
    (dict(schedule=((256.0, 256, 256, 256),)), r"sizes must be integers"),
])
def test_plan_validates_itself(change, match):
    fields = dict(target_batch=1024, world_size=1, micro_batch=256, accumulation_steps=4,
                  schedule=((256,) * 4,), uniform=True, max_micro_batch=300)
    with pytest.raises(ValueError, match=match):
        Plan(**(fields | change))


def test_from_dict_rejects_other_files():
    data = make_plan(1024, 300).to_dict()
    with pytest.raises(ResultFileError, match=r"holds a ProbeResult, not a Plan"):
        Plan.from_dict(probe_result().to_dict(), source="probe.json")
    with pytest.raises(ResultFileError, match=r"plan.json: not a valid Plan \(schedule sums to 1023"):
        Plan.from_dict(data | {"schedule": [[256, 256, 256, 255]]}, source="plan.json")
    with pytest.raises(ResultFileError, match=r"plan.json: not a valid Plan"):
        Plan.from_dict(data | {"surprise": 1}, source="plan.json")


# ---- limits: huge inputs are refused at once, never materialised --------------------------------



def test_plans_at_the_limits_are_made():
    plan = make_plan(MAX_MICRO_BATCHES, 1, world_size=1000)
    assert plan.accumulation_steps * plan.world_size == MAX_MICRO_BATCHES and plan.uniform
    top = make_plan(MAX_TARGET_BATCH, MAX_TARGET_BATCH // 1000, world_size=1000)
    assert top.arithmetic == "1000000000 = 1000000 x 1 step x 1000 ranks"


def test_plan_refuses_schedules_past_the_limits():
    with pytest.raises(ValueError, match=r"target_batch 1000000001 is more than 1,000,000,000"):
        Plan(target_batch=MAX_TARGET_BATCH + 1, world_size=1, micro_batch=MAX_TARGET_BATCH + 1, accumulation_steps=1,
             schedule=((MAX_TARGET_BATCH + 1,),), uniform=True, max_micro_batch=MAX_TARGET_BATCH + 1)


# Huge inputs run in a child process with 2 GiB of address space and a timeout: work that grows with
# the target or with world x steps fails there quickly instead of taking this machine's memory.
HUGE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from autotune.errors import PlanError
from autotune.planning import make_plan, nearest_uniform_targets
cases = [
    lambda: make_plan(10**15, 300),
    lambda: make_plan(10**9, 256, world_size=10**9),
    lambda: make_plan(10**9, 1),
    lambda: make_plan(10**9, 999),
    lambda: make_plan(2 * 1_100_009, 3, uniform=True),
    lambda: make_plan(10**9 - 1, 1, world_size=7),
    lambda: make_plan(999_999_937, 10**6, uniform=True),
    lambda: make_plan(999_999_937, 999_999, multiple_of=2),
    lambda: make_plan(999_999_000, 10**6, world_size=999_999).arithmetic,
    lambda: nearest_uniform_targets(999_999_937, 40_000),
    lambda: nearest_uniform_targets(999_999_937, 25_000, world_size=3, multiple_of=2),
]
for case in cases:
    try:
        print("ok", case(), flush=True)
    except PlanError as exc:
        print("refused", exc, flush=True)
"""

HUGE_ANSWERS = [
    r"refused target_batch 1000000000000000 is more than the 1,000,000,000 samples per optimizer step a plan may hold",
    (r"refused 1000000000 ranks run at least 1,000,000,000 micro-batches per optimizer step \(1000000000 ranks x "
     r"1 step\), more than the 1,000,000 a plan may hold: use a larger max micro-batch, fewer ranks"),
    (r"refused target 1000000000 with micro-batches of at most 1 needs 1,000,000,000 micro-batches per optimizer "
     r"step \(1 rank x 1000000000 steps\)"),
    r"refused target 1000000000 with micro-batches of at most 999 needs 1,001,002 micro-batches",
    r"refused uniform=True needs 1100009 steps for target 2200018: 1,100,009 micro-batches",
    r"refused target_batch 999999999 cannot be split: .*use target 999999994 or 1000000001,",
    (r"refused uniform=True: target 999999937 does not split .* nearest targets that do: 999999936 \(999999936 = "
     r"926784 x 1079 steps x 1 rank\) and 999999940 \(999999940 = 846740 x 1181 steps x 1 rank\)"),
    r"refused target_batch 999999937 is not a multiple of multiple_of 2: use target 999999936 or 999999938",
    r"ok 999999000 = 1000 x 1 step x 999999 ranks",
    r"ok \(999999936, 999999940\)",
    r"ok \(999999936, 999999960\)",
]


def test_huge_inputs_answer_at_once():
    done = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == len(HUGE_ANSWERS), done.stdout
    for line, answer in zip(lines, HUGE_ANSWERS):
        assert re.match(answer, line), (line, answer)


def test_nearest_uniform_targets_for_large_numbers():
    # 999999937 is prime: no equal split of it, and the search for neighbours that split is bounded.
    below, above = nearest_uniform_targets(999_999_937, 40_000)
    for t in (below, above):
        plan = make_plan(t, 40_000, uniform=True)
        assert plan.uniform and plan.target_batch == t
    assert below < 999_999_937 < above


def reference_nearest(target: int, m: int, world: int, q: int) -> tuple[int | None, int | None]:
    """Nearest targets below and above that plan with equal micro-batches, by trying each one."""
    def uniform(t: int) -> bool:
        least = brute_steps(t, m, world, q)
        return least is not None and any(uniform_at(t, m, world, q, k) for k in range(least, 2 * least + 1))
    below = next((t for t in range(target - 1, 0, -1) if t % q == 0 and uniform(t)), None)
    above = next(t for t in range(target + 1, 10 * target + 10 * m * world) if t % q == 0 and uniform(t))
    return below, above


@settings(max_examples=150, deadline=None)
@given(target=st.integers(1, 150), world=st.integers(1, 6), m=st.integers(1, 60), q=st.sampled_from([1, 2, 4]))
def test_nearest_uniform_targets_match_brute_force(target, world, m, q):
    if m < q:
        return
    assert nearest_uniform_targets(target, m, world_size=world, multiple_of=q) == reference_nearest(target, m, world, q)


@settings(max_examples=150, deadline=None)
@given(target=st.integers(1, 150), world=st.integers(1, 6), m=st.integers(1, 60), q=st.sampled_from([1, 2, 4]))
def test_suggested_targets_can_be_planned(target, world, m, q):
    """Every target an error suggests plans, and none closer would."""
    try:
        make_plan(target, m, world_size=world, multiple_of=q)
    except PlanError as exc:
        message = str(exc)
        if "use target " not in message:
            return
        words = message.split("use target ")[1].split(",")[0].split(" or ")
        for word in words:
            suggested = int(word.split()[0])
            make_plan(suggested, m, world_size=world, multiple_of=q)
            between = range(min(suggested, target) + 1, max(suggested, target))
            assert not any(brute_steps(t, m, world, q) for t in between if t % q == 0)
