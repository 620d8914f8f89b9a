"""A flattening collator's batches (Hugging Face's ``DataCollatorWithFlattening``, TRL's ``padding_free``):
the examples of a batch concatenated into one row, ``position_ids`` restarting at each. A framework's batch
size is then the examples in that row, not its rows: the Workload of such a batch makes micro-batches of
``n`` of the longest examples packed into one row (:mod:`autotune.workload.packing`), counts them by its
``cu_seq_lens_q``, and averages the loss over the target tokens (every label but each example's first).

transformers keeps attention inside each example of a packed row only when the model runs without a cache
(``config.use_cache = False``, as under gradient checkpointing): with one, SDPA attends across examples,
which :func:`cache_note` says.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..workload import Workload, packing

#: What the packed micro-batches carry beside the collator's own fields (the flash-attention varlen kwargs).
VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_packed(batch: Any) -> bool:
    """A batch of several examples in one row, as a flattening collator makes it."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("position_ids"), torch.Tensor):
        return False
    ids, positions = batch.get("input_ids"), batch["position_ids"]
    return isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 and \
        int((positions[0] == 0).sum()) > 1


def examples_of(batch: Mapping[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    """The examples of a packed row (their ``input_ids``), where its position ids restart."""
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [int(batch["input_ids"].shape[1])]
    ids = batch["input_ids"][0].tolist()
    return [{"input_ids": ids[a:b]} for a, b in zip(starts, starts[1:])]


def packed_workload(base: Workload, batch: Mapping[str, torch.Tensor]) -> Workload:
    """``base`` (a model's workload on one packed batch) on micro-batches of ``n`` of ``batch``'s examples,
    longest first and cycled, packed into one row; the loss sees the collator's fields only."""
    examples = sorted(examples_of(batch), key=lambda e: -len(e["input_ids"]))
    own = set(batch)

    def make(n: int, generator: torch.Generator) -> dict[str, Any]:
        return packing.collate(list(itertools.islice(itertools.cycle(examples), n)))

    def loss(model: nn.Module, micro: Mapping[str, Any]) -> torch.Tensor:
        return base.loss(model, {k: v for k, v in micro.items() if k in own or k not in VARLEN})

    def targets(micro: Mapping[str, Any]) -> int:
        return int((micro["labels"][:, 1:] != -100).sum())

    return dataclasses.replace(base, batch=make, loss=loss, samples=packing.samples, split=packing.split,
                               tokens=packing.tokens, items=targets if "labels" in batch else base.items)


def cache_note(model: nn.Module) -> str | None:
    """What to change where ``model`` would attend across the examples of a packed row: None where nothing."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        return None
    return ("packed examples: model.config.use_cache is True, and transformers then attends across the examples "
            "of a packed row under SDPA: set model.config.use_cache = False before training")
