"""A batch ramp's settings, and its phases as a run records them. No torch here.

A ramp (:mod:`autotune.planning.ramp`) grows the effective batch with the
measured gradient noise scale; each phase is an exact plan. A run's
``batch_schedule`` lists them, oldest first: where each begins in the run's
``losses``, its effective batch and micro-batches, the noise scale it was
decided from, and the factor on the learning rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from .. import options
from .record import Count, Record, Rule, Whole


@dataclass(frozen=True, kw_only=True)
class RampConfig(Record):
    """How the effective batch ramps up to the target (the rule: :mod:`autotune.planning.ramp`).

    ``start``: the first effective batch (``--ramp-from``), None for the smallest
    with two micro-batches at the memory limit (a quarter of a target that memory
    holds in one step). ``lr_scaling``: how the learning
    rate follows the batch (``noise``, ``linear``, ``sqrt``, ``none``;
    :func:`autotune.planning.ramp.lr_scale`). ``min_steps``: optimizer steps a
    phase runs before the batch may grow again. ``growth``: the most one change
    multiplies the batch by. ``window``: the latest optimizer steps whose
    noise-scale estimates the ramp decides from.
    """

    start: Annotated[int, Rule(options.whole, example="64")] | None = None
    lr_scaling: Annotated[str, Rule(options.lr_scaling)] = options.DEFAULT_LR_SCALING
    min_steps: Annotated[int, Rule(options.whole, example="10")] = options.RAMP_MIN_STEPS
    growth: Annotated[float, Rule(options.above_one, example="2.0")] = options.RAMP_GROWTH
    window: Annotated[int, Rule(options.ramp_window)] = options.RAMP_WINDOW


@dataclass(frozen=True, kw_only=True)
class BatchPhase(Record):
    """One phase of a ramp: from optimizer step ``first_step`` (0-based, an index into ``losses``) on, every
    step takes ``effective_batch`` samples over all ranks, split as ``schedule`` (per rank, per micro-step)."""

    first_step: Count
    effective_batch: Whole
    b_simple: float | None      # the smoothed noise scale when the phase was decided (None: not measured yet)
    low: float | None           # its 95% lower bound then (None: not bounded)
    lr_scale: Annotated[float, Rule(options.positive)]  # the factor on the learning rate tuned for the target batch
    schedule: tuple[tuple[int, ...], ...]

    def validate(self) -> None:
        schedule = tuple(tuple(int(n) for n in row) for row in self.schedule)
        object.__setattr__(self, "schedule", schedule)
        if not schedule or any(not row for row in schedule) or len({len(row) for row in schedule}) != 1:
            raise ValueError(f"schedule {[list(r) for r in schedule]}: every rank runs the same number (at least 1) "
                             "of micro-steps")
        if min(min(row) for row in schedule) < 1:
            raise ValueError("every micro-batch of a phase holds at least 1 sample")
        total = sum(map(sum, schedule))
        if total != self.effective_batch:
            raise ValueError(f"the phase's schedule sums to {total}, not its effective batch {self.effective_batch}")

    @property
    def micro_batch(self) -> int:
        """The largest micro-batch of the phase."""
        return max(max(row) for row in self.schedule)


def check_phases(phases: Sequence[BatchPhase], steps: int, world_size: int) -> None:
    """ValueError unless ``phases`` can be a run's record: the first begins at step 0, each later one after
    the one before and within the ``steps`` run, each on ``world_size`` ranks."""
    for i, phase in enumerate(phases):
        if len(phase.schedule) != world_size:
            raise ValueError(f"batch_schedule[{i}] is for {len(phase.schedule)} ranks, the plan for {world_size}")
        if i == 0 and phase.first_step != 0:
            raise ValueError(f"the first phase begins at step {phase.first_step}, not 0")
        if i and phase.first_step <= phases[i - 1].first_step:
            raise ValueError(f"batch_schedule[{i}] begins at step {phase.first_step}, not after the phase before "
                             f"(step {phases[i - 1].first_step})")
        if phase.first_step >= steps:
            raise ValueError(f"batch_schedule[{i}] begins at step {phase.first_step}, past the {steps} steps run")


def steps_per_phase(phases: Sequence[BatchPhase], steps: int) -> list[int]:
    """How many of the ``steps`` run each phase lasted."""
    ends = [p.first_step for p in phases[1:]] + [steps]
    return [end - p.first_step for p, end in zip(phases, ends)]


def batch_per_step(phases: Sequence[BatchPhase], steps: int) -> list[int]:
    """The effective batch of each of the ``steps`` run."""
    return [p.effective_batch for p, n in zip(phases, steps_per_phase(phases, steps)) for _ in range(n)]
