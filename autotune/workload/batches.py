"""Batches as every stage sees them: their size, their split into micro-batches, each one's weight."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compat import tree_flatten, tree_map

#: ``samples(batch)``: the samples a batch holds, where its tensors' first dimension is not that count.
Samples = Callable[[Any], int]
#: ``split(batch, sizes)``: the batch as consecutive micro-batches of ``sizes`` samples, in order.
Split = Callable[[Any, list[int]], Sequence[Any]]

#: How a batch that is not ``n`` rows is described, named in every error about one.
FIX = ("for a batch that is not n rows (packed sequences, graphs, nested tensors) give the workload "
       "samples=lambda batch: <samples in it> and split=lambda batch, sizes: [<micro-batches of those sizes>]")


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
    sizes = _first_dims(batch)
    if len(sizes) != 1:
        raise ValueError(f"every tensor of a batch must share its first dimension; found sizes {sorted(sizes)}: "
                         f"{FIX}")
    return sizes.pop()


def count_samples(batch: Any, samples: Samples | None = None) -> int:
    """Samples in ``batch``: ``samples(batch)``, else the first dimension its tensors share (0 for no batch)."""
    if batch is None:
        return 0
    return batch_size(batch) if samples is None else int(samples(batch))


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


def split_batch(batch: Any, sizes: Sequence[int], *, samples: Samples | None = None,
                split: Split | None = None) -> list[Any]:
    """Split a batch into consecutive micro-batches of ``sizes`` samples: by ``split(batch, sizes)`` (its
    empty micro-batches None), else along dim 0; ``samples`` counts a batch's samples (see :func:`count_samples`)."""
    total = count_samples(batch, samples)
    if sum(sizes) != total:
        raise ValueError(f"the schedule {list(sizes)} sums to {sum(sizes)} but the batch holds {total} samples")
    if split is not None:
        return _split_by(batch, list(sizes), samples, split)
    if samples is not None and _shared_first(batch) != total:
        raise ValueError(f"the batch holds {total} samples by samples(batch) but its tensors are not {total} rows, "
                         "so slicing dim 0 cannot split it: give split=lambda batch, sizes: [<micro-batches of "
                         "those sizes>]")
    out, start = [], 0
    for n in sizes:
        out.append(tree_map(lambda t, s=start, n=n: t[s:s + n] if isinstance(t, torch.Tensor) and t.dim() else t,
                            batch))
        start += n
    return out


def take(batch: Any, start: int, size: int, *, samples: Samples | None = None, split: Split | None = None) -> Any:
    """The ``size`` samples of ``batch`` from sample ``start`` on (a rank's share of a global batch)."""
    total = count_samples(batch, samples)
    if start == 0 and size == total:
        return batch
    return split_batch(batch, [start, size, total - start - size], samples=samples, split=split)[1]


def _split_by(batch: Any, sizes: list[int], samples: Samples | None, split: Split) -> list[Any]:
    """``split(batch, sizes)`` over the non-empty sizes, checked piece by piece; None for each empty one."""
    wanted = [n for n in sizes if n]
    parts = list(split(batch, wanted))
    got = [count_samples(p, samples) for p in parts]
    if got != wanted:
        raise ValueError(f"split(batch, {wanted}) returned micro-batches of {got} samples: it must return one "
                         "micro-batch per size, in order, each of exactly that many samples")
    pieces = iter(parts)
    return [next(pieces) if n else None for n in sizes]


def _first_dims(batch: Any) -> set[int]:
    return {int(t.shape[0]) for t in _leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0}


def _shared_first(batch: Any) -> int | None:
    sizes = _first_dims(batch)
    return sizes.pop() if len(sizes) == 1 else None
