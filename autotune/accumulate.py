"""Exact gradient accumulation: how each micro-step's loss is weighted."""

from __future__ import annotations


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
