"""Mixed ranks: each rank its own micro-batch and number of micro-steps, the global batch still exact.

Pure arithmetic, no torch. Rank ``r`` holds at most ``m_r`` samples per
micro-batch (its own probe's max) and takes ``t_r`` seconds per sample at that
size (measured, or a roofline estimate), or nothing is known of its speed. The
model of a step: rank ``r`` runs ``k_r`` micro-steps, each as long as one at its
largest micro-batch, ``s_r = m_r x t_r`` seconds; its time is ``k_r x s_r`` and
the step takes the slowest rank's. When nothing is known of speed every
micro-step counts alike (``s_r = 1``): the slowest rank is the one with the
most micro-steps. Everything counts in units of ``q`` (``multiple_of``).

:func:`split_ranks`:

1. the least step time ``Z`` such that the ranks' micro-steps within it,
   ``floor(Z / s_r)`` each, hold the target (``Z`` is some ``k x s_r``: a
   bisection over exact fractions narrows it to where each rank has at most one
   such point left, then those are walked in order);
2. each rank's share of the target in proportion to its speed (``1 / t_r``
   samples per second; alike when only memory is known, every sample counted
   alike too), at least one unit and at most what its micro-steps within ``Z``
   hold (water-filling, exact, then whole units by the largest remainders), so
   the slowest rank's samples x its time per sample is as small as ``Z``
   allows;
3. each rank the fewest micro-steps its share needs, as even as possible
   (sizes differ by at most ``q``, the smaller first).

``lockstep`` (FSDP, whose every micro-step gathers parameters on all ranks
together) gives every rank the same number of micro-steps, the fewest the
ranks' memory allows, and splits the target in proportion to speed within it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from .. import options
from ..errors import DoesNotFit, PlanError, RanksDiffer, mention
from ..options import MAX_MICRO_BATCHES, MAX_TARGET_BATCH, Parallel
from ..results.plan import Plan
from ..results.probe import ProbeResult
from ..results.ranks import MixedRanks, RankShare
from ..units import format_bytes, plural
from .planner import Uniform, make_plan


@dataclass(frozen=True)
class Split:
    """Each rank's micro-batch sizes (``rows[r]``) and the step time the model gives them.

    ``by`` is "time" when every rank's time per sample was known, else "memory";
    ``model_time`` the slowest rank's ``k_r x s_r`` (seconds), or its micro-steps
    by memory; the least any split of the target has."""

    rows: tuple[tuple[int, ...], ...]
    by: str
    model_time: Fraction


def split_ranks(target: int, maxima: Sequence[int], seconds_per_sample: Sequence[float] | None = None, *,
                multiple_of: int = 1, lockstep: bool = False) -> Split:
    """Split ``target`` samples over ranks whose max micro-batches are ``maxima`` (see the module docstring).

    ``seconds_per_sample[r]``: rank ``r``'s time per sample at its max micro-batch, or None for a split by
    memory alone. Raises PlanError when no split exists (a target below one unit per rank, a rank whose
    max is below ``multiple_of``, a target that is not a multiple of it) or when it would need more than
    ``MAX_MICRO_BATCHES`` micro-batches.
    """
    units, unit_max, q = _check(target, maxima, multiple_of)
    timed = seconds_per_sample is not None
    times = _times(seconds_per_sample, unit_max, q)
    weights = [float(Fraction(u) / s) if timed else 1.0 for u, s in zip(unit_max, times)]
    if lockstep:
        steps = -(-units // sum(unit_max))
        if steps * len(unit_max) > units:
            raise PlanError(f"cannot be split in step: the ranks' memory needs {steps} micro-steps "
                            f"each, and {plural(len(unit_max), 'rank')} x {steps} micro-batches of at least {q} take "
                            f"{steps * len(unit_max) * q} samples; use a target of at least that, or give the ranks "
                            "more memory", field="target_batch", value=target)
        low, high = [steps] * len(unit_max), [steps * u for u in unit_max]
        model = steps * max(times)
    else:
        model = least_time(units, unit_max, times)
        low, high = [1] * len(unit_max), [int(model // s) * u for s, u in zip(times, unit_max)]
    shares = water_fill(units, weights, low, high)
    steps_of = [low[0] if lockstep else -(-n // u) for n, u in zip(shares, unit_max)]
    most = max(steps_of)
    if len(unit_max) * most > MAX_MICRO_BATCHES:
        raise PlanError(f"target {target} over {plural(len(unit_max), 'rank')} needs {most:,} micro-steps on one rank, "
                        f"{len(unit_max) * most:,} micro-batches in all, more than the {MAX_MICRO_BATCHES:,} a plan "
                        "may hold: use a smaller target or give the ranks more memory")
    rows = tuple(even_row(n, k, q) for n, k in zip(shares, steps_of))
    return Split(rows=rows, by="time" if timed else "memory", model_time=model)


def least_time(units: int, unit_max: Sequence[int], times: Sequence[Fraction]) -> Fraction:
    """The least ``Z = max_r k_r x times[r]`` over micro-step counts ``k_r >= 1`` whose micro-batches of at most
    ``unit_max[r]`` units hold ``units`` (``sum_r k_r x unit_max[r] >= units``).

    Every ``k_r`` at most ``floor(Z / times[r])`` keeps within ``Z``, so ``Z`` is the least point ``k x times[r]``
    at which those counts hold the units. Exact: fractions throughout."""
    rate = sum((Fraction(u) / s for u, s in zip(unit_max, times)), Fraction(0))

    def held(z: Fraction) -> int:
        return sum(int(z // s) * u for s, u in zip(times, unit_max))

    lo: Fraction = max(max(times), units / rate)  # no point below holds the units (nor runs every rank once)
    if held(lo) >= units:
        return lo  # then lo is such a point itself
    hi: Fraction = max(max(times), (units + sum(unit_max)) / rate)  # held(hi) >= hi x rate - sum(unit_max) >= units

    def points_between(a: Fraction, b: Fraction) -> int:
        return sum(int(b // s) - int(a // s) for s in times)

    while points_between(lo, hi) > len(times):  # shorter than every time: at most one point per rank left
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if held(mid) >= units else (mid, hi)
    points = sorted((k * s, u) for s, u in zip(times, unit_max) for k in range(int(lo // s) + 1, int(hi // s) + 1))
    have = held(lo)
    for z, u in points:  # equal points of several ranks are added one by one: the first that holds is the least
        have += u
        if have >= units:
            return z
    raise AssertionError("held(hi) >= units")  # pragma: no cover - hi holds the units by construction


def water_fill(total: int, weights: Sequence[float], low: Sequence[int], high: Sequence[int]) -> list[int]:
    """Whole shares ``n_r`` summing to ``total``, ``low[r] <= n_r <= high[r]``, in proportion to ``weights``
    as far as the bounds allow: ``clamp(lam x weights[r], low, high)`` for the ``lam`` whose sum is ``total``,
    rounded down, and the units left over to the largest remainders (the first rank of equals). The proportions
    are in floating point (they only share out what the bounds leave free); the sum and the bounds are exact."""
    if not sum(low) <= total <= sum(high):
        raise ValueError(f"no shares of {total} within {list(low)}..{list(high)}")
    w = [float(x) for x in weights]

    def filled(lam: float) -> float:
        return sum(min(max(lam * x, lo), hi) for x, lo, hi in zip(w, low, high))

    bends = sorted({b / x for x, lo, hi in zip(w, low, high) for b in (lo, hi)})
    first, last = 0, len(bends) - 1  # filled(bends[0]) = sum(low) <= total <= sum(high) = filled(bends[-1])
    while last - first > 1:
        middle = (first + last) // 2
        first, last = (middle, last) if filled(bends[middle]) <= total else (first, middle)
    a, b = bends[first], bends[last]
    at_a, at_b = filled(a), filled(b)
    lam = a if at_b <= at_a else a + (b - a) * (total - at_a) / (at_b - at_a)  # filled is linear on [a, b]
    exact = [min(max(lam * x, lo), hi) for x, lo, hi in zip(w, low, high)]
    shares = [min(max(math.floor(x), lo), hi) for x, lo, hi in zip(exact, low, high)]
    left = total - sum(shares)
    order = sorted(range(len(exact)), key=lambda r: (-(exact[r] - shares[r]), r))  # the largest remainder first
    while left:  # float rounding may leave a few units either way: moved where the bounds allow, in that order
        step = 1 if left > 0 else -1
        for r in order if step > 0 else reversed(order):
            if left and low[r] <= shares[r] + step <= high[r]:
                shares[r] += step
                left -= step
    return shares


def even_row(units: int, steps: int, q: int) -> tuple[int, ...]:
    """``units`` units in ``steps`` micro-batches of ``q`` samples a unit, sizes differing by at most one unit,
    the smaller first."""
    base, extra = divmod(units, steps)
    return (base * q,) * (steps - extra) + ((base + 1) * q,) * extra


def _times(seconds_per_sample: Sequence[float] | None, unit_max: Sequence[int], q: int) -> list[Fraction]:
    """Each rank's time of one micro-step at its largest micro-batch; 1 each when nothing is known of speed."""
    if seconds_per_sample is None:
        return [Fraction(1)] * len(unit_max)
    if len(seconds_per_sample) != len(unit_max):
        raise PlanError(f"{len(seconds_per_sample)} times per sample for {plural(len(unit_max), 'rank')}: give one "
                        "per rank, or none to split by memory")
    out = []
    for r, (t, u) in enumerate(zip(seconds_per_sample, unit_max)):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0 and math.isfinite(t)):
            raise PlanError(f"rank {r}'s time per sample {t!r} must be a positive number of seconds")
        out.append(Fraction(t) * u * q)
    return out


