"""Batches as every stage sees them: their size, their split into micro-batches, each one's weight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..compat import tree_flatten, tree_map


def _leaves(batch: Any) -> list:
    # The common containers directly; any other pytree through torch's flattening.
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in batch):
        return list(batch)
    if isinstance(batch, dict) and all(isinstance(t, torch.Tensor) for t in batch.values()):
        return list(batch.values())
    return tree_flatten(batch)[0]


def batch_size(batch: Any) -> int:
    """The leading dimension shared by every tensor of a pytree batch."""
    sizes = {int(t.shape[0]) for t in _leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"every tensor of a batch must share its first dimension; found sizes {sorted(sizes)}")
    return sizes.pop()


def item_weight(n_items: int, total_items: int, world_size: int = 1) -> float:
    """Weight of a micro-step's mean loss: ``n_i / N``, times ``W`` under DDP.

    ``n_i`` items in this micro-batch, ``N`` items in the whole effective batch
    over all ranks. DDP averages gradients over ``W`` ranks, so the factor ``W``
    undoes that average and the synchronised gradient is the mean over all ``N``.
    """
    if total_items <= 0:
        raise ValueError(f"the effective batch holds {total_items} items; it must hold at least 1")
    if n_items < 0:
        raise ValueError(f"a micro-batch cannot hold {n_items} items")
    return n_items * world_size / total_items


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Split a pytree batch along dim 0 into consecutive micro-batches of ``sizes``."""
    total = batch_size(batch)
    if sum(sizes) != total:
        raise ValueError(f"the schedule {list(sizes)} sums to {sum(sizes)} but the batch holds {total} samples")
    out, start = [], 0
    for n in sizes:
        out.append(tree_map(lambda t, s=start, n=n: t[s:s + n] if isinstance(t, torch.Tensor) and t.dim() else t,
                            batch))
        start += n
    return out
