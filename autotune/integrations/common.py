"""What the adapters share: an Accumulator that clips the framework's way, the largest of a few batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..training import Accumulator
from ..workload.batches import batch_size


class FrameworkAccumulator(Accumulator):
    """An Accumulator whose ``max_norm`` clipping is the framework's own ``clip_with(max_norm)``.

    A framework that owns mixed precision owns the GradScaler too: its clipping
    unscales the gradients first (``accelerator.clip_grad_norm_``, a
    LightningModule's ``clip_gradients``), where ``torch.nn.utils.clip_grad_norm_``
    would clip the scaled ones.
    """

    def __init__(self, *args: Any, clip_with: Callable[[float], Any], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.clip_with = clip_with

    def clip(self) -> torch.Tensor | None:
        if self.max_norm is None:
            return None
        norm = self.clip_with(self.max_norm)
        return None if norm is None else torch.as_tensor(norm)


def largest_batch(batches: Iterable[Any], limit: int) -> tuple[Any, int]:
    """(the batch with the most elements per sample among the first ``limit``, how many were looked at):
    the longest padded sequences, the largest images. Ties go to the first."""
    best, best_size, seen = None, -1.0, 0
    for seen, batch in enumerate(batches, start=1):
        size = per_sample_elements(batch)
        if size > best_size:
            best, best_size = batch, size
        if seen >= limit:
            break
    if best is None:
        raise ValueError("the train dataloader yielded no batch")
    return best, seen


def per_sample_elements(batch: Any) -> float:
    """Tensor elements of ``batch`` per sample."""
    total = sum(t.numel() for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
    return total / max(1, batch_size(batch))