def _check(target: int, maxima: Sequence[int], q: int) -> tuple[int, list[int], int]:
    """(units, each rank's max in units, q) once a split can exist."""
    for name, value in (("target batch", target), ("multiple_of", q)):
        options.whole(value, name, text=False, error=PlanError)
    if target > MAX_TARGET_BATCH:
        raise PlanError(f"is more than the {MAX_TARGET_BATCH:,} samples per optimizer step a plan "
                        "may hold: use a smaller target batch", field="target_batch", value=target)
    if not maxima:
        raise PlanError("no ranks: give each rank's max micro-batch")
    world = len(maxima)
    if world > MAX_MICRO_BATCHES:
        raise PlanError(f"{world:,} ranks run more than the {MAX_MICRO_BATCHES:,} micro-batches a plan may hold")
    for r, m in enumerate(maxima):
        options.whole(m, f"rank {r}'s max micro-batch", text=False, error=PlanError)
        if m < q:
            raise PlanError(f"rank {r}'s max micro-batch {m} is smaller than {{multiple_of}} {q}: no micro-batch size "
                            f"is allowed there", field="multiple_of", limit=m,
                            fix=f"use {{multiple_of}} {m} or less, or give that rank more memory")
    if target % q:
        raise PlanError(f"is not a multiple of {{multiple_of}} {q}", field="target_batch", value=target,
                        fix=f"use target {target - target % q or q} or {target - target % q + q}")
    if target // q < world:
        raise PlanError(f"on {plural(world, 'rank')}: every rank needs at least {q} "
                        f"{'sample' if q == 1 else 'samples'} per step ({world * q} in all); use a target of at least "
                        f"{world * q} or fewer ranks", field="target_batch", value=target)
    return target // q, [m // q for m in maxima], q


