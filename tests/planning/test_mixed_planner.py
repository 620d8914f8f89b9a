"""Mixed ranks in the planner: each rank its own micro-batch and micro-steps, the sum exact, the slowest rank's
time the least any split has (checked against brute force), and the Plan that carries it."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.errors import PlanError, RanksDiffer, ResultFileError
from autotune.planning.exports import export
from autotune.planning.mixed import even_row, least_time, make_mixed_plan, split_ranks, water_fill
from autotune.planning.planner import make_plan
from autotune.results.plan import Plan
from autotune.results.ranks import MixedRanks, RankShare
from autotune.serial import dumps

MiB = 2**20


def brute_least_time(target: int, maxima: list[int], times: list[Fraction] | None, q: int = 1) -> Fraction:
    """The least max_r k_r x s_r over every vector of micro-step counts that can hold the target (each micro-batch
    a multiple of q in [q, m_r]), found by trying them all."""
    units, unit_max = target // q, [m // q for m in maxima]
    s = [Fraction(1)] * len(maxima) if times is None else [t * u * q for t, u in zip(times, unit_max)]
    best = None
    for ks in itertools.product(range(1, units + 1), repeat=len(maxima)):
        if sum(ks) <= units <= sum(k * u for k, u in zip(ks, unit_max)):
            z = max(k * si for k, si in zip(ks, s))
            best = z if best is None or z < best else best
    assert best is not None
    return best


def model_time(rows, maxima, times, q=1) -> Fraction:
    s = [Fraction(1)] * len(maxima) if times is None else [Fraction(t) * (m // q) * q for t, m in zip(times, maxima)]
    return max(len(row) * si for row, si in zip(rows, s))


@pytest.mark.parametrize("target, maxima, times, q, lockstep, rows", [
    # by memory: the fewest micro-steps on the slowest rank, then samples as even as the ranks hold
    (400, [300, 100], None, 1, False, ((300,), (100,))),
    (255, [700, 150], None, 1, False, ((128,), (127,))),  # one micro-step each either way: as even as can be
    (1021, [700, 150], None, 1, False, ((360, 361), (150, 150))),
    (1021, [700, 150], None, 1, True, ((360, 361), (150, 150))),
    # by time: an A100-like rank 8x faster per sample than a T4-like one takes the larger share
    (1024, [512, 96], [0.0002, 0.0016], 1, False, ((464, 464), (96,))),
    # equal maxima, one rank twice as fast: it takes two thirds
    (300, [200, 200], [1.0, 2.0], 1, False, ((200,), (100,))),
    # a fast rank with a tiny micro-batch runs many micro-steps within the slow rank's one
    (200, [100, 1], [1.0, 0.01], 1, False, ((2,), (1,) * 198)),
    # multiple_of: sizes in units of q
    (96, [64, 16], None, 8, False, ((64,), (16, 16))),
    # in step (FSDP): every rank the same micro-steps, shares by speed within their memory
    (1021, [300, 100], [1.0, 3.0], 1, True, ((255, 255, 256), (85, 85, 85))),
])
def test_split_table(target, maxima, times, q, lockstep, rows):
    split = split_ranks(target, maxima, times, multiple_of=q, lockstep=lockstep)
    if rows is not None:
        assert split.rows == rows
    assert sum(map(sum, split.rows)) == target
    assert all(b % q == 0 and q <= b <= m for row, m in zip(split.rows, maxima) for b in row)
    assert split.by == ("time" if times else "memory")
    if lockstep:
        assert len({len(row) for row in split.rows}) == 1
    else:
        assert model_time(split.rows, maxima, times, q) == split.model_time


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 24), st.integers(1, 3),
       st.one_of(st.none(), st.lists(st.integers(1, 7), min_size=3, max_size=3)))
def test_split_is_exact_within_bounds_and_the_slowest_rank_as_fast_as_brute_force(maxima, target, q, speeds):
    maxima = [m * q for m in maxima]
    target *= q
    times = None if speeds is None else [Fraction(1, s) for s in speeds[:len(maxima)]]
    if target // q < len(maxima):
        with pytest.raises(PlanError, match="every rank needs at least"):
            split_ranks(target, maxima, times and [float(t) for t in times], multiple_of=q)
        return
    floats = None if times is None else [float(t) for t in times]
    split = split_ranks(target, maxima, floats, multiple_of=q)
    assert sum(map(sum, split.rows)) == target  # the exact sum
    for row, m in zip(split.rows, maxima):
        assert row and all(q <= b <= m and b % q == 0 for b in row)  # each within its rank's max, at least one unit
        assert max(row) - min(row) <= q  # as even as can be
        assert len(row) == -(-sum(row) // (m // q * q))  # the fewest micro-steps its share needs
    exact = None if floats is None else [Fraction(t) for t in floats]
    assert model_time(split.rows, maxima, floats, q) == brute_least_time(target, maxima, exact, q)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=6), st.integers(0, 400),
       st.lists(st.integers(1, 9), min_size=6, max_size=6))
def test_water_fill_sums_exactly_within_bounds_in_proportion(highs, extra, weights):
    low = [1] * len(highs)
    total = min(len(highs) + extra, sum(highs))
    w = [float(x) for x in weights[:len(highs)]]
    shares = water_fill(total, w, low, highs)
    assert sum(shares) == total and all(1 <= n <= h for n, h in zip(shares, highs))
    # in proportion where the bounds allow: no unit moved from a rank above its low to one below its high would
    # bring both closer to their weights' proportion (rounding is within one unit)
    for i, j in itertools.permutations(range(len(highs)), 2):
        if shares[i] < highs[i] and shares[j] > low[j]:
            assert (shares[i] + 1) / w[i] >= (shares[j] - 1) / w[j] - 1e-9


def test_least_time_is_exact_on_fractions():
    times = [Fraction(3, 7), Fraction(5, 11)]
    assert least_time(10, [2, 3], times) == brute_least_time(10, [2 * 1, 3], [Fraction(3, 14), Fraction(5, 33)])


def test_even_row_puts_the_smaller_first():
    assert even_row(7, 3, 1) == (2, 2, 3) and even_row(6, 3, 8) == (16, 16, 16)


def test_large_targets_and_many_ranks_are_planned_without_loops_to_the_target():
    split = split_ranks(10**9, [10**6, 3], [1e-6, 1e-3])
    assert sum(map(sum, split.rows)) == 10**9
    many = split_ranks(10**6, list(range(100, 1100)), [1e-3 + i * 1e-6 for i in range(1000)])
    assert sum(map(sum, many.rows)) == 10**6


@pytest.mark.parametrize("target, maxima, times, q, match", [
    (1, [4, 4], None, 1, "every rank needs at least 1 sample per step"),
    (16, [4, 2], None, 4, "rank 1's max micro-batch 2 is smaller than multiple_of 4"),
    (18, [8, 8], None, 4, "target_batch 18 is not a multiple of multiple_of 4: use target 16 or 20"),
    (10, [4, 4], [1.0], 1, "1 times per sample for 2 ranks"),
    (10, [4, 4], [1.0, 0.0], 1, "rank 1's time per sample 0.0 must be a positive number"),
    (10, [4, 0], None, 1, "rank 1's max micro-batch 0 must be at least 1"),
    (3 * 10**6, [1, 1], None, 1, "more than the 1,000,000 a plan may hold"),
])
def test_split_errors_name_the_rank_and_the_fix(target, maxima, times, q, match):
    with pytest.raises(PlanError, match=match):
        split_ranks(target, maxima, times, multiple_of=q)


def test_in_step_a_target_below_one_unit_per_micro_step_is_refused():
    with pytest.raises(PlanError, match="cannot be split in step"):
        split_ranks(3, [1, 1], lockstep=True)


# ---- the Plan ---------------------------------------------------------------------------------


def shares(*maxima, times=None, timed_by="roofline"):
    return [RankShare(device=f"estimate:GPU{i}", max_micro_batch=m, usable_bytes=(m + 1) * MiB, budget_bytes=None,
                      seconds_per_sample=None if times is None else times[i],
                      timed_by=None if times is None else timed_by)
            for i, m in enumerate(maxima)]


def test_a_mixed_plan_gives_the_faster_larger_rank_the_larger_share_and_says_what_it_gains():
    plan = make_mixed_plan(1024, shares(512, 96, times=[0.0002, 0.0016]), peak_of=lambda r, b: b * MiB)
    assert plan.per_rank_batch == (928, 96) and plan.schedule == ((464, 464), (96,))
    assert plan.accumulation_steps == 2 and plan.micro_batch == 464 and plan.max_micro_batch == 512
    assert plan.mixed is not None and plan.mixed.balanced_by == "time"
    assert [r.peak_bytes for r in plan.mixed.ranks] == [464 * MiB, 96 * MiB]
    assert plan.usable_bytes_of(1) == 97 * MiB and plan.predicted_peak_of(1) == 96 * MiB
    smallest = make_plan(1024, 96, world_size=2)
    assert plan.mixed.uniform_per_rank == smallest.per_rank_batch and plan.mixed.uniform_steps == 6
    assert plan.mixed.step_seconds == pytest.approx(928 * 0.0002)
    assert plan.mixed.uniform_step_seconds == pytest.approx(512 * 0.0016)
    text = plan.summary()
    assert "plan: 1024 = 928 + 96 over 2 ranks" in text
    assert "rank 0 (estimate:GPU0): 928 samples = 2 x 464; max micro-batch 512, peak 464.0 MiB" in text
    assert "200 us per sample (roofline)" in text
    assert ("samples per rank 928, 96 instead of 512, 512; predicted step 186 ms instead of 819 ms (4.41x the "
            "samples per second)") in text


def test_ranks_alike_get_the_ordinary_plan_and_say_so():
    plain = make_plan(255, 112, world_size=2)
    for alike in (make_mixed_plan(255, shares(112, 112)), make_mixed_plan(255, shares(112, 112, times=[1e-3, 1e-3]))):
        assert alike.mixed is None and replace(alike, notes=plain.notes) == plain and alike.notes[:-1] == plain.notes
        assert alike.notes[-1] == "every rank runs the same plan: their max micro-batches are alike (112)"
    half_timed = shares(112, 112)
    half_timed[1] = replace(half_timed[1], seconds_per_sample=1e-3, timed_by="roofline")  # a CPU and a GPU by name
    said = make_mixed_plan(255, half_timed).notes[-1]
    assert said.endswith("alike (112), and the time per sample of some is not known, so speed cannot tell them apart")


def test_by_memory_the_slowest_rank_runs_fewer_micro_steps_than_the_smallest_for_all():
    plan = make_mixed_plan(1021, shares(700, 150))
    assert plan.per_rank_batch == (721, 300) and plan.mixed.balanced_by == "memory"
    assert plan.mixed.step_seconds is None
    assert "the slowest rank runs 2 micro-steps instead of 4" in plan.summary()


def test_some_speeds_unknown_is_a_split_by_memory_that_says_so():
    ranks = shares(700, 150, times=[0.1, 0.1])
    ranks[1] = RankShare(device="cpu", max_micro_batch=150, usable_bytes=MiB)
    plan = make_mixed_plan(1021, ranks)
    assert plan.mixed.balanced_by == "memory"
    assert any("time per sample of rank 1 is not known" in n for n in plan.notes)


def test_fsdp_runs_the_ranks_in_step():
    plan = make_mixed_plan(1021, shares(300, 100, times=[1.0, 3.0]), parallel="fsdp")
    assert plan.schedule == ((255, 255, 256), (85, 85, 85)) and plan.parallel == "fsdp"
    assert plan.mixed.step_seconds == pytest.approx(255 + 255 + 256)  # each micro-step as long as its slowest rank


@pytest.mark.parametrize("uniform", [True, "force"])
def test_equal_micro_batches_on_ranks_that_differ_name_uniform_ranks(uniform):
    with pytest.raises(RanksDiffer, match=r"max micro-batch per rank: 700, 150\): pass uniform_ranks=True for the "
                                          r"smallest-for-all plan \(every rank at most 150\)") as info:
        make_mixed_plan(1021, shares(700, 150), uniform=uniform)
    assert info.value.maxima == (700, 150)


def test_framework_exports_refuse_a_mixed_plan():
    plan = make_mixed_plan(1024, shares(512, 96, times=[0.0002, 0.0016]))
    with pytest.raises(PlanError, match="one per-device batch size.*uniform_ranks=True"):
        export(plan, "hf")


def test_a_mixed_plan_round_trips_through_json_and_is_validated():
    plan = make_mixed_plan(1024, shares(512, 96, times=[0.0002, 0.0016]), peak_of=lambda r, b: b * MiB)
    data = json.loads(dumps(plan.to_dict()))
    assert Plan.from_dict(data) == plan
    assert data["mixed"]["ranks"][1]["max_micro_batch"] == 96
    data["schedule"][1] = [48, 48]
    data["schedule"][0] = [928]
    with pytest.raises(ResultFileError, match="rank 0's micro-batch 928 is above its max micro-batch 512"):
        Plan.from_dict(data)
    bad = json.loads(dumps(plan.to_dict()))
    bad["mixed"]["ranks"][0]["timed_by"] = "guessed"
    with pytest.raises(ResultFileError, match="timed_by must be one of"):
        Plan.from_dict(bad)


def test_a_mixed_plans_json_has_no_one_figure_for_what_differs_per_rank():
    """M19: micro_batch x accumulation_steps x world_size is no figure of a mixed plan (here 464 x 2 x 2 = 1856 for a
    target of 1024), nor is rank 0's peak the plan's: the JSON holds null there and each rank's figures per rank;
    a file written before, with rank 0's figures, still reads as the same plan."""
    plan = make_mixed_plan(1024, shares(512, 96, times=[0.0002, 0.0016]), peak_of=lambda r, b: b * MiB)
    data = json.loads(dumps(plan.to_dict()))
    assert [data[k] for k in ("micro_batch", "accumulation_steps", "predicted_peak_bytes", "headroom_bytes")] == \
        [None] * 4
    assert [(r["peak_bytes"], r["headroom_bytes"]) for r in data["mixed"]["ranks"]] == [(464 * MiB, 49 * MiB),
                                                                                        (96 * MiB, 1 * MiB)]
    assert data["per_rank_batch"] == [928, 96] and data["schedule"] == [[464, 464], [96]]
    read = Plan.from_dict(data)
    assert read == plan and (read.micro_batch, read.accumulation_steps) == (464, 2)
    assert plan.predicted_peak_bytes is None and plan.headroom_bytes is None and plan.predicted_peak_of(1) == 96 * MiB
    old = {**data, "micro_batch": 464, "accumulation_steps": 2, "predicted_peak_bytes": 464 * MiB,
           "headroom_bytes": 49 * MiB}
    for share in old["mixed"]["ranks"]:
        del share["headroom_bytes"]
    assert Plan.from_dict(old) == plan


def test_unequal_rows_need_a_mixed_plan():
    with pytest.raises(ValueError, match="every rank must run accumulation_steps=2"):
        Plan(target_batch=10, world_size=2, micro_batch=5, accumulation_steps=2, schedule=((5, 4), (1,)),
             uniform=False, max_micro_batch=5)
    mixed = MixedRanks(ranks=tuple(shares(5, 1)), balanced_by="memory")
    Plan(target_batch=10, world_size=2, micro_batch=5, accumulation_steps=2, schedule=((5, 4), (1,)),
         uniform=False, max_micro_batch=5, mixed=mixed)
