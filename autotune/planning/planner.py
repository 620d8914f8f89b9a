"""The planner: micro-batch x accumulation steps x ranks = exactly the target batch.

Pure arithmetic, no torch. ``T`` is the target effective batch over all ranks,
``m`` the largest micro-batch one rank holds, ``W`` the data-parallel world
size and ``q`` the multiple every micro-batch must be. Sizes count in units of
``q``: ``U = T / q`` units go into ``W x k`` slots (slot ``s = i x W + r`` is
rank ``r`` at micro-step ``i``), ``k`` as small as ``m`` allows and the same on
every rank. Slots get ``U // n`` units each and the last ``U % n`` slots one
more, so sizes differ by at most ``q`` and are equal whenever they can be.
``uniform=True`` demands equal sizes within twice the fewest steps (micro-batches
of at least about half of ``m``); ``uniform="force"`` takes equal sizes however
many steps they need.
The target is never changed: a target that cannot be planned is an error that
names the nearest targets that can. A plan holds at most ``MAX_TARGET_BATCH``
samples and ``MAX_MICRO_BATCHES`` micro-batches (``W x k``); larger ones are
refused before any schedule is built, and no search loops up to the target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from .. import options
from ..errors import NoUniformPlan, PlanError
from ..options import MAX_MICRO_BATCHES, MAX_TARGET_BATCH
from ..results.plan import Plan, above_probe_note, arithmetic_line
from ..results.probe import ProbeResult
from ..units import plural as _plural

#: What ``uniform`` may be: None or False (fewest steps), True (equal sizes within twice the fewest
#: steps), "force" (equal sizes, however many steps).
UNIFORM = (None, False, True, "force")
Uniform = bool | Literal["force"] | None


def world_size_from(flag: int | None, env: Mapping[str, str]) -> tuple[int, str]:
    """(world size, where it came from): ``--world-size``, else ``$WORLD_SIZE`` as torchrun sets it, else 1."""
    if flag is not None:
        return options.whole(flag, "world_size", fix="pass 1 for one process", text=False, error=PlanError), "flag"
    text = env.get("WORLD_SIZE")
    if text is None:
        return 1, "default"
    try:
        return options.whole(text, "WORLD_SIZE", error=PlanError), "WORLD_SIZE"
    except PlanError:
        raise PlanError(f"WORLD_SIZE={text!r} is not a whole number of at least 1 (torchrun sets it to the "
                        "number of processes): unset it, or give world_size") from None


# ---- the arithmetic, in units of q -------------------------------------------------------------
#
# Everything here costs O(1), or O(min(k, unit_max)) <= O(sqrt(units)) for the equal-split searches;
# nothing loops up to the target or builds a list of slots it does not return.


def _min_steps(units: int, world: int, unit_max: int) -> int:
    """Fewest micro-steps per rank that hold ``units`` with at most ``unit_max`` units a slot."""
    return -(-units // (world * unit_max))


def _feasible(units: int, world: int, unit_max: int) -> bool:
    """Some plan exists: every one of the ``world x k`` slots gets at least one unit."""
    return units >= world * _min_steps(units, world, unit_max)


def _smallest_divisor(n: int, low: int, high: int) -> int | None:
    """The smallest divisor of ``n`` in ``[low, high]``: scans that range or, when shorter, the
    co-divisors ``n // d`` from the top down."""
    if high - low <= n // low - n // high:
        return next((d for d in range(low, high + 1) if n % d == 0), None)
    return next((n // e for e in range(n // low, (n - 1) // high, -1) if n % e == 0), None)


def _uniform_steps(units: int, world: int, unit_max: int) -> int | None:
    """Fewest steps, at most double the minimum, that split ``units`` into equal slots: with
    ``n = units / world`` per rank, the smallest divisor of ``n`` in ``[least, 2 least]``."""
    if units % world:
        return None
    n = units // world
    least = _min_steps(n, 1, unit_max)
    return _smallest_divisor(n, least, 2 * least)


def _forced_steps(units: int, world: int, unit_max: int) -> int | None:
    """Fewest steps, however many, that split ``units`` into equal slots: the smallest divisor of
    ``n = units / world`` that is at least the fewest steps (``n`` itself, one unit a slot, always is).
    The divisors come from trial division up to sqrt(n), when the short search finds none."""
    near = _uniform_steps(units, world, unit_max)
    if near is not None or units % world:
        return near
    n = units // world
    least = _min_steps(n, 1, unit_max)
    divisors = (c for d in range(1, math.isqrt(n) + 1) if n % d == 0 for c in (d, n // d))
    return min(c for c in divisors if c >= least)


# A per-rank unit count n splits into equal slots (the rules of _uniform_steps) exactly when n = k x s
# with s <= unit_max and k in [c, 2c], c = ceil(n / M). Near a given n every such n shares c, so the
# nearest one is the nearest multiple of some k in [c, 2c], found by scanning k, or s when shorter.


def _uniform_above(a: int, unit_max: int) -> int:
    """The smallest n >= a that splits into equal slots (``c x unit_max`` always does)."""
    c = -(-a // unit_max)
    if c < unit_max:
        return min(k * -(-a // k) for k in range(c, 2 * c + 1))
    return min(max(c, -(-a // s)) * s for s in range(1, unit_max + 1) if -(-a // s) <= 2 * c)


def _uniform_below(b: int, unit_max: int) -> int | None:
    """The largest n in [1, b] that splits into equal slots (``(c - 1) x unit_max`` does when c > 1)."""
    if b < 1:
        return None
    c = -(-b // unit_max)
    if c == 1:
        return b
    if c < unit_max:
        best = max(k * (b // k) for k in range(c, 2 * c + 1))
    else:
        best = max(min(2 * c, b // s) * s for s in range(1, unit_max + 1) if b // s >= c)
    return max(best, (c - 1) * unit_max)


def nearest_uniform_targets(target: int, max_micro_batch: int, *, world_size: int = 1,
                            multiple_of: int = 1) -> tuple[int | None, int | None]:
    """The nearest targets below and above ``target`` that split into equal micro-batches
    (the same rules as ``make_plan(..., uniform=True)``); None where there is none below."""
    target = _whole(target, "target_batch", "give the effective batch over all ranks, e.g. 1024")
    _limit_target(target)
    unit_max = max_micro_batch // multiple_of
    if unit_max < 1:
        return None, None
    step = world_size * multiple_of  # equal micro-batches over every rank: targets are multiples of W x q
    below = _uniform_below((target - 1) // step, unit_max)
    return None if below is None else below * step, _uniform_above(target // step + 1, unit_max) * step


def _nearest_feasible(target: int, q: int, world: int, unit_max: int) -> tuple[int | None, int | None]:
    """The nearest multiples of ``q`` below and above ``target`` that can be planned at all: unit
    counts of at least ``world``, and multiples of ``world`` when a slot holds only one unit."""
    b, a = (target - 1) // q, target // q + 1
    if unit_max == 1:
        b, a = b - b % world, -(-a // world) * world
    below = b * q if b >= world else None
    return below, max(a, world) * q


def _counts(units: int, world: int, steps: int, q: int) -> dict[int, int]:
    """{micro-batch size: how many} of the schedule ``_split`` makes, without making it."""
    slots = world * steps
    base, extra = divmod(units, slots)
    return {size: count for size, count in ((base * q, slots - extra), ((base + 1) * q, extra)) if count}


def _split(units: int, world: int, steps: int, q: int) -> tuple[tuple[int, ...], ...]:
    """Step-major slots (slot ``i x world + r``); the last ``units % slots`` of them get one unit more.
    With the first of those at step ``a``, rank ``b`` (``a x world + b``), ranks below ``b`` run
    ``a + 1`` small micro-batches first and the others ``a``: two distinct rows in all."""
    slots = world * steps
    base, extra = divmod(units, slots)
    a, b = divmod(slots - extra, world)
    small, big = base * q, (base + 1) * q

    def row(first: int) -> tuple[int, ...]:
        first = min(first, steps)
        return (small,) * first + (big,) * (steps - first)

    return (row(a + 1),) * b + (row(a),) * (world - b)


def _build(target: int, m: int, world: int, q: int, steps: int, **fields) -> Plan:
    schedule = _split(target // q, world, steps, q)
    sizes = _counts(target // q, world, steps, q)
    probe = fields.get("probe")
    fields.setdefault("parallel", probe.parallel if probe is not None else "ddp")  # FSDP plans follow their probe
    return Plan(target_batch=target, world_size=world, micro_batch=max(sizes), accumulation_steps=steps,
                schedule=schedule, uniform=len(sizes) == 1, multiple_of=q, max_micro_batch=m, **fields)


# ---- checks and errors ------------------------------------------------------------------------


def _whole(value: Any, what: str, fix: str) -> int:
    return options.whole(value, what, fix=fix, text=False, error=PlanError)


def _targets(below: int | None, above: int | None) -> str:
    return f"{below} or {above}" if below is not None else f"{above}"


def _check(target: int, m: int, world: int, q: int) -> None:
    """PlanError when no plan at all exists for these numbers."""
    if target < world:
        raise PlanError(f"is smaller than the world size {world}", field="target_batch", value=target, limit=world,
                        fix=f"every rank needs at least one sample per step; use a target of at least {world} or "
                            "fewer ranks")
    if m < q:
        raise PlanError(f"max micro-batch {m} is smaller than {{multiple_of}} {q}: no micro-batch size is allowed",
                        field="multiple_of", limit=m, fix=f"use {{multiple_of}} {m} or less, or give each rank more "
                                                          "memory")
    unit_max = m // q
    if target % q:
        below, above = _nearest_feasible(target, q, world, unit_max)
        raise PlanError(f"is not a multiple of {{multiple_of}} {q}", field="target_batch", value=target,
                        fix=f"use target {_targets(below, above)}, or a {{multiple_of}} that divides {target}")
    if target // q < world:
        raise PlanError(f"on {_plural(world, 'rank')} with {{multiple_of}} {q}: every rank needs "
                        f"at least {q} samples per step ({world * q} in all)", field="target_batch", value=target,
                        limit=world * q,
                        fix=f"use a target of at least {world * q}, fewer ranks or a smaller {{multiple_of}}")
    if not _feasible(target // q, world, unit_max):
        below, above = _nearest_feasible(target, q, world, unit_max)
        raise PlanError(f"cannot be split: max micro-batch {m} with {{multiple_of}} {q} allows only "
                        f"micro-batches of {q}, so every step takes {world * q} samples over {_plural(world, 'rank')}",
                        field="target_batch", value=target,
                        fix=f"use target {_targets(below, above)}, a larger max micro-batch or fewer ranks")


def _limit_target(target: int) -> None:
    if target > MAX_TARGET_BATCH:
        raise PlanError(f"is more than the {MAX_TARGET_BATCH:,} samples per optimizer step a plan "
                        "may hold", field="target_batch", value=target, limit=MAX_TARGET_BATCH,
                        fix="use a smaller target batch")


def _limit_slots(world: int, steps: int, why: str) -> None:
    """PlanError before a schedule of more than MAX_MICRO_BATCHES sizes is made."""
    if world * steps > MAX_MICRO_BATCHES:
        raise PlanError(f"{why}{world * steps:,} micro-batches per optimizer step ({_plural(world, 'rank')} x "
                        f"{_plural(steps, 'step')}), more than the {MAX_MICRO_BATCHES:,} a plan may hold: use a larger "
                        "max micro-batch, fewer ranks or a smaller target")


def _plan_or_none(target: int, m: int, world: int, q: int) -> list[Plan]:
    try:
        return [make_plan(target, m, world_size=world, multiple_of=q, uniform=True)]
    except PlanError:
        return []


def uniform_options(target: int, max_micro_batch: int, *, world_size: int = 1,
                    multiple_of: int = 1) -> tuple[list[str], str | None]:
    """For a target with no equal split within twice the fewest steps: the nearest targets that have
    one, each with its plan (``1020 (1020 = 255 x 4 steps x 1 rank)``), and the arithmetic of the
    ``uniform="force"`` plan of the target itself (None when there is none a plan may hold)."""
    m, world, q = max_micro_batch, world_size, multiple_of
    below, above = nearest_uniform_targets(target, m, world_size=world, multiple_of=q)
    nearest = [f"{t} ({plan.arithmetic})" for t in (below, above) if t is not None
               for plan in _plan_or_none(t, m, world, q)]
    try:
        forced = make_plan(target, m, world_size=world, multiple_of=q, uniform="force").arithmetic
    except PlanError:
        forced = None
    return nearest, forced


def uniform_range(target: int, max_micro_batch: int, *, world_size: int = 1, multiple_of: int = 1) -> str:
    """What ``uniform=True`` looked for: ``equal micro-batches of at most 300 on 1 rank within 4..8 steps``."""
    least = _min_steps(target // multiple_of, world_size, max_micro_batch // multiple_of)
    sizes = "equal micro-batches" if multiple_of == 1 else f"equal micro-batches that are multiples of {multiple_of}"
    return f"{sizes} of at most {max_micro_batch} on {_plural(world_size, 'rank')} within {least}..{2 * least} steps"


def _no_uniform(target: int, m: int, world: int, q: int) -> PlanError:
    units, unit_max = target // q, m // q
    least = _min_steps(units, world, unit_max)
    nearest, forced = uniform_options(target, m, world_size=world, multiple_of=q)
    uneven = arithmetic_line(target, world, least, _counts(units, world, least, q))
    force = f"{{uniform='force'}} for {forced}, " if forced else ""
    return NoUniformPlan(
        f"{{uniform=True}}: target {target} does not split into "
        f"{uniform_range(target, m, world_size=world, multiple_of=q)}"
        f"; nearest targets that do: {' and '.join(nearest) or 'none'}; {force}or drop {{uniform=True}} "
        f"for {uneven} (autotune's runner weights uneven micro-batches exactly)",
        target=target, max_micro_batch=m, world_size=world, multiple_of=q)


def _no_forced(target: int, world: int, q: int) -> PlanError:
    step = world * q
    below, above = (target // step) * step, (target // step + 1) * step
    return PlanError(
        f"{{uniform='force'}}: target {target} does not split into equal micro-batches"
        f"{'' if q == 1 else f' that are multiples of {q}'} on {_plural(world, 'rank')}: every step takes a "
        f"multiple of {step} samples", field="uniform",
        fix=f"use target {_targets(below or None, above)}, or drop {{uniform='force'}}")


# ---- the planner ------------------------------------------------------------------------------


def make_plan(target_batch: int, max_micro_batch: int, *, world_size: int = 1, multiple_of: int = 1,
              uniform: Uniform = None, probe: ProbeResult | None = None,
              world_size_source: str = "default") -> Plan:
    """Plan exactly ``target_batch`` samples per optimizer step over ``world_size`` ranks.

    Fewest accumulation steps with micro-batches of at most ``max_micro_batch``,
    each a multiple of ``multiple_of``; equal sizes whenever those steps allow,
    else sizes that differ by one ``multiple_of``. ``uniform=True`` demands
    equal sizes, taking up to twice the fewest steps, and raises NoUniformPlan
    (a PlanError) otherwise; ``uniform="force"`` takes equal sizes however many
    steps they need; None or False take the fewest steps either way. Targets above
    ``MAX_TARGET_BATCH`` and plans of more than ``MAX_MICRO_BATCHES`` micro-batches
    (ranks x steps) raise PlanError before any work.
    """
    target, m, world, q, steps, least = _steps(target_batch, max_micro_batch, world_size, multiple_of, uniform)
    notes = _notes(target, m, world, q, steps, least, probe)
    return _build(target, m, world, q, steps, probe=probe, notes=notes, world_size_source=world_size_source)


def check_plan(target_batch: int, max_micro_batch: int, *, world_size: int = 1, multiple_of: int = 1,
               uniform: Uniform = None) -> None:
    """Raise the PlanError ``make_plan`` would raise for these numbers, without building a plan."""
    _steps(target_batch, max_micro_batch, world_size, multiple_of, uniform)


def _steps(target_batch: int, max_micro_batch: int, world_size: int, multiple_of: int,
           uniform: Uniform) -> tuple[int, int, int, int, int, int]:
    """(target, m, world, q, steps, fewest steps) once every check and limit has passed."""
    target = _whole(target_batch, "target_batch", "give the effective batch over all ranks, e.g. 1024")
    m = _whole(max_micro_batch, "max_micro_batch", "at least one sample must fit per rank")
    world = _whole(world_size, "world_size", "pass 1 for a single process")
    q = _whole(multiple_of, "multiple_of", "use 1 for any size, or e.g. 8 for tensor-core-friendly sizes")
    if uniform not in UNIFORM:
        raise PlanError("must be True, False, None or 'force'", field="uniform", value=uniform,
                        choices=(True, False, None, "force"))
    _limit_target(target)
    _limit_slots(world, 1, f"{_plural(world, 'rank')} run at least ")
    _check(target, m, world, q)
    units, unit_max = target // q, m // q
    least = _min_steps(units, world, unit_max)
    _limit_slots(world, least, f"target {target} with micro-batches of at most {m} needs ")
    if not uniform:
        return target, m, world, q, least, least
    if uniform == "force":
        steps = _forced_steps(units, world, unit_max)
        if steps is None:
            raise _no_forced(target, world, q)
    else:
        steps = _uniform_steps(units, world, unit_max)
        if steps is None:
            raise _no_uniform(target, m, world, q)
    _limit_slots(world, steps, f"uniform={uniform!r} needs {steps} steps for target {target}: ")
    return target, m, world, q, steps, least


def _notes(target: int, m: int, world: int, q: int, steps: int, least: int,
           probe: ProbeResult | None) -> tuple[str, ...]:
    notes = []
    units, unit_max = target // q, m // q
    if steps > least:
        notes.append(f"equal micro-batches take {steps} steps instead of the {least} that micro-batches of {m} allow")
    if units % (world * steps):
        notes.append("uneven micro-batches: autotune's runner weights each loss by n_i / N, so the gradient "
                     "equals the full-batch one; frameworks that assume equal micro-batches would not")
        even = _uniform_steps(units, world, unit_max)
        if even is not None and world * even <= MAX_MICRO_BATCHES:
            even_plan = arithmetic_line(target, world, even, _counts(units, world, even, q))
            notes.append(f"equal micro-batches would give {even_plan}")
    if probe is not None and m > probe.max_micro_batch:
        notes.append(above_probe_note(m, probe.max_micro_batch))
    return tuple(notes)