# ---- a Plan for mixed ranks ---------------------------------------------------------------------


def differ(ranks: Sequence[RankShare]) -> bool:
    """Do the ranks differ in what a plan uses: their max micro-batch, or their (known) time per sample?"""
    times = {r.seconds_per_sample for r in ranks}
    return len({r.max_micro_batch for r in ranks}) > 1 or (len(times) > 1 and None not in times)


def how_ranks_differ(maxima: Sequence[int]) -> str:
    """How ranks differ, in words: their max micro-batches, or (those alike) their speed."""
    if len(set(maxima)) == 1:
        return f"in speed: every rank's max micro-batch is {maxima[0]}, and the faster ones get more samples"
    return "max micro-batch per rank: " + ", ".join(map(str, maxima[:8])) + (", ..." if len(maxima) > 8 else "")


def ranks_differ_error(maxima: Sequence[int], asked: str, *, fix: str = "{uniform_ranks=True}",
                       drop: str = "drop {uniform}") -> RanksDiffer:
    """The error for equal micro-batches (``asked``) on ranks that differ, naming ``fix`` for the smallest-for-all
    plan."""
    return RanksDiffer(f"{asked}, but the ranks differ ({how_ranks_differ(maxima)}): pass {fix} for the "
                       f"smallest-for-all plan (every rank at most {min(maxima)}), or {drop} for a plan that gives "
                       "each rank its own micro-batch", maxima=tuple(maxima))


