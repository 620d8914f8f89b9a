"""The batch ramp at run time: the effective batch grows with the measured noise scale, step by exact step.

    plan = autotune.plan(1024, probe="my_model.py")
    step = autotune.Accumulator(model, optimizer, plan, loss=my_loss, parts=[autotune.RampConfig()])
    for batch in DataLoader(dataset, batch_sampler=step.ramp.sampler(len(dataset)), collate_fn=collate):
        step(batch)                      # the batch the ramp wants now, split by that phase's exact plan
    step.ramp.phases                     # what was done: BatchPhase records

:class:`BatchRamp` decides (the rule is :mod:`autotune.planning.ramp`'s) and
keeps the record; the Accumulator asks it, before each step, for the plan that
splits the batch it got and, after each step, shows it the noise scale. The
sampler asks it for the size of every batch it yields, so a change takes effect
at the next batch the loader builds: at once with ``num_workers=0``; a loader
with workers has already built ``prefetch_factor x num_workers`` batches, which
run at the old size first (the record says where each phase really began: a
phase begins at the first step whose batch is its size).

The learning rate of each phase is applied through the optimizer's param
groups for each ``optimizer.step()`` only (a step pre-hook multiplies every
group's rate, a post-hook puts the rate back), so a learning-rate scheduler
keeps setting the rate tuned for the target and the ramp's factor composes with it.

Under DDP every rank decides from the same pooled noise scale, and rank 0's
decision is broadcast (one integer, on the steps where the batch may grow), so
the ranks never disagree on the next batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from .. import log
from ..errors import BadInput
from ..planning.ramp import (
    SMALL_TARGET_SHARE,
    RampConfig,
    Reading,
    first_batch,
    least_start,
    next_batch,
    phase_lr_scale,
    phase_plan,
    ramp_quantum,
    window_reading,
)
from ..results.plan import Plan
from ..results.ramp import BatchPhase
from .distributed import collective_device
from .noise import GradientNoiseScale
from .sampler import PlanSampler, split

#: Optimizers whose step is the gradient times the rate (the ``noise`` rule's exponent 1); every other
#: optimizer normalises its step by gradient statistics (exponent ½).
PLAIN_GRADIENT_STEPS = (torch.optim.SGD, torch.optim.ASGD)


class BatchRamp:
    """The effective batch of a run as a schedule of exact phases that follows the measured noise scale.

    ``plan``: the plan for the target batch (its world size, memory limit ``max_micro_batch`` and
    ``multiple_of`` bound every phase). ``config``: see :class:`autotune.planning.ramp.RampConfig`.
    ``quantum``: the effective batches allowed below the target are its multiples (default the plan's
    ``multiple_of`` x world size; a framework that runs equal micro-batches of a fixed size passes micro-batch
    x world size).
    """

    def __init__(self, plan: Plan, config: RampConfig | None = None, *, rank: int | None = None,
                 process_group: Any = None, quantum: int | None = None):
        if not isinstance(plan, Plan):
            raise BadInput(f"a batch ramp needs the Plan of the target batch (its memory limit bounds every "
                           f"phase), got {type(plan).__name__}: pass the plan from autotune.plan or load_plan")
        self.plan, self.config = plan, config if config is not None else RampConfig()
        self.quantum = ramp_quantum(plan) if quantum is None else quantum
        self.world_size, self.process_group = plan.world_size, process_group
        self._rank = rank
        self.start = first_batch(plan, self.config, quantum=self.quantum)
        self.wanted = self.start           # the effective batch the next steps should take
        self.phases: list[BatchPhase] = []
        self.exponent = 1.0                # the noise rule's exponent, from the optimizer (attach)
        self._plans: dict[int, Plan] = {}
        self._decided: Reading | None = None  # the reading the wanted batch was decided from
        self._steps = 0
        self._in_phase = 0
        self._window: deque[tuple[float, float]] = deque(maxlen=self.config.window)  # latest (|G|², tr Σ)
        self._seen = 0  # noise-scale history entries read
        self._handles: list[Any] = []
        self._saved: list[Any] = []

    @property
    def rank(self) -> int:
        """This process's rank: as given, else the process group's now (a ramp may be made before the group)."""
        return _rank(self._rank, self.process_group)

    # -- what the loop and the loader ask -------------------------------------------------

    @property
    def effective_batch(self) -> int:
        """The effective batch (all ranks) the next batch should hold."""
        return self.wanted

    @property
    def per_rank_batch(self) -> tuple[int, ...]:
        """Each rank's share of the next batch."""
        return self.plan_for(self.wanted).per_rank_batch

    @property
    def lr_scale(self) -> float:
        """The factor on the learning rate in the phase running now (1 before the first)."""
        return self.phases[-1].lr_scale if self.phases else 1.0

    def plan_for(self, batch: int) -> Plan:
        """The exact plan of a phase of ``batch`` samples per step."""
        plan = self._plans.get(batch)
        if plan is None:
            plan = self._plans[batch] = phase_plan(batch, self.plan)
        return plan

    def sampler(self, dataset_size: int, **kwargs: Any) -> RampSampler:
        """A ``DataLoader`` batch sampler whose batches follow this ramp (see :class:`RampSampler`)."""
        return RampSampler(dataset_size, self, rank=self._rank, **kwargs)

    # -- the learning rate --------------------------------------------------------------------

    def attach(self, optimizer: Any) -> None:
        """Scale ``optimizer``'s learning rates by the phase's factor during each of its steps."""
        inner = _torch_optimizer(optimizer)
        self.exponent = 1.0 if isinstance(inner, PLAIN_GRADIENT_STEPS) else 0.5
        self.detach()
        self._handles = [inner.register_step_pre_hook(self._scale_lr), inner.register_step_post_hook(self._restore_lr)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _scale_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        scale = self.lr_scale
        self._saved = [group["lr"] for group in optimizer.param_groups]
        if scale != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * scale

    def _restore_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, self._saved):
            group["lr"] = lr
        self._saved = []

    # -- the steps -----------------------------------------------------------------------------

    def begin_step(self, samples: int) -> Plan | None:
        """Before a step with ``samples`` on this rank: the wanted phase begins when the batch is its share.
        Returns the plan that splits the batch (None: a batch of neither size, e.g. an epoch's last)."""
        wanted = self.plan_for(self.wanted)
        running = self.phases[-1].effective_batch if self.phases else None
        if running != self.wanted and samples == wanted.per_rank_batch[self.rank]:
            self._begin(wanted)
            return wanted
        if running is None:
            share = wanted.per_rank_batch[self.rank]
            raise BadInput(f"the batch ramp starts at {self.wanted} samples per step ({share} on rank {self.rank}) "
                           f"but the first batch holds {samples}: feed the batches the ramp "
                           "wants, e.g. DataLoader(dataset, batch_sampler=step.ramp.sampler(len(dataset)))")
        if samples == self.plan_for(running).per_rank_batch[self.rank]:
            return self.plan_for(running)
        return None

    def end_step(self, noise: GradientNoiseScale | None) -> int:
        """After an optimizer step: read the noise scale's new per-step estimates, decide the next batch;
        returns it."""
        self._steps += 1
        self._in_phase += 1
        if noise is not None:
            new = noise.since(self._seen)
            self._seen += len(new)
            self._window.extend((h.grad_sq, h.trace_cov) for h in new)
        if not self.phases:
            return self.wanted
        running = self.phases[-1].effective_batch
        if self.wanted != running or running >= self.plan.target_batch or self._in_phase < self.config.min_steps:
            return self.wanted  # a change not yet fed, the target reached, or the phase too young: nothing to agree
        reading = self.reading()
        decided = next_batch(running, target=self.plan.target_batch, quantum=self.quantum, reading=reading,
                             steps_in_phase=self._in_phase, config=self.config)
        if self.world_size > 1:
            decided = _from_rank_zero(decided, self.process_group)
        if decided != running:
            self.wanted, self._decided = decided, reading
        return self.wanted

    def reading(self) -> Reading:
        """The noise scale of the latest ``config.window`` measured steps, with its 95% interval."""
        return window_reading(self._window)

    def _begin(self, plan: Plan) -> None:
        reading = self._decided
        b = None if reading is None else reading.b_simple
        scale = phase_lr_scale(self.config.lr_scaling, batch=plan.target_batch, target=self.plan.target_batch,
                               noise_scale=b, exponent=self.exponent,
                               before=self.phases[-1].lr_scale if self.phases else None)
        phase = BatchPhase(first_step=self._steps, effective_batch=plan.target_batch, b_simple=b,
                           low=None if reading is None else reading.low, lr_scale=scale, schedule=plan.schedule)
        lr = f"lr x{scale:.2g} ({self.config.lr_scaling})"
        if not self.phases:
            toward = f"growing toward {self.plan.target_batch} with the measured noise scale" \
                if plan.target_batch < self.plan.target_batch else \
                f"the ramp starts at the target {self.plan.target_batch}: every step takes it, nothing to grow"
            log.progress(f"batch ramp: step 1 takes {plan.target_batch} samples ({plan.arithmetic}), {lr}; {toward}")
        else:
            was = self.phases[-1].effective_batch
            why = "" if reading is None or reading.low is None else \
                f" (noise scale ~{b:.3g}, 95% above {reading.low:.3g})"
            log.progress(f"batch ramp: step {self._steps + 1}: {was} -> {plan.target_batch} samples{why}: "
                         f"{plan.arithmetic}, {lr}")
        self.phases.append(phase)
        self._in_phase = 0


