"""Accelerate: exact accumulation in an Accelerate loop.

    accelerator = Accelerator()                                   # gradient_accumulation_steps left at 1
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = accumulator(accelerator, model, optimizer, plan, loss=my_loss, max_norm=1.0)
    for batch in loader:                                          # plan.per_rank_batch[rank] samples each
        step(batch)                                               # k micro-steps, one optimizer step

:func:`accumulator` is an :class:`autotune.Accumulator` wired to what the
Accelerator owns: its ``backward`` (loss scaling under fp16, DeepSpeed's
engine), its ``no_sync(model)``, and its ``clip_grad_norm_``, which unscales
the GradScaler's gradients before clipping. Mixed precision is the
Accelerator's (``Accelerator(mixed_precision="bf16")`` autocasts the prepared
model's forward), so the Accumulator's own ``precision`` stays fp32. The
Accumulator weights each micro-batch by its share of the items and steps the
optimizer itself, so the Accelerator must not accumulate too: its
``gradient_accumulation_steps`` stays 1 and ``accelerator.accumulate()`` is not
used. Each rank's batches are its share of the plan (``PlanSampler``, the loader not
prepared), so a plan for ranks that differ runs as planned: each rank its own
micro-batches and micro-steps, under DDP (under FSDP, whose every micro-step
gathers parameters on all ranks, each rank runs as many as the most; DeepSpeed's
ZeRO-3 gathers them too and needs a plan with ``uniform_ranks``). Needs
``accelerate`` (``pip install autotune[accelerate]``).

Without this module, ``Accumulator(model, optimizer, plan, loss=...,
parts=[MixedPrecision(backward=accelerator.backward)])`` composes the same way; clip with
``step.backward(batch)``, ``accelerator.clip_grad_norm_(...)``,
``optimizer.step()``, ``optimizer.zero_grad()`` instead of ``max_norm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import BadInput
from ..training import Accumulator, Batches, MixedPrecision, Sync


def accumulator(accelerator: Any, model: nn.Module, optimizer: Any, plan: Any, *,
                loss: Callable[[nn.Module, Any], torch.Tensor], items: Callable[[Any], int] | None = None,
                max_norm: float | None = None, move: Callable[[Any], Any] | None = None) -> Accumulator:
    """An :class:`autotune.Accumulator` for ``accelerator.prepare``'d ``model`` and ``optimizer`` (see the module
    docstring). ``loss(model, micro_batch)`` is the mean over the micro-batch's items, ``items`` counts them."""
    steps = getattr(accelerator, "gradient_accumulation_steps", 1)
    if steps != 1:
        raise BadInput(f"the Accelerator accumulates too (gradient_accumulation_steps={steps}): its backward divides "
                       f"every loss by {steps} and its optimizer skips steps, while the Accumulator weights each "
                       "micro-batch and steps once per batch: create the Accelerator with "
                       "gradient_accumulation_steps=1")

    def clip_with(value: float) -> Any:
        return accelerator.clip_grad_norm_(model.parameters(), value)

    return Accumulator(model, optimizer, plan, loss=loss, items=items, max_norm=max_norm,
                       parts=[Batches(move=move), MixedPrecision(backward=accelerator.backward, clip=clip_with),
                              Sync(no_sync=lambda: accelerator.no_sync(model))])