def uniform_ranks_note(probes: Sequence[ProbeResult], low: int) -> str:
    """What a plan with ``uniform_ranks`` says of its ranks: every rank at rank ``low``'s max, and each rank's max;
    a rank probed only up to its per-rank target (the most a rank of such a plan needs) holds at least that."""
    def shown(p: ProbeResult) -> str:
        return f"at least {p.max_micro_batch} (probed only up to the per-rank target)" \
            if p.limited_by == "max_batch" else str(p.max_micro_batch)

    return (f"uniform ranks: every rank at rank {low}'s max micro-batch {probes[low].max_micro_batch} "
            f"(max micro-batch per rank: {', '.join(map(shown, probes))})")


def rank_cannot_hold_one(facts: str, rank: int, world: int, device: str, budget: int | None,
                         parallel: str) -> DoesNotFit:
    """The error of a rank of a mixed job that cannot hold a micro-batch of 1 (``facts``: the bytes needed and
    usable): it names the rank and its device, and what would let the job run."""
    where = device + (f", {{memory_budget}} {format_bytes(budget)}" if budget is not None else "")
    shard = (f"shard the model over the {world} ranks ({{parallel='fsdp'}}), "
             if parallel != "fsdp" else "")
    return DoesNotFit(f"rank {rank} of {world} ({where}) cannot hold a micro-batch of 1: {facts}: {shard}use a "
                      f"smaller model (or bf16, activation checkpointing, a shorter sequence), give rank {rank} a "
                      "device with more memory, or leave it out of the device list", facts=facts)


