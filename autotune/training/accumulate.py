"""Exact gradient accumulation for your own training loop.

    plan = autotune.load_plan("plan.json")
    step = autotune.Accumulator(model, optimizer, plan, loss=my_loss, items=count_tokens)
    for batch in loader:                 # batches of plan.per_rank_batch[rank] samples
        loss = step(batch)               # k micro-steps, one optimizer step
    step.noise_scale.b_simple            # the gradient noise scale, measured on the way

At its core the Accumulator splits a batch into micro-batches and weights each
one exactly; the rest are parts it is composed of (:mod:`autotune.training.parts`):
how the ranks meet (:mod:`~autotune.training.sync`), the precision
(:mod:`~autotune.training.precision`), the noise-scale measurement
(:mod:`~autotune.training.noise`) and the batch ramp (:mod:`~autotune.training.ramp`).

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .. import options
from ..compat import tree_map
from ..errors import BadInput
from ..planning.ramp import RampConfig
from ..workload.batches import count_samples, item_weight, split_batch
from ..workload.bookkeeping import loss_total, weighted_loss
from .noise import GradientNoiseScale, NoiseScale
from .parts import Batches, Part, by_kind, old_keywords
from .precision import MixedPrecision
from .ramp import BatchRamp
from .sync import Sync


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

    ``schedule``: a Plan (its schedule for this rank) or the micro-batch sizes of
    this rank. ``loss(model, micro_batch)`` returns the mean loss over the
    micro-batch's items; ``items(micro_batch)`` counts them (default: samples).
    ``max_norm`` clips the accumulated gradient once, after the last micro-step.

    ``parts`` (see :mod:`autotune.training.parts`), each readable alone, each
    at most once, each with its default where it is left out:
    :class:`~autotune.training.parts.Batches` (counting, splitting and moving a
    batch), :class:`~autotune.training.sync.Sync` (the ranks: DDP's or FSDP's
    own, found from the model), :class:`~autotune.training.precision.MixedPrecision`
    (fp32 by default; bf16, fp16 with one GradScaler, or a framework's backward
    and clipping), :class:`~autotune.training.noise.NoiseScale` (on by default:
    ``accumulator.noise_scale.b_simple`` and friends, measured from the
    micro-steps' own gradients as they arrive; ``NoiseScale(measure=False)``
    measures nothing, a ``GradientNoiseScale`` of your own is used as it is) and
    a ramp (an :class:`autotune.RampConfig` or a
    :class:`autotune.training.ramp.BatchRamp`; ``schedule`` must then be the Plan
    of the target batch), which grows the effective batch with the measured
    noise scale, each phase an exact plan, changing only between steps:
    ``accumulator.ramp`` says what it wants and did; feed its batches with
    ``accumulator.ramp.sampler(len(dataset))`` (see :mod:`autotune.training.ramp`).
    The previous release's keywords (``precision=``, ``noise_scale=``,
    ``ramp=``, ``no_sync=``...) still work, with a DeprecationWarning.

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
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any, *,
                 loss: Callable[[nn.Module, Any], torch.Tensor], items: Callable[[Any], int] | None = None,
                 max_norm: float | None = None, parts: Iterable[Part] = (), **deprecated: Any):
        self.model, self.optimizer = model, optimizer
        self.loss_fn, self.items_fn = loss, items
        self.max_norm = options.max_norm(max_norm)
        given = by_kind([*parts, *old_keywords(deprecated)])
        batches: Batches = given.get("batches", Batches())
        self.samples_fn, self.split_fn = batches.samples, batches.split
        self.move = batches.move if batches.move is not None else _default_move(model)
        self.sync: Sync = given.get("sync", Sync()).bind(model)
        self.rank, self.world_size = self.sync.rank, self.sync.world_size
        self.amp: MixedPrecision = given.get("precision", MixedPrecision()).bind(model)
        self.device_type = self.amp.device_type
        self.sizes = _sizes_for(schedule, self.rank)
        self.largest = max(self.sizes)
        self.skipped_steps = 0
        noise = given.get("noise", NoiseScale())
        self.noise_scale = noise if isinstance(noise, GradientNoiseScale) else noise.build(
            model, world_size=self.world_size, process_group=self.sync.process_group)
        self.ramp = self._follow(given.get("ramp"), schedule)

    @property
    def precision(self) -> str:
        """fp32, bf16 or fp16: the precision part's."""
        return self.amp.name

    def reschedule(self, schedule: Any) -> None:
        """Split the next batches by ``schedule`` (a Plan, or this rank's micro-batch sizes): between steps only."""
        self.sizes = _sizes_for(schedule, self.rank)
        self.largest = max(self.sizes)

    def _follow(self, ramp: RampConfig | BatchRamp | None, schedule: Any) -> BatchRamp | None:
        """The BatchRamp this Accumulator follows (None without one), its learning-rate hooks on the optimizer."""
        if ramp is None:
            return None
        if self.noise_scale is None:
            raise BadInput("ramp grows the batch with the measured gradient noise scale: leave noise_scale on "
                           "(no NoiseScale(measure=False) in parts)")
        if isinstance(ramp, RampConfig):
            ramp = BatchRamp(schedule, ramp, rank=self.rank, process_group=self.sync.process_group)
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
            most = self.sync.most_steps(steps)  # every rank asks, planned or not: the ranks' collectives stay paired
            steps = steps if planned and not self.sync.every_micro_step else most
        if planned and steps == len(self.sizes):
            return list(self.sizes)
        if samples < 1:
            raise ValueError(f"rank {self.rank} got an empty batch: every rank needs at least one sample per step")
        base, extra = divmod(samples, steps)
        return [base + (i >= steps - extra) for i in range(steps)]

    def count_items(self, micro: Any, samples: int | None = None) -> int:
        """``n_i``: the items of a micro-batch (its samples without ``items``)."""
        if self.items_fn is not None:
            return int(self.items_fn(micro))
        return count_samples(micro, self.samples_fn) if samples is None else samples

    def weight(self, n_items: int, total_items: int) -> float:
        """A micro-step's loss weight: ``n_i / N``, times the world size under DDP (which averages)."""
        return item_weight(n_items, total_items, self.world_size)

    def total_items(self, local: int) -> int:
        """N: items of the whole effective batch, summed over ranks before the first backward."""
        return self.sync.total_items(local)

    def clip(self) -> torch.Tensor | None:
        """Clip the accumulated gradient to ``max_norm``; its norm before clipping (a tensor: no host sync),
        None without ``max_norm``."""
        if self.max_norm is None:
            return None
        return self.amp.clip(self.model.parameters(), self.max_norm)

    def finish(self, noise: GradientNoiseScale | None) -> torch.Tensor | None:
        """After the last micro-step: unscale (fp16), clip once, and close the noise scale's step with the
        unscaled, unclipped gradient; returns its norm before clipping (None without clipping)."""
        self.amp.unscale(self.optimizer)
        norm = self.clip()
        if noise is not None:
            noise.end_step(scale=self.amp.loss_scale(), grad_norm=norm)
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
            with self.sync.micro_step(last=i == last):
                micro = self.move(micro)
                with self.amp.autocast():
                    loss = self.loss_fn(self.model, micro)
                weight = self.weight(n, total)
                weighted = weighted_loss(loss, weight)
                if loss_sum is None:
                    loss_sum = loss_total(weighted)
                with noise.micro_step(n, weight) if noise is not None else contextlib.nullcontext():
                    self.amp.backward(weighted)
            loss_sum.add_(weighted.detach())
            del micro, loss, weighted
        norm = self.finish(noise)
        assert loss_sum is not None  # the last micro-batch always holds samples
        return StepOutcome(loss=self.sync.global_loss(loss_sum), samples=sum(sizes), items=sum(counts),
                           total_items=total, micro_steps=len(micros),
                           grad_norm=None if norm is None else float(norm))

    def step(self, batch: Any) -> StepOutcome:
        """One accumulated optimizer step over ``batch``, this rank's share of the effective batch."""
        if self.ramp is not None:
            self._begin_phase(count_samples(batch, self.samples_fn))
        out = self.backward(batch)
        if self.amp.step(self.optimizer):  # fp16: inf/nan found, the step was skipped
            self.skipped_steps += 1
            out = replace(out, skipped=True)
        self.optimizer.zero_grad(set_to_none=True)
        if self.ramp is not None:
            self.ramp.end_step(self.noise_scale)
        return out

    def __call__(self, batch: Any) -> float:
        """One accumulated optimizer step; returns the effective batch's loss."""
        return self.step(batch).loss

    def repartitioned(self, sizes: list[int]) -> Accumulator:
        """This accumulation (model, optimizer, loss, items, clipping, precision, synchronisation) over
        other micro-batch sizes of this rank, as autotune's own ``Accumulator`` with autotune's own parts,
        measuring no noise."""
        batches = Batches(samples=self.samples_fn, split=self.split_fn, move=self.move)
        sync = Sync(rank=self.rank, world_size=self.world_size, process_group=self.sync.process_group,
                    no_sync=self.sync.no_sync, external=True)
        amp = MixedPrecision(self.amp.name, backward=self.amp.backward_fn, clip=self.amp.clip_fn)
        return Accumulator(self.model, self.optimizer, sizes, loss=self.loss_fn, items=self.items_fn,
                           max_norm=self.max_norm, parts=[batches, sync, amp, NoiseScale(measure=False)])


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


def _default_move(model: nn.Module) -> Callable[[Any], Any]:
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    if device.type == "cpu":
        return lambda batch: batch  # host batches are where a CPU model computes
    return lambda batch: tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t,
                                  batch)
