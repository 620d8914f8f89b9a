"""Timing real optimizer steps of a plan for ``--tune``.

``time_plan`` runs warm-up steps, then timed ones until the interquartile range
is a small fraction of the median or a time budget is spent (``Timing``).
``compare_plans`` runs two plans head to head, in rounds of one step of each on
one shared model, so both see the same load on a busy machine; its values are
per-round throughput ratios. ``Samples`` gives the median and a 95% interval
of it that stays honest with the outliers of a shared machine.

Why not ``torch.utils.benchmark.Timer``: its ``adaptive_autorange`` stops on the
same rule (interquartile range over the median under a threshold) and, for steps
this long, times one step per block, after one untimed run. But it bounds a
measurement by time alone, after a fixed four timings, and runs at one thread
unless told: on a noisy machine it ran the mlp at micro-batch 256 (under 2 ms a
step) 174 to 591 times in its 5 s, where ``time_plan`` stops at ``max_steps`` (51
steps with the warm-up; ``bench/step_timer.py``, 2 busy CPU cores). Every one is a
real optimizer step the user waits for. Nor can it run two plans in paired
rounds, which is what makes a head-to-head ratio fair on a busy machine, and that
needs the same rule. So the rule is kept here, once (``_adaptive``), for single
steps and paired ratios.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import torch

from .. import options
from ..devices.base import Device, own_random_state
from ..results.plan import Plan
from ..results.record import Count, Record, Rule, Whole
from ..workload import Workload
from .accumulate import Accumulator
from .parts import Batches

Timer = Callable[[], float]


@dataclass(frozen=True, kw_only=True)
class Timing(Record):
    """How one candidate is timed: ``warmup`` untimed optimizer steps, then at least
    ``min_steps`` and at most ``max_steps`` timed ones, stopping as soon as the
    interquartile range is at most ``threshold`` x the median or the timed steps
    have taken ``budget_s`` seconds."""

    warmup: Count = 1
    min_steps: Annotated[int, Rule(options.whole, least=2, fix="a spread needs two timings", text=False)] = 5
    max_steps: Whole = 50
    threshold: float = 0.05
    budget_s: Annotated[float, Rule(options.seconds)] = 5.0

    def validate(self) -> None:
        if self.max_steps < self.min_steps:
            raise ValueError(f"max_steps {self.max_steps} must be at least min_steps={self.min_steps}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), the interquartile range over the median, "
                             f"got {self.threshold!r}")


@dataclass(frozen=True)
class Samples:
    """Repeated measurements (seconds of optimizer steps, or paired ratios), in the order taken."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def iqr(self) -> float:
        """Interquartile range (inclusive quartiles); 0 for a single value."""
        if len(self.values) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.values, n=4, method="inclusive")
        return q3 - q1

    @property
    def spread(self) -> float:
        """Interquartile range over the median."""
        return self.iqr / self.median if self.median > 0 else math.inf

    @property
    def half_width(self) -> float:
        """Half-width of an approximate 95% interval of the median: 1.96 x 1.2533 x sigma / sqrt(n),
        with sigma estimated as IQR / 1.349, robust to the outliers a busy machine makes."""
        return 1.96 * 1.2533 * self.iqr / 1.349 / math.sqrt(len(self.values))


def _adaptive(sample: Callable[[], float], timing: Timing, clock: Timer) -> Samples:
    """``sample()`` repeated at least ``min_steps`` and at most ``max_steps`` times, until the
    spread is at most ``timing.threshold`` or ``timing.budget_s`` seconds have passed."""
    values: list[float] = []
    start = clock()
    while len(values) < timing.max_steps:
        values.append(sample())
        if len(values) >= timing.min_steps and (Samples(tuple(values)).spread <= timing.threshold
                                                 or clock() - start >= timing.budget_s):
            break
    return Samples(tuple(values))


def repeat_until_stable(step: Callable[[], None], timing: Timing, *, timer: Timer = time.perf_counter) -> Samples:
    """Seconds of ``step()``: ``timing.warmup`` untimed runs, then timed ones until the spread is
    small, the budget is spent or ``timing.max_steps`` are taken (never fewer than ``min_steps``)."""
    for _ in range(timing.warmup):
        step()

    def seconds() -> float:
        start = timer()
        step()
        return timer() - start

    return _adaptive(seconds, timing, timer)


class _Stepper:
    """One plan's optimizer step on a model: its Accumulator and rank 0's batch; ``step()`` syncs."""

    def __init__(self, workload: Workload, device: Device, plan: Plan, model: torch.nn.Module,
                 opt: torch.optim.Optimizer, seed: int):
        target = device.torch_device
        self.sync = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)
        self.acc = Accumulator(model, opt, plan.schedule[0], loss=workload.loss, items=workload.items,
                               parts=[Batches(samples=workload.samples, split=workload.split)])
        self.batch = workload.batch(sum(plan.schedule[0]), torch.Generator().manual_seed(seed))

    def step(self) -> None:
        self.acc.step(self.batch)
        self.sync()


def _model(workload: Workload, device: Device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = workload.model().to(device.torch_device)
    model.train()
    return model, workload.optimizer(model.parameters())


def time_plan(workload: Workload, device: Device, plan: Plan, *, timing: Timing | None = None, seed: int = 0,
              timer: Timer = time.perf_counter) -> Samples:
    """Seconds of real optimizer steps by ``plan`` (rank 0's micro-batches), timed by ``timing``."""
    with own_random_state(device.torch_device, seed):
        stepper = _Stepper(workload, device, plan, *_model(workload, device), seed)
        stepper.sync()
        return repeat_until_stable(stepper.step, timing or Timing(), timer=timer)


def compare_plans(workload: Workload, device: Device, plan: Plan, other: Plan, *,
                  other_workload: Workload | None = None,
                  timing: Timing | None = None, seed: int = 0, timer: Timer = time.perf_counter) -> Samples:
    """Throughput of ``other`` over ``plan``'s, head to head: each value is one round's ratio of
    their step times, so both see the same load on a busy machine.

    With one workload, a round is one step of each (in alternating order) on one shared model and
    optimizer, so memory holds one model and the larger plan's activations. With another
    ``other_workload`` (other options), a round is a short measurement of each on a fresh model.
    Rounds repeat as ``timing`` says, on the ratios."""
    timing = timing or Timing()
    with own_random_state(device.torch_device, seed):
        if other_workload is None or other_workload is workload:
            model, opt = _model(workload, device)
            first, second = (_Stepper(workload, device, p, model, opt, seed) for p in (plan, other))
            for _ in range(timing.warmup):
                first.step()
                second.step()
            rounds = [0]

            def seconds(stepper: _Stepper) -> float:
                start = timer()
                stepper.step()
                return timer() - start

            def ratio() -> float:
                rounds[0] += 1
                if rounds[0] % 2:
                    mine = seconds(first)
                    return mine / seconds(second)
                theirs = seconds(second)
                return seconds(first) / theirs

            return _adaptive(ratio, timing, timer)
        block = Timing(warmup=timing.warmup, min_steps=3, max_steps=3, threshold=timing.threshold,
                       budget_s=timing.budget_s)

        def blocks() -> float:
            mine = time_plan(workload, device, plan, timing=block, seed=seed, timer=timer).median
            return mine / time_plan(other_workload, device, other, timing=block, seed=seed, timer=timer).median

        return _adaptive(blocks, timing, timer)
