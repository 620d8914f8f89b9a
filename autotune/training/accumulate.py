"""Exact gradient accumulation for your own training loop.

    plan = autotune.load_plan("plan.json")
    step = autotune.Accumulator(model, optimizer, plan, loss=my_loss, items=count_tokens)
    for batch in loader:                 # batches of plan.per_rank_batch[rank] samples
        loss = step(batch)               # k micro-steps, one optimizer step
    step.noise_scale.b_simple            # the gradient noise scale, measured on the way

Each micro-step's mean loss is weighted ``n_i / N`` (``n_i`` items in the
micro-batch, ``N`` in the whole effective batch over all ranks), so the
accumulated gradient is the gradient of the mean over all ``N`` items, exactly,
whatever the micro-batch sizes and however many tokens each one holds. Under
DDP, micro-steps 1..k-1 run in ``no_sync()``, ``N`` is summed over ranks before
the first backward, and the weight carries the world size to undo DDP's
averaging. Ranks may run different numbers of micro-steps (a plan for ranks that
differ): each runs exactly one synchronising backward per optimizer step, its
last, which meets the others' last. Clipping and GradScaler's unscale happen
once, after the last micro-step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .. import options
from ..compat import tree_map
from ..errors import BadInput
from ..planning.ramp import RampConfig
from ..workload.batches import Samples, Split, count_samples, item_weight, split_batch
from ..workload.bookkeeping import loss_total, weighted_loss
from .distributed import collective_device
from .noise import GradientNoiseScale
from .ramp import BatchRamp


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """One accumulated optimizer step: its loss and what it consumed."""

    loss: float            # mean over all N items of the effective batch (all ranks)
    samples: int           # samples this rank fed to the loss
    items: int             # items this rank fed to the loss
    total_items: int       # N: items over all ranks
    micro_steps: int
    skipped: bool = False  # fp16: GradScaler found inf/nan and skipped the optimizer step
    grad_norm: float | None = None


class Accumulator:
    """Performs one accumulated optimizer step per effective batch, by a plan's schedule.

    ``schedule``: a Plan (its schedule for ``rank``) or the micro-batch sizes of
    this rank. ``loss(model, micro_batch)`` returns the mean loss over the
    micro-batch's items; ``items(micro_batch)`` counts them (default: samples).
    ``samples(batch)`` counts a batch's samples and ``split(batch, sizes)``
    splits it into micro-batches of ``sizes`` samples, for batches that are not
    one row per sample (packed sequences, graphs; see :class:`autotune.Workload`);
    by default a batch is its tensors' shared first dimension, sliced.
    ``move`` puts a micro-batch on the device (default: ``.to(device)`` of the
    model's first parameter). ``max_norm`` clips the accumulated gradient once.
    ``precision``: fp32, bf16 (autocast) or fp16 (autocast + one GradScaler).
    ``backward(loss)`` is the framework's backward where it has one
    (``accelerator.backward``, a LightningModule's ``manual_backward``);
    ``no_sync()`` the context in which gradients are not synchronised across
    ranks (default: the model's own: DDP's ``no_sync()``, or for a model sharded
    by ``fully_shard`` gradient sync off via ``set_requires_gradient_sync``). With several ranks
    the model must synchronise gradients (DDP, FSDP) unless ``external_sync``
    says the caller does.

    ``noise_scale`` (on by default) measures the gradient noise scale from the
    micro-steps' own gradients as they arrive (one norm per parameter and
    micro-step, no copy): ``accumulator.noise_scale.b_simple`` and friends, see
    :mod:`autotune.training.noise`. Pass False to measure nothing (no hooks), or
    a ``GradientNoiseScale`` of your own (e.g. measuring every n-th step).

    A plan for ranks that differ gives this rank its own micro-batches and
    number of micro-steps (``plan.schedule[rank]``); under DDP it runs them as
    planned, its last one synchronising with the others' last, and a model
    sharded by FSDP (whose every micro-step meets the other ranks') runs as
    many as the rank with the most.

    A batch of another size than the schedule's total (the last batch of a
    ``DataLoader`` without ``drop_last``) is split into the fewest micro-batches
    of at most the schedule's largest, as even as possible, and weighted over
    its own items; under DDP every rank then runs the same number of
    micro-steps (the most any rank needs).

    ``ramp`` (an :class:`autotune.RampConfig`, or a :class:`autotune.training.ramp.BatchRamp`; ``schedule``
    must then be the Plan of the target batch) grows the effective batch with the measured noise scale, each
    phase an exact plan, changing only between steps: ``accumulator.ramp`` says what it wants and did; feed
    its batches with ``accumulator.ramp.sampler(len(dataset))``. See :mod:`autotune.training.ramp`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any, *,
                 loss: Callable[[nn.Module, Any], torch.Tensor], items: Callable[[Any], int] | None = None,
                 move: Callable[[Any], Any] | None = None, max_norm: float | None = None,
                 precision: str = "fp32", rank: int | None = None, world_size: int | None = None,
                 process_group: Any = None, backward: Callable[[torch.Tensor], Any] | None = None,
                 no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                 external_sync: bool = False, noise_scale: bool | GradientNoiseScale = True,
                 ramp: RampConfig | BatchRamp | None = None, samples: Samples | None = None,
                 split: Split | None = None):
        self.model, self.optimizer = model, optimizer
        self.loss_fn, self.items_fn = loss, items
        self.samples_fn, self.split_fn = samples, split
        self.max_norm, self.precision = options.max_norm(max_norm), options.precision(precision)
        self.process_group = process_group
        self.rank, self.world_size = _rank_and_world(rank, world_size, process_group)
        self._backward = backward if backward is not None else torch.Tensor.backward
        if self.world_size > 1 and not external_sync and not _synchronises(model):
            raise BadInput(
                f"{self.world_size} ranks are training but the model ({type(model).__name__}) is not wrapped in "
                "DistributedDataParallel or FSDP, so every rank would keep its own gradients and the parameters "
                "would drift apart: wrap it (DistributedDataParallel(model), accelerator.prepare(model)), use "
                "autotune.integrations.lightning.accumulator in a LightningModule, or pass external_sync=True if "
                "you all-reduce the gradients yourself")
        self.sizes = _sizes_for(schedule, self.rank)
        self.largest = max(self.sizes)
        self.device_type = _device_type(model)
        self.move = move if move is not None else _default_move(model)
        self.scaler = torch.amp.GradScaler(self.device_type) if precision == "fp16" else None
        self._no_sync = no_sync if no_sync is not None else _own_no_sync(model)
        self.in_step = _sharded(model)  # FSDP gathers parameters in every micro-step, on all ranks together
        self.skipped_steps = 0
        self.noise_scale = _noise_scale(noise_scale, model, self.world_size, process_group)
        self.ramp = self._follow(ramp, schedule)

    def reschedule(self, schedule: Any) -> None:
        """Split the next batches by ``schedule`` (a Plan, or this rank's micro-batch sizes): between steps only."""
        self.sizes = _sizes_for(schedule, self.rank)
        self.largest = max(self.sizes)

    def _follow(self, ramp: RampConfig | BatchRamp | None, schedule: Any) -> BatchRamp | None:
        """The BatchRamp this Accumulator follows (None without one), its learning-rate hooks on the optimizer."""
        if ramp is None:
            return None
        if not isinstance(ramp, (RampConfig, BatchRamp)):
            raise BadInput(f"ramp must be an autotune.RampConfig or a BatchRamp, got {type(ramp).__name__}")
        if self.noise_scale is None:
            raise BadInput("ramp grows the batch with the measured gradient noise scale: leave noise_scale on "
                           "(noise_scale=True, or a GradientNoiseScale of your own)")
        if isinstance(ramp, RampConfig):
            ramp = BatchRamp(schedule, ramp, rank=self.rank, process_group=self.process_group)
        if ramp.world_size != self.world_size:
            raise BadInput(f"the ramp's plan is for {ramp.world_size} rank(s) but {self.world_size} are training")
        ramp.attach(self.optimizer)
        self.reschedule(ramp.plan_for(ramp.wanted))
        return ramp

    def _begin_phase(self, samples: int) -> None:
        """Before a step of ``samples`` on this rank under a ramp: split it by its phase's plan. When a new phase
        begins on a CUDA device, the caching allocator's unused blocks go back first: they were cut for the old
        micro-batch sizes, and kept, they would add to the new sizes' blocks in the reserved memory the fit rule
        bounds."""
        assert self.ramp is not None
        before = len(self.ramp.phases)
        phase = self.ramp.begin_step(samples)
        if phase is not None:
            self.reschedule(phase)
        if before and len(self.ramp.phases) > before and self.device_type == "cuda":
            torch.cuda.empty_cache()

    # -- the pieces a step is made of --------------------------------------------------

    def split(self, batch: Any) -> list[Any]:
        """This rank's micro-batches of ``batch`` (empty ones first, when a rank has fewer samples
        than the ranks' agreed micro-steps)."""
        sizes = self.sizes_for(count_samples(batch, self.samples_fn))
        return split_batch(batch, sizes, samples=self.samples_fn, split=self.split_fn)

    def sizes_for(self, samples: int) -> list[int]:
        """Micro-batch sizes for a batch of ``samples``: the schedule when it is the schedule's
        total, else the fewest of at most the largest planned size, as even as possible. Under DDP
        a rank keeps its own schedule however many micro-steps the others run (only the last one
        synchronises); ranks whose every micro-step meets the others' (FSDP) run as many as the most."""
        planned = samples == sum(self.sizes)
        steps = len(self.sizes) if planned else -(-samples // self.largest)
        if self.world_size > 1:
            most = self._most_steps(steps)  # every rank asks, planned or not: the ranks' collectives stay paired
            steps = steps if planned and not self.in_step else most
        if planned and steps == len(self.sizes):
            return list(self.sizes)
        if samples < 1:
            raise ValueError(f"rank {self.rank} got an empty batch: every rank needs at least one sample per step")
        base, extra = divmod(samples, steps)
        return [base + (i >= steps - extra) for i in range(steps)]

    def count_items(self, micro: Any, samples: int | None = None) -> int:
        if self.items_fn is not None:
            return int(self.items_fn(micro))
        return count_samples(micro, self.samples_fn) if samples is None else samples

    def weight(self, n_items: int, total_items: int) -> float:
        return item_weight(n_items, total_items, self.world_size)

    def total_items(self, local: int) -> int:
        """N: items of the whole effective batch, summed over ranks before the first backward."""
        if self.world_size == 1:
            return local
        import torch.distributed as dist

        t = torch.tensor([local], dtype=torch.int64, device=collective_device(self.process_group))
        dist.all_reduce(t, group=self.process_group)
        return int(t.item())

    def clip(self) -> torch.Tensor | None:
        """Clip the accumulated gradient to ``max_norm``; its norm before clipping (a tensor: no host sync),
        None without ``max_norm``."""
        if self.max_norm is None:
            return None
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def finish(self, noise: GradientNoiseScale | None) -> torch.Tensor | None:
        """After the last micro-step: unscale (fp16), clip once, and close the noise scale's step with the
        unscaled, unclipped gradient; returns its norm before clipping (None without clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = self.clip()
        if noise is not None:
            noise.end_step(scale=self.scaler.get_scale() if self.scaler is not None else 1.0, grad_norm=norm)
        return norm

    # -- a whole step ------------------------------------------------------------------

    def backward(self, batch: Any) -> StepOutcome:
        """All micro-steps of one effective batch: gradients accumulated (and clipped), no optimizer step."""
        micros = self.split(batch)
        sizes = [count_samples(m, self.samples_fn) for m in micros]  # what is fed to the loss, as split
        counts = [self.count_items(m, n) if n else 0 for m, n in zip(micros, sizes)]
        total = self.total_items(sum(counts))
        noise = self.noise_scale
        if noise is not None:
            noise.begin_step(total)
        loss_sum = None  # summed on the device: one host sync per step, not per micro-step
        last = len(micros) - 1
        for i, (micro, n) in enumerate(zip(micros, counts)):
            if not sizes[i]:
                continue  # this rank has fewer samples than the ranks' micro-steps
            with self._sync(i == last):
                micro = self.move(micro)
                with self.autocast():
                    loss = self.loss_fn(self.model, micro)
                weight = self.weight(n, total)
                weighted = weighted_loss(loss, weight)
                if loss_sum is None:
                    loss_sum = loss_total(weighted)
                with noise.micro_step(n, weight) if noise is not None else contextlib.nullcontext():
                    self._backward(self.scaler.scale(weighted) if self.scaler else weighted)
            loss_sum.add_(weighted.detach())
            del micro, loss, weighted
        norm = self.finish(noise)
        assert loss_sum is not None  # the last micro-batch always holds samples
        return StepOutcome(loss=self._global_loss(loss_sum), samples=sum(sizes), items=sum(counts),
                           total_items=total, micro_steps=len(micros),
                           grad_norm=None if norm is None else float(norm))

    def step(self, batch: Any) -> StepOutcome:
        """One accumulated optimizer step over ``batch``, this rank's share of the effective batch."""
        if self.ramp is not None:
            self._begin_phase(count_samples(batch, self.samples_fn))
        out = self.backward(batch)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:  # inf/nan found: the step was skipped
                self.skipped_steps += 1
                out = replace(out, skipped=True)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ramp is not None:
            self.ramp.end_step(self.noise_scale)
        return out

    def __call__(self, batch: Any) -> float:
        """One accumulated optimizer step; returns the effective batch's loss."""
        return self.step(batch).loss

    def repartitioned(self, sizes: list[int]) -> Accumulator:
        """This accumulation (model, optimizer, loss, items, clipping, precision, synchronisation) over
        other micro-batch sizes of this rank, as autotune's own ``Accumulator``, measuring no noise."""
        return Accumulator(self.model, self.optimizer, sizes, loss=self.loss_fn, items=self.items_fn,
                           move=self.move, max_norm=self.max_norm, precision=self.precision, rank=self.rank,
                           world_size=self.world_size, process_group=self.process_group,
                           backward=self._backward, no_sync=self._no_sync, external_sync=True, noise_scale=False,
                           samples=self.samples_fn, split=self.split_fn)

    # -- helpers -------------------------------------------------------------------------

    def _most_steps(self, steps: int) -> int:
        """The most micro-steps any rank needs this step (every rank must run as many)."""
        import torch.distributed as dist

        t = torch.tensor([steps], dtype=torch.int64, device=collective_device(self.process_group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(t.item())

    def _sync(self, last: bool):
        if not last and self._no_sync is not None:
            return self._no_sync()
        return contextlib.nullcontext()

    def _global_loss(self, loss_sum: torch.Tensor) -> float:
        # Weights carry W under DDP: each rank's sum / W is its share of the global mean.
        if self.world_size == 1:
            return float(loss_sum)
        import torch.distributed as dist

        t = loss_sum.double().to(collective_device(self.process_group)) / self.world_size
        dist.all_reduce(t, group=self.process_group)
        return float(t)


def _sizes_for(schedule: Any, rank: int) -> list[int]:
    if hasattr(schedule, "schedule"):
        rows = schedule.schedule
        if rank >= len(rows):
            raise ValueError(f"rank {rank} is outside the plan's {len(rows)} ranks")
        return [int(n) for n in rows[rank]]
    sizes = [int(n) for n in schedule]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"a schedule needs at least one micro-batch of at least 1 sample, got {sizes}")
    return sizes


def _noise_scale(setting: bool | GradientNoiseScale, model: nn.Module, world_size: int,
                 group: Any) -> GradientNoiseScale | None:
    """The noise-scale measurement an Accumulator makes: a given one, a new one, or none (off, or FSDP1,
    whose flat parameters hide each parameter's gradient); under FSDP2 on the unsharded parameters."""
    if isinstance(setting, GradientNoiseScale):
        return setting
    if not setting or not any(p.requires_grad for p in model.parameters()):
        return None
    if not _sharded(model):
        return GradientNoiseScale(model.parameters(), world_size=world_size, process_group=group)
    if not hasattr(model, "unshard"):  # FSDP1: its flat parameters hide each parameter's gradient
        return None
    from .fsdp import unsharded_parameters

    return GradientNoiseScale(unsharded_parameters(model), world_size=world_size, process_group=group,
                              totals=model.parameters())


def _sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def _synchronises(model: nn.Module) -> bool:
    """Does ``model`` synchronise gradients across ranks itself (DDP, FSDP1, FSDP2)?"""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel) or _sharded(model)


def _own_no_sync(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """The model's own context without gradient synchronisation, if it has one."""
    own: Any = getattr(model, "no_sync", None)  # DDP, FSDP1
    if own is not None:
        return own
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        from .fsdp import gradient_sync_off

        return lambda: gradient_sync_off(model)
    return None


def _rank_and_world(rank: int | None, world: int | None, group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank(group) if rank is None else rank,
                dist.get_world_size(group) if world is None else world)
    return (0 if rank is None else rank, 1 if world is None else world)


def _device_type(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return p.device.type if p is not None else "cpu"


def _default_move(model: nn.Module) -> Callable[[Any], Any]:
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    if device.type == "cpu":
        return lambda batch: batch  # host batches are where a CPU model computes
    return lambda batch: tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t,
                                  batch)
