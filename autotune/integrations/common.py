"""What the adapters share: the largest of a few batches, the warning for a dataset smaller than one effective
batch."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..compat import tree_flatten
from ..units import plural
from ..workload.batches import batch_size

if TYPE_CHECKING:
    from ..results.plan import Plan


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


def short_dataset(plan: Plan, dataset: Any, framework: str, *, warn: bool = True) -> Plan:
    """``plan``, with a note (and a UserWarning when ``warn``) when ``dataset`` holds fewer samples than one
    effective batch: the framework then steps at the end of every epoch, on the whole dataset, and no optimizer
    step sees the target. A dataset without a length is not checked."""
    try:
        samples = len(dataset)
    except TypeError:  # an iterable dataset
        return plan
    if samples >= plan.target_batch:
        return plan
    note = (f"the dataset holds {plural(samples, 'sample')}, fewer than one effective batch of {plan.target_batch}: "
            f"{framework} steps at the end of every epoch, so no optimizer step sees more than {samples}; "
            f"plan a target of at most {samples}, or train on more data")
    if warn:
        warnings.warn(note, UserWarning, stacklevel=3)
    return dataclasses.replace(plan, notes=plan.notes + (note,))