class RampSampler(PlanSampler):
    """A ``DataLoader`` batch sampler that yields this rank's share of the batch a :class:`BatchRamp` wants
    for each step: every step the next ``ramp.effective_batch`` indices of one permutation of the dataset (a
    new one each epoch, the same on every rank), split over the ranks by that phase's plan. The last, smaller
    batch of an epoch is split in the phase's proportions (``drop_last`` drops it). ``len()`` counts the
    batches of an epoch at the batch wanted now: an upper bound, since the batch only grows."""

    def __init__(self, dataset_size: int, ramp: BatchRamp, *, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        super().__init__(dataset_size, ramp, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.ramp = ramp
        _check_dataset(self.size, ramp)

    def __len__(self) -> int:
        shares = self.ramp.per_rank_batch
        full, rest = divmod(self.size, sum(shares))
        return full + (not self.drop_last and rest >= len(shares))

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        indices, at = order.tolist(), 0
        while at < self.size:
            shares = self.ramp.per_rank_batch
            window = indices[at:at + sum(shares)]
            at += len(window)
            if len(window) < sum(shares):
                if self.drop_last or len(window) < len(shares):
                    return
                shares = split(len(window), shares)
            start = sum(shares[:self.rank])
            yield window[start:start + shares[self.rank]]


def _check_dataset(size: int, ramp: BatchRamp) -> None:
    """BadInput, with the starts that would fit, when a dataset of ``size`` holds fewer samples than the batch
    ``ramp`` wants now: every step would be an epoch's short last batch, which no phase takes."""
    want = ramp.effective_batch
    if size >= want:
        return
    which = "the batch ramp's first batch" if not ramp.phases else "the batch the ramp wants now"
    least, q = least_start(ramp.world_size, ramp.quantum), ramp.quantum
    fits = (f"start the ramp within the dataset, RampConfig(start=N) with N from {least} to {size // q * q}, e.g. "
            f"{max(least, size // SMALL_TARGET_SHARE // q * q)}, or train on more data" if size >= least else
            f"train on more data (a ramp's batch holds at least {least})")
    raise BadInput(f"the dataset holds {size} samples, fewer than {which} of {want}: every step would be an "
                   f"epoch's short last batch, which no phase of the ramp takes; {fits}")


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (LightningOptimizer, AcceleratedOptimizer)."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise BadInput(f"the ramp scales the learning rate through a torch optimizer's param groups; got "
                       f"{type(optimizer).__name__}")
    return inner


def _rank(rank: int | None, group: Any) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _from_rank_zero(value: int, group: Any) -> int:
    """Rank 0's ``value`` on every rank (one broadcast of one integer)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(t.item())
