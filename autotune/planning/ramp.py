"""The effective batch as a schedule that grows with the measured gradient noise scale: pure arithmetic.

Early in training the gradient noise scale ``B_noise`` is small, so a large
batch spends most of its samples where a small one makes the same progress per
step; later it grows. McCandlish et al. (2018, "An Empirical Model of
Large-Batch Training") show that the batch that balances optimizer steps and
samples is about ``B_noise`` and that it grows as the loss falls; Merrill et al.
(2025, "Critical Batch Size Revisited", OLMo) reached slightly better loss with
43% fewer gradient steps by warming the batch size up; Pollux (Qiao et al.,
OSDI 2021) adapts batch sizes to the same statistic. The ramp here follows the
measured ``B_simple`` (the noise scale :mod:`autotune.training.noise` measures
from accumulation's micro-steps):

- it starts at ``start`` (default :func:`default_start`: the smallest batch
  with two micro-batches in all when micro-batches are as large as memory
  allows, or a quarter of a target memory holds in one step), and after each
  optimizer step decides the next step's batch ``B``;
- it grows only when (1) the current phase has run ``min_steps`` steps, (2)
  the 95% interval of the noise scale over the latest ``window`` steps
  (:func:`window_reading`) is bounded and its lower end is above ``B`` (a
  noisy reading never makes it grow), and (3) the new batch
  ``min(B_simple, growth x B, target)``, rounded down to the sizes allowed
  (multiples of ``multiple_of`` x world size: :func:`ramp_quantum`), is
  at least ``GROW_AT_LEAST x B`` (or the target): so the batch is about
  ``B_simple``, never above the target, never shrinks, and changes in steps of
  at least 25% (no oscillation);
- each phase is an exact plan from the planner (:func:`phase_plan`): the
  fewest micro-steps of at most the memory limit, their sizes evened (80 + 81,
  not 160 + 1); on one rank a phase keeps two micro-batches at least, so the
  noise scale stays measurable; a uniform ramp (``--uniform``,
  :func:`uniform_base`) runs every phase in whole micro-batches of the plan's;
  every rank runs alike (a plan whose ranks differ is refused by
  :func:`first_batch`: ramp it with ``uniform_ranks``).

The learning rate follows the batch by one of :data:`autotune.options.LR_SCALINGS`
(:func:`lr_scale`); the user's rate is the one tuned for the target batch. It never falls when the batch grows
(:func:`phase_lr_scale`): before any reading the ``noise`` rule takes its conservative end, and a phase keeps the
rate of the phase before where a new reading of a larger noise scale would lower it.

Nothing here imports torch: the runner, the Accumulator and the framework
callbacks all decide through these functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .. import options
from ..errors import PlanError
from ..results.noise import ratio_interval
from ..results.plan import Plan
from ..results.ramp import RampConfig
from .mixed import how_ranks_differ
from .planner import make_plan

__all__ = ["GROW_AT_LEAST", "RampConfig", "Reading", "check_below", "check_start", "default_start", "first_batch",
           "least_start", "lr_scale", "phase_lr_scale", "ramp_quantum",
           "next_batch", "phase_micro_limit", "phase_plan", "uniform_base", "window_reading"]

#: A change multiplies the batch by at least this much (or reaches the target).
GROW_AT_LEAST = 1.25
#: Where memory holds the target in one step, the default start is the target over this (two doublings below it
#: at the default growth), so the ramp has room to grow.
SMALL_TARGET_SHARE = 4


@dataclass(frozen=True, kw_only=True)
class Reading:
    """The smoothed noise scale the ramp decides from: point estimate and 95% interval (None: not bounded;
    ``high`` None with ``low`` set: unbounded above)."""

    b_simple: float | None
    low: float | None
    high: float | None


def window_reading(estimates: Sequence[tuple[float, float]]) -> Reading:
    """The noise scale of the latest steps: ``estimates`` are their unbiased per-step ``(|G|², tr(Σ))``.

    ``B_simple`` is the ratio of the means; its 95% interval is Fieller's over the steps' spread, Student's t at
    ``len - 1`` degrees of freedom (:func:`autotune.results.noise.ratio_interval`). A window forgets completely:
    the noise scale moves by orders of magnitude early in training, and an average that kept the first steps
    would keep their spread for hundreds of steps.
    """
    n = len(estimates)
    if n < 2:
        return Reading(b_simple=None, low=None, high=None)
    y = sum(g for g, _ in estimates) / n
    x = sum(t for _, t in estimates) / n
    vxx = sum((t - x) ** 2 for _, t in estimates) / (n * (n - 1))
    vyy = sum((g - y) ** 2 for g, _ in estimates) / (n * (n - 1))
    vxy = sum((t - x) * (g - y) for g, t in estimates) / (n * (n - 1))
    low, high = ratio_interval(x, y, vxx, vyy, vxy, n - 1)
    return Reading(b_simple=x / y if x > 0 and y > 0 else None, low=low,
                   high=None if high is None or high == math.inf else high)


def least_start(world_size: int, quantum: int) -> int:
    """The smallest batch a ramp may run: two micro-batches on one rank, one per rank on several (``quantum``:
    the step between the batches allowed, which holds the world size)."""
    return 2 * quantum if world_size == 1 else quantum


def ramp_quantum(plan: Plan) -> int:
    """The step between the effective batches a ramp toward ``plan``'s target may take below it: ``multiple_of``
    x the world size (every rank an equal share, so every phase can be planned)."""
    return plan.multiple_of * plan.world_size


def default_start(target: int, *, world_size: int, max_micro_batch: int, quantum: int = 1) -> int:
    """The smallest batch with two micro-batches in all at micro-batches as large as memory allows:
    ``m + 1`` on one rank (the fewest-step plan splits it in two; rounded up to a multiple of ``quantum``),
    ``W x m`` on ``W`` ranks (one micro-batch of ``m`` each; rounded down). Where memory holds the target in one
    such step, :data:`SMALL_TARGET_SHARE` of the target instead (rounded down; its phases take smaller
    micro-batches). Never below :func:`least_start`; PlanError when that leaves no batch below the target."""
    least = least_start(world_size, quantum)
    if world_size == 1:
        first = -(-(max_micro_batch + 1) // quantum) * quantum
    else:
        first = world_size * max_micro_batch // quantum * quantum
    if max(first, least) >= target:
        first = target // SMALL_TARGET_SHARE // quantum * quantum
    first = max(first, least)
    if first >= target:
        what = "two micro-batches on one rank" if world_size == 1 else f"one micro-batch on each of {world_size} ranks"
        step = "" if quantum == 1 else f", in multiples of {quantum}"
        raise PlanError(f"ramp: the target {target} leaves no batch below it to start from: the smallest a ramp runs "
                        f"is {least} ({what}{step}, so the noise scale can be measured); ramp toward a larger target, "
                        f"or train at {target} without the ramp")
    return first


def check_below(start: int, target: int) -> None:
    """PlanError when a ramp would start above its target (checked before any probe)."""
    if start > target:
        raise PlanError(f"ramp start {start} is above the target batch {target}: the ramp grows toward the target, "
                        f"never past it; start at most {target} (RampConfig(start=...), --ramp-from)")


def check_start(start: int, target: int, *, world_size: int, quantum: int = 1) -> int:
    """``start`` if a ramp can begin there: at least two micro-batches in all, a multiple of ``quantum``, at most
    the target; else PlanError with the fix."""
    least = least_start(world_size, quantum)
    where = "RampConfig(start=...), --ramp-from"
    check_below(start, target)
    if start < least:
        raise PlanError(f"ramp start {start} is too small: the noise scale needs two micro-batches per step"
                        f"{' on one rank' if world_size == 1 else f', one per rank on {world_size} ranks'}; "
                        f"start at {least} or more ({where})")
    if start % quantum:
        below = start // quantum * quantum
        raise PlanError(f"ramp start {start} is not a multiple of {quantum}"
                        f"{' (every rank an equal share)' if world_size > 1 else ''}: start at {below} or "
                        f"{below + quantum} ({where})")
    return start


def first_batch(plan: Plan, config: RampConfig, *, quantum: int | None = None) -> int:
    """Where a ramp of ``config`` toward ``plan``'s target begins (``config.start``, checked, or
    :func:`default_start`); PlanError with the fix when it cannot begin there, or when ``plan`` gives ranks that
    differ their own micro-batches (a phase is planned for ranks alike: each at the plan's memory limit)."""
    if plan.mixed is not None:
        how = how_ranks_differ([r.max_micro_batch for r in plan.mixed.ranks])
        raise PlanError(f"ramp: the ranks differ ({how}) and a ramp's phases run every "
                        "rank alike: pass {uniform_ranks=True} to ramp with every rank at the smallest max "
                        "micro-batch, or train without the ramp")
    q = ramp_quantum(plan) if quantum is None else quantum
    start = config.start
    if start is None:
        start = default_start(plan.target_batch, world_size=plan.world_size, max_micro_batch=plan.max_micro_batch,
                              quantum=q)
    return check_start(start, plan.target_batch, world_size=plan.world_size, quantum=q)


def uniform_base(plan: Plan) -> tuple[Plan, int]:
    """A ramp toward ``plan`` in whole micro-batches of its (equal) micro-batch, as ``uniform`` asks of every phase:
    the plan with that micro-batch as the memory limit, and the quantum, micro-batch x world size. PlanError when
    the plan's micro-batches differ."""
    if not plan.uniform or plan.mixed is not None:
        sizes = sorted({n for row in plan.schedule for n in row})
        raise PlanError(f"a uniform ramp runs every phase in whole micro-batches of the plan's, but this plan's differ "
                        f"({', '.join(map(str, sizes[:4]))}): plan with {{uniform='force'}}, or ramp "
                        "without uniform", field="uniform")
    return replace(plan, max_micro_batch=plan.micro_batch), plan.micro_batch * plan.world_size


def phase_micro_limit(batch: int, *, world_size: int, max_micro_batch: int, multiple_of: int = 1) -> int:
    """The largest micro-batch of a phase: the memory limit, but on one rank at most half the batch (rounded up
    to a multiple of ``multiple_of``), so the phase keeps the two micro-batches the noise scale needs."""
    if world_size > 1:
        return max_micro_batch
    half = -(-batch // (2 * multiple_of)) * multiple_of
    return max(multiple_of, min(max_micro_batch, half))


def phase_plan(batch: int, base: Plan) -> Plan:
    """The exact plan of a phase of ``batch`` samples per step: ``base`` itself at its target, else the
    planner's fewest-step plan with micro-batches at most :func:`phase_micro_limit`."""
    if batch == base.target_batch:
        return base
    limit = phase_micro_limit(batch, world_size=base.world_size, max_micro_batch=base.max_micro_batch,
                              multiple_of=base.multiple_of)
    return make_plan(batch, limit, world_size=base.world_size, multiple_of=base.multiple_of)


def next_batch(current: int, *, target: int, quantum: int, reading: Reading | None, steps_in_phase: int,
               config: RampConfig) -> int:
    """The effective batch of the next step (see the module docstring for the rule): ``current`` unless the
    phase has run ``config.min_steps`` steps and the reading's 95% lower bound is above ``current``; then
    ``min(B_simple, growth x current, target)`` rounded down to a multiple of ``quantum``, if that grows the batch
    by at least ``GROW_AT_LEAST`` (or reaches the target)."""
    if current >= target or steps_in_phase < config.min_steps or reading is None:
        return current
    b, low = reading.b_simple, reading.low
    if b is None or low is None or not low > current:
        return current
    want = min(float(target), b, config.growth * current)
    grown = target if want >= target else int(want // quantum) * quantum
    if grown < min(target, math.ceil(GROW_AT_LEAST * current)):
        return current
    return grown


def phase_lr_scale(rule: str, *, batch: int, target: int, noise_scale: float | None, exponent: float = 1.0,
                   before: float | None = None) -> float:
    """The factor on the learning rate of a phase of ``batch``: :func:`lr_scale`, but never below ``before``, the
    factor of the (smaller) phase before it: a larger batch's gradient is less noisy, so the rate that phase ran
    at stays safe, and a reading of a larger noise scale never lowers the rate as the batch grows."""
    scale = lr_scale(rule, batch=batch, target=target, noise_scale=noise_scale, exponent=exponent)
    return scale if before is None else max(scale, before)


def lr_scale(rule: str, *, batch: int, target: int, noise_scale: float | None, exponent: float = 1.0) -> float:
    """The factor on the learning rate tuned for ``target`` when a step takes ``batch`` samples.

    - ``noise``: McCandlish et al. (2018)'s optimal SGD step, ``eps(B) = eps_max / (1 + B_noise/B)``, so
      ``eps(B) / eps(target) = (1 + B_noise/target) / (1 + B_noise/B)``: near 1 while ``B`` is above ``B_noise``,
      shrinking only below it; raised to ``exponent`` (1 for SGD, whose step the paper models; ½ for optimizers
      that normalise the step, whose rate scales as the square root of the batch where the noise dominates:
      Malladi et al. 2022; the small-batch side of Li et al. 2024's Adam rule). ``noise_scale`` None (nothing
      measured yet) takes the rule's conservative end, ``B_noise`` far above the batch: ``(batch / target) **
      exponent``, the smallest factor any reading can give, so a first reading only raises it.
    - ``linear``: ``batch / target`` (Goyal et al. 2017, SGD).
    - ``sqrt``: ``(batch / target) ** 0.5`` (Hoffer et al. 2017; Malladi et al. 2022 for Adam).
    - ``none``: 1.
    """
    rule = options.lr_scaling(rule)
    if batch < 1 or target < 1:
        raise ValueError(f"batch {batch} and target {target} must be at least 1")
    if rule == "none":
        return 1.0
    if rule == "linear":
        return batch / target
    if rule == "sqrt":
        return math.sqrt(batch / target)
    if noise_scale is None or not noise_scale > 0 or not math.isfinite(noise_scale):
        return (batch / target) ** exponent
    return ((1 + noise_scale / target) / (1 + noise_scale / batch)) ** exponent
