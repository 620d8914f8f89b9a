"""The precision of an accumulation: one part of an :class:`autotune.Accumulator`.

    step = autotune.Accumulator(model, optimizer, plan, loss=my_loss, parts=[MixedPrecision("bf16")])
    step = autotune.Accumulator(model, optimizer, plan, loss=my_loss,
                                parts=[MixedPrecision(backward=accelerator.backward, clip=clip_the_accelerators_way)])

:class:`MixedPrecision` runs each micro-step's forward under autocast (bf16,
fp16) and its backward, scaling the loss under fp16 with one GradScaler; after
the last micro-step it unscales once, clips once, and steps the optimizer
(skipping the step when the scaler found inf/nan). A framework that owns mixed
precision (Accelerate, Lightning) owns the backward and the GradScaler too:
give its ``backward`` and its ``clip(max_norm)``, which unscales before
clipping where ``torch.nn.utils.clip_grad_norm_`` would clip scaled gradients.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import options


class MixedPrecision:
    """Autocast, loss scaling and backward, unscale, clip and optimizer step for one Accumulator.

    ``name``: fp32 (as is), bf16 (autocast) or fp16 (autocast and one GradScaler). ``backward(loss)``: the
    framework's backward where it has one (``accelerator.backward``, a LightningModule's ``manual_backward``).
    ``clip(max_norm)``: the framework's clipping of the model's gradients, returning their norm or None.
    """

    def __init__(self, name: str = "fp32", *, backward: Callable[[torch.Tensor], Any] | None = None,
                 clip: Callable[[float], Any] | None = None):
        self.name = options.precision(name)
        self.backward_fn = backward if backward is not None else torch.Tensor.backward
        self.clip_fn = clip
        self.device_type = "cpu"
        self.scaler: torch.amp.GradScaler | None = None

    def bind(self, model: nn.Module) -> MixedPrecision:
        """A copy of this part for ``model``'s device, with its own GradScaler under fp16."""
        bound = copy.copy(self)
        p = next(iter(model.parameters()), None)
        bound.device_type = p.device.type if p is not None else "cpu"
        bound.scaler = torch.amp.GradScaler(bound.device_type) if self.name == "fp16" else None
        return bound

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context of a micro-step's forward and loss."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.name == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-step's weighted loss, scaled under fp16."""
        self.backward_fn(self.scaler.scale(loss) if self.scaler is not None else loss)

    def loss_scale(self) -> float:
        """The factor the gradients carry until :meth:`unscale` (1 without a GradScaler)."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """After the last micro-step: the accumulated gradients unscaled, once (fp16)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        """Clip the accumulated gradient to ``max_norm``; its norm before clipping (None where the framework's
        clipping does not say)."""
        if self.clip_fn is None:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        norm = self.clip_fn(max_norm)
        return None if norm is None else torch.as_tensor(norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer's step; True when the GradScaler found inf/nan and skipped it."""
        if self.scaler is None:
            optimizer.step()
            return False
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < scale
