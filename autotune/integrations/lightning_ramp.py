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
:class:`autotune.Accumulator`. An epoch's last, shorter accumulation is not
measured. Lightning sized ``trainer.estimated_stepping_batches`` (and a schedule
built from it) for the target's accumulation, not the ramp's.

With manual optimization the ramp changes at any step boundary:
``accumulator(self, self.optimizers(), plan, loss=..., ramp=ramp)`` with a
:class:`autotune.training.ramp.BatchRamp` made before the dataloader, whose
``ramp.sampler(len(dataset))`` the dataloader takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from lightning.pytorch import LightningModule, Trainer

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
        base = dataclasses.replace(plan, max_micro_batch=plan.micro_batch)  # Lightning's batch size is fixed
        self.ramp = BatchRamp(base, config, rank=trainer.global_rank, quantum=self.micro * self.world)
        self.ramp.attach(trainer.optimizers[0])
        self.noise = GradientNoiseScale(module.parameters(), world_size=self.world)
        self._measuring = False
        self._stepped = False
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
        k = trainer.accumulate_grad_batches
        if batch_idx % k:
            return
        left = trainer.num_training_batches - batch_idx
        self._measuring = batch_size(batch) == self.micro and left >= k
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

    def batch_end(self) -> None:
        if self._stepped:  # the accumulation ended with an optimizer step: decide the next batch
            self._stepped = False
            self.ramp.end_step(self.noise)

    def close(self) -> None:
        self.ramp.detach()
        self.noise.close()
