"""Lightning: a batch size and gradient accumulation that give exactly the target batch, and exact
accumulation in manual optimization.

    trainer = Trainer(callbacks=[AutotuneBatchSize(1024)])      # like BatchSizeFinder, for an exact target
    trainer.fit(model, datamodule=data)
    Trainer(callbacks=[AutotuneBatchSize(1024, ramp=autotune.RampConfig())])   # grow toward it, epoch by epoch

:class:`AutotuneBatchSize` probes the LightningModule's own ``training_step``
with the optimizer its ``configure_optimizers`` made, on the largest of the
first batches of its train dataloader (the longest padded sequences, the
largest images), under the Trainer's precision; every rank probes and the
smallest maximum holds for all. It then sets the ``batch_size`` attribute (on
the module, its hparams or the datamodule, as Lightning's tuner does) and
``trainer.accumulate_grad_batches`` so that ``batch_size x k x world size ==
target``, with equal micro-batches of at least about half the largest that
fits (Lightning averages each micro-batch's loss with the same weight), and the
train dataloader is rebuilt with the new size. Lightning takes one batch size
for every rank, so ranks that differ all run the smallest rank's
(``uniform_ranks``); :func:`accumulator` with a :class:`autotune.PlanSampler`
runs a plan that gives each rank its own.

:func:`accumulator` is for manual optimization: an Accumulator wired to
``manual_backward`` (the Trainer's precision and DDP's reducer) and to the
strategy's ``block_backward_sync``, so that micro-steps before the last
accumulate locally and the last one synchronises, once per optimizer step.
Needs ``lightning`` (``pip install autotune[lightning]``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from torch import nn

from .. import api, log, options
from ..devices import Device
from ..errors import BadInput, NoUniformPlan
from ..planning.exports import no_equal_split
from ..results.ramp import RampConfig
from ..training import Accumulator, Batches, MixedPrecision, Sync
from ..training.parts import Part
from ..workload import Workload
from .common import largest_batch, short_dataset
from .packed import is_packed, packed_workload

if TYPE_CHECKING:
    from ..results.plan import Plan
    from ..training.ramp import BatchRamp
    from .lightning_ramp import EpochRamp

#: Batches of the train dataloader looked at for the largest one.
SCAN_BATCHES = 16


class AutotuneBatchSize(Callback):
    """Sets the batch size and ``accumulate_grad_batches`` for exactly ``target_batch`` samples per optimizer
    step, at the start of ``fit`` (see the module docstring); the Plan is ``.plan`` afterwards.

    ``device``: where to probe (default: the Trainer's device for this rank); ``memory_budget`` and
    ``margin`` as :func:`autotune.plan`. ``scan_batches``: how many batches of the train dataloader are
    looked at for the largest. The batch size must be read by the dataloader hook (``self.batch_size``
    in ``train_dataloader``), and a learning-rate schedule sized by ``trainer.estimated_stepping_batches``
    in ``configure_optimizers`` was sized before the accumulation changed.

    ``ramp`` (an :class:`autotune.RampConfig`): start at a small effective batch and grow it toward the target
    with the measured gradient noise scale, changing ``accumulate_grad_batches`` at epoch starts only (see
    :mod:`autotune.integrations.lightning_ramp`); ``.ramp.ramp.phases`` says what was done, and
    ``.ramp.short_steps`` the epochs' last steps that took fewer samples than their phase.
    """

    def __init__(self, target_batch: int, *, batch_arg_name: str = "batch_size", device: Device | str | None = None,
                 memory_budget: int | str | None = None, margin: float = options.MARGIN,
                 scan_batches: int = SCAN_BATCHES, ramp: RampConfig | None = None):
        self.target_batch = options.whole(target_batch, "target_batch", example="1024", text=False)
        self.margin = options.margin(margin, text=False)
        self.memory_budget = options.memory_budget(memory_budget)
        self.scan_batches = options.whole(scan_batches, "scan_batches", text=False)
        self.batch_arg_name, self.device = batch_arg_name, device
        self.plan: Plan | None = None
        if ramp is not None and not isinstance(ramp, RampConfig):
            raise BadInput(f"ramp must be an autotune.RampConfig, got {type(ramp).__name__}")
        self.ramp_config = ramp
        self.ramp: EpochRamp | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise BadInput("AutotuneBatchSize sets accumulate_grad_batches, which manual optimization does not use: "
                           "use autotune.integrations.lightning.accumulator in training_step instead")
        source = getattr(trainer.fit_loop, "_data_source", None)
        if source is not None and not source.is_module():
            raise BadInput("AutotuneBatchSize sets the batch size the train_dataloader hook reads, but the dataloader "
                           "was passed to fit() directly: build it in the LightningModule or a LightningDataModule")
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise BadInput(f"batch_arg_name {self.batch_arg_name!r} is neither an attribute of the LightningModule, "
                           "of its hparams nor of the datamodule: give the name your train_dataloader reads")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loaders = _train_loaders(trainer, pl_module)
        batch, seen = largest_batch(_batches(loaders), self.scan_batches)
        log.progress(f"probing on the largest of {seen} batches of the train dataloader")
        workload = module_workload(trainer, pl_module, batch)
        device = self.device if self.device is not None else str(trainer.strategy.root_device)
        try:
            plan = api.plan(self.target_batch, probe=workload, device=device, memory_budget=self.memory_budget,
                            margin=self.margin, world_size=trainer.world_size, uniform=True, uniform_ranks=True)
        except NoUniformPlan as exc:
            raise no_equal_split(exc, "lightning", target_name="target_batch") from None
        plan = short_dataset(plan, getattr(loaders, "dataset", None), "Lightning", warn=trainer.is_global_zero)
        lightning_setattr(pl_module, self.batch_arg_name, plan.micro_batch)
        trainer.accumulate_grad_batches = plan.accumulation_steps
        trainer.fit_loop._combined_loader = None  # built again, with the new batch size, when the fit loop starts
        log.progress(f"plan: {plan.arithmetic}: {self.batch_arg_name}={plan.micro_batch}, "
                     f"accumulate_grad_batches={plan.accumulation_steps}")
        self.plan = plan
        if self.ramp_config is not None:
            from .lightning_ramp import EpochRamp

            self.ramp = EpochRamp(trainer, pl_module, plan, self.ramp_config)

    # -- the ramp's hooks (nothing without ramp) ------------------------------------------------

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ramp is not None:
            self.ramp.apply(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.ramp is not None:
            self.ramp.batch_start(trainer, batch, batch_idx)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.ramp is not None:
            self.ramp.before_backward(trainer)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ramp is not None:
            self.ramp.after_backward()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.ramp is not None:
            self.ramp.before_optimizer_step(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.ramp is not None:
            self.ramp.batch_end()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ramp is not None:
            self.ramp.close()


def module_workload(trainer: Trainer, module: LightningModule, batch: Any) -> Workload:
    """The Workload of ``module`` as ``trainer`` trains it: its ``training_step`` under the Trainer's precision,
    the optimizer its ``configure_optimizers`` made, on batches like ``batch``."""
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    precision = trainer.precision_plugin

    def loss(model: nn.Module, micro: Any) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() in a copy that no Trainer holds: nothing to log to
            with precision.train_step_context():
                out = model.training_step(micro, 0)  # type: ignore[operator]
        value = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(value, torch.Tensor):
            raise BadInput(f"training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss': "
                           "AutotuneBatchSize probes the loss Lightning would call backward on")
        return value

    made = Workload.from_model(module, batch, loss=loss, optimizer=optimizer, name=type(module).__name__)
    return packed_workload(made, batch) if is_packed(batch) else made  # a flattening collator's one row


def _train_loaders(trainer: Trainer, module: LightningModule) -> Any:
    """What the train dataloader hook (the datamodule's or the module's) returns: a loader or a collection."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    return source.dataloader() if source is not None else module.train_dataloader()


def _batches(loaders: Any):
    """Batches as the train dataloader(s) yield them."""
    for batch, _, _ in CombinedLoader(loaders, mode="max_size_cycle"):
        yield batch


def accumulator(module: LightningModule, optimizer: Any, plan: Any, *, loss: Callable[[nn.Module, Any], torch.Tensor],
                items: Callable[[Any], int] | None = None, max_norm: float | None = None,
                move: Callable[[Any], Any] | None = None,
                ramp: RampConfig | BatchRamp | None = None) -> Accumulator:
    """An :class:`autotune.Accumulator` for ``training_step`` in manual optimization.

        def on_train_start(self):
            self.accumulate = accumulator(self, self.optimizers(), plan, loss=my_loss, items=count_tokens)

        def training_step(self, batch, batch_idx):          # this rank's share of one effective batch
            self.log("loss", self.accumulate(batch))         # k micro-steps, one optimizer step

    Backward is ``module.manual_backward`` (the Trainer's precision, DDP's reducer); micro-steps before
    the last run in the strategy's ``block_backward_sync``, so DDP synchronises once, after the last;
    ``max_norm`` clips with ``module.clip_gradients`` (which unscales first). ``optimizer``: the
    LightningOptimizer ``self.optimizers()`` returns, whose ``step`` the Trainer counts. Supports one
    process and DDP; batches are the loader's (plan.per_rank_batch[rank] samples each for an exact
    target, e.g. from :class:`autotune.PlanSampler`), so a plan for ranks that differ runs too: each
    rank its own micro-batches and micro-steps. ``ramp``: grow the effective batch with the measured noise
    scale at any step boundary (a :class:`autotune.training.ramp.BatchRamp` made before the dataloader, which takes
    its ``ramp.sampler(len(dataset))``; see :mod:`autotune.integrations.lightning_ramp`).
    """
    if module.automatic_optimization:
        raise BadInput("accumulator is for manual optimization: set self.automatic_optimization = False in the "
                       "LightningModule, or use AutotuneBatchSize with automatic optimization")
    trainer = module.trainer
    strategy = trainer.strategy
    if trainer.world_size > 1 and not isinstance(strategy.model, nn.parallel.DistributedDataParallel):
        raise BadInput(f"accumulator supports one process and DDP, not {type(strategy).__name__} with "
                       f"{trainer.world_size} processes: use strategy='ddp'")

    def clip_with(value: float) -> None:
        module.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm="norm")

    # DDP's reducer synchronises through manual_backward: the module itself is not the DDP wrapper.
    parts: list[Part] = [
        Batches(move=move), MixedPrecision(backward=module.manual_backward, clip=clip_with),
        Sync(no_sync=getattr(strategy, "block_backward_sync", contextlib.nullcontext), external=True)]
    return Accumulator(module, optimizer, plan, loss=loss, items=items, max_norm=max_norm,
                       parts=parts if ramp is None else [*parts, ramp])
