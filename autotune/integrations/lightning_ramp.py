"""The batch ramp under Lightning's automatic optimization: ``AutotuneBatchSize(target, ramp=RampConfig())``.

Lightning lets ``trainer.accumulate_grad_batches`` change at the start of an
epoch (what its own ``GradientAccumulationScheduler`` does): its loop counts
micro-batches from the epoch's first, so a change inside an epoch would step the
optimizer in the middle of an accumulation. So the ramp here changes the
effective batch only between epochs, in whole micro-batches: the batch size
stays the planned micro-batch (the memory limit) and each phase is ``k`` of them
per rank, ``micro-batch x k x world size`` samples, every micro-batch weighted
``1/k`` as Lightning weights them (exact for a loss that is a mean over
samples). The noise scale is measured from Lightning's own backward passes (the
callback hooks around each), the ramp decides after every optimizer step, and a
decision takes effect at the next epoch. The learning rate of each phase is
applied through the optimizer's param groups during each step, as for
:class:`autotune.Accumulator`. An epoch's last accumulation may be short (fewer
micro-batches than the phase's, or a last one of fewer samples): Lightning still
steps on it with every micro-batch weighted ``1/k`` as if full, so that step's
gradient is not the mean of its samples. Such a step is not measured, a
UserWarning says so (once for each size), and ``short_steps`` records it
(``{step: samples on this rank}``): the phases say what every other step took.
Lightning sized ``trainer.estimated_stepping_batches`` (and a schedule
built from it) for the target's accumulation, not the ramp's.

With manual optimization the ramp changes at any step boundary:
``accumulator(self, self.optimizers(), plan, loss=..., ramp=ramp)`` with a
:class:`autotune.training.ramp.BatchRamp` made before the dataloader, whose
``ramp.sampler(len(dataset))`` the dataloader takes.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from ..errors import PlanError
from ..planning.ramp import least_start, uniform_base
from ..results.plan import Plan
from ..results.ramp import RampConfig
from ..training.noise import GradientNoiseScale
from ..training.ramp import BatchRamp
from ..workload.batches import batch_size


class EpochRamp:
    """The ramp :class:`autotune.integrations.lightning.AutotuneBatchSize` follows when given ``ramp``; its
    hooks are the callback's. ``.ramp`` is the BatchRamp (its ``phases`` say what was done)."""

    def __init__(self, trainer: Trainer, module: LightningModule, plan: Plan, config: RampConfig):
        self.micro, self.world = plan.micro_batch, trainer.world_size
        base, quantum = uniform_base(plan)  # Lightning's batch size is fixed: whole micro-batches of the plan's
        _check_room(plan, config, self.world)
        self.ramp = BatchRamp(base, config, rank=trainer.global_rank, quantum=quantum)
        self.ramp.attach(trainer.optimizers[0])
        self.noise = GradientNoiseScale(module.parameters(), world_size=self.world)
        self._measuring = False
        self._stepped = False
        self._samples = 0                  # this rank's samples in the accumulation running
        self.short_steps: dict[int, int] = {}  # optimizer step (0-based) -> this rank's samples, where short
        self._said: set[tuple[int, int]] = set()
        self._micro_step: contextlib.AbstractContextManager[None] | None = None
        self.apply(trainer)

    @property
    def steps(self) -> int:
        """Micro-batches per optimizer step now."""
        return self.ramp.effective_batch // (self.micro * self.world)

    def apply(self, trainer: Trainer) -> None:
        """At an epoch's start: the accumulation of the batch the ramp wants."""
        trainer.accumulate_grad_batches = self.steps

    def batch_start(self, trainer: Trainer, batch: Any, batch_idx: int) -> None:
        k, n = trainer.accumulate_grad_batches, batch_size(batch)
        if batch_idx % k:
            self._samples += n
            if self._measuring and n != self.micro:  # the epoch's last micro-batch, short
                self.noise.drop_step("a short accumulation at an epoch's end")
            return
        self._samples = n
        left = trainer.num_training_batches - batch_idx
        self._measuring = n == self.micro and left >= k
        if self._measuring:  # a whole accumulation of k micro-batches of the planned size
            self.ramp.begin_step(self.micro * k)
            self.noise.begin_step(total_items=self.micro * k * self.world)

    def before_backward(self, trainer: Trainer) -> None:
        if self._measuring:
            self._micro_step = self.noise.micro_step(self.micro, 1.0 / trainer.accumulate_grad_batches)
            self._micro_step.__enter__()

    def after_backward(self) -> None:
        if self._micro_step is not None:
            self._micro_step.__exit__(None, None, None)
            self._micro_step = None

    def before_optimizer_step(self, trainer: Trainer) -> None:
        """After the last backward (and GradScaler's unscale), before clipping and the step."""
        if self._measuring:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.noise.end_step(scale=scaler.get_scale() if scaler is not None else 1.0)
            self._measuring = False
        self._stepped = True
        k = trainer.accumulate_grad_batches
        if self._samples != self.micro * k:
            self._short(trainer, k)

    def _short(self, trainer: Trainer, k: int) -> None:
        """Record (and say, once for each size) an optimizer step of fewer samples than the phase's."""
        step, took, want = self.ramp._steps, self._samples, self.micro * k
        self.short_steps[step] = took
        if (k, took) in self._said:
            return
        self._said.add((k, took))
        warnings.warn(
            f"batch ramp under Lightning: optimizer step {step + 1}, the last of epoch {trainer.current_epoch}, took "
            f"{took} samples on this rank instead of the phase's {want} ({k} micro-batches of {self.micro}), and "
            f"Lightning weights each of its micro-batches 1/{k} as if full, so that step's gradient is not the mean "
            f"of its samples; it is recorded in short_steps, not measured. For exact steps, ramp in "
            f"training_step with autotune.integrations.lightning.accumulator(..., ramp=...) and the ramp's "
            f"sampler, which weights every micro-batch by its samples", UserWarning, stacklevel=2)

    def batch_end(self) -> None:
        if self._stepped:  # the accumulation ended with an optimizer step: decide the next batch
            self._stepped = False
            self.ramp.end_step(self.noise)

    def close(self) -> None:
        self.ramp.detach()
        self.noise.close()


def _check_room(plan: Plan, config: RampConfig, world: int) -> None:
    """PlanError, with what would leave room, when whole micro-batches of the plan's size leave no batch a ramp may
    start from below the target (a start given is checked by the ramp itself)."""
    least = least_start(world, plan.micro_batch * world)
    if config.start is not None or least < plan.target_batch:
        return
    count = 2 if world == 1 else world
    where = "two on one rank" if world == 1 else f"one on each of {world} ranks"
    raise PlanError(f"ramp: Lightning's batch size stays the planned micro-batch, so a phase is whole micro-batches of "
                    f"{plan.micro_batch}, at least {where} (the noise scale needs two): {count} x {plan.micro_batch} = "
                    f"{least} is {'' if least == plan.target_batch else 'above '}the target {plan.target_batch}"
                    f"{' itself' if least == plan.target_batch else ''}, no room below it to ramp from. Give a smaller "
                    f"memory_budget (a smaller micro-batch), a larger target_batch (e.g. {4 * least}), or train "
                    "without the ramp")