def make_mixed_plan(target_batch: int, ranks: Sequence[RankShare], *, multiple_of: int = 1, uniform: Uniform = None,
                    probe: ProbeResult | None = None, world_size_source: str = "default", parallel: Parallel = "ddp",
                    peak_of: Callable[[int, int], int | None] | None = None,
                    notes: Sequence[str] = ()) -> Plan:
    """Plan exactly ``target_batch`` samples over ranks that may differ (``ranks[r]``: rank ``r``'s device, max
    micro-batch, usable memory, time per sample when known).

    Ranks alike (the same max, and the same time per sample or none known) get :func:`make_plan`'s plan. Otherwise
    :func:`split_ranks` gives each rank its own micro-batch and micro-steps, by time when every rank's time per
    sample is known, else by memory; under FSDP (``parallel="fsdp"``) in step. The plan says what it gains over
    the smallest-for-all plan. ``peak_of(rank, size)``: the predicted peak of a rank at a micro-batch size, from
    its probe. ``uniform`` (equal micro-batches) on ranks that differ raises RanksDiffer.
    """
    maxima = [r.max_micro_batch for r in ranks]
    world = len(ranks)
    if not differ(ranks):
        return _alike(make_plan(target_batch, maxima[0], world_size=world, multiple_of=multiple_of,
                                uniform=uniform, probe=probe, world_size_source=world_size_source), ranks, notes)
    if uniform:
        raise ranks_differ_error(maxima, mention("uniform", uniform) + " asks for equal micro-batches on every rank")
    timed = all(r.seconds_per_sample is not None for r in ranks)
    times = [float(r.seconds_per_sample) for r in ranks if r.seconds_per_sample is not None] if timed else None
    lockstep = parallel == "fsdp"
    split = split_ranks(target_batch, maxima, times, multiple_of=multiple_of, lockstep=lockstep)
    shares = tuple(replace(r, peak_bytes=peak_of(i, max(row)) if peak_of is not None else r.peak_bytes)
                   for i, (r, row) in enumerate(zip(ranks, split.rows)))
    smallest = _smallest_for_all(target_batch, min(maxima), world, multiple_of)
    mixed = MixedRanks(
        ranks=shares, balanced_by=split.by, step_seconds=_step_seconds(split.rows, times, lockstep),
        uniform_per_rank=None if smallest is None else smallest.per_rank_batch,
        uniform_micro_batch=None if smallest is None else smallest.micro_batch,
        uniform_steps=None if smallest is None else smallest.accumulation_steps,
        uniform_step_seconds=None if smallest is None else _step_seconds(smallest.schedule, times, lockstep))
    sizes = {b for row in split.rows for b in row}
    extra = []
    if any(r.seconds_per_sample is not None for r in ranks) and not timed:
        unknown = [str(i) for i, r in enumerate(ranks) if r.seconds_per_sample is None]
        extra.append(f"balanced by memory: the time per sample of rank{'s' * (len(unknown) > 1)} "
                     f"{', '.join(unknown[:8])}{', ...' if len(unknown) > 8 else ''} is not known")
    if lockstep:
        extra.append("FSDP: every rank runs the same number of micro-steps (each one gathers the parameters on all "
                     "ranks together), each with its own micro-batch")
    return Plan(target_batch=target_batch, world_size=world, micro_batch=max(sizes),
                accumulation_steps=max(map(len, split.rows)), schedule=split.rows, uniform=len(sizes) == 1,
                multiple_of=multiple_of, max_micro_batch=max(maxima), world_size_source=world_size_source,
                probe=probe, notes=tuple(notes) + tuple(extra), parallel=parallel, mixed=mixed)


def _alike(planned: Plan, ranks: Sequence[RankShare], notes: Sequence[str]) -> Plan:
    """``planned``, the plan of ranks that plan alike, saying so beside ``notes``."""
    known = [r.seconds_per_sample is not None for r in ranks]
    why = "" if all(known) or not any(known) else \
        ", and the time per sample of some is not known, so speed cannot tell them apart"
    said = f"every rank runs the same plan: their max micro-batches are alike ({ranks[0].max_micro_batch}){why}"
    return replace(planned, notes=planned.notes + tuple(notes) + (said,))


def _smallest_for_all(target: int, smallest: int, world: int, q: int) -> Plan | None:
    """The plan every rank would run at the smallest max micro-batch (``uniform_ranks``), or None when there is none."""
    try:
        return make_plan(target, smallest, world_size=world, multiple_of=q)
    except PlanError:
        return None


def _step_seconds(rows: Sequence[Sequence[int]], times: Sequence[float] | None, lockstep: bool) -> float | None:
    """The predicted step time: the slowest rank's samples x its time per sample; in step (FSDP), each micro-step
    as long as its slowest rank's. None when the times are not known."""
    if times is None:
        return None
    if lockstep:
        return sum(max(row[i] * t for row, t in zip(rows, times)) for i in range(len(rows[0])))
    return max(sum(row) * t for row, t in zip(rows, times))
