"""Padding-free packing: the samples of a micro-batch concatenated into one row, as Hugging Face's
``DataCollatorWithFlattening`` makes it (``input_ids`` and ``labels`` of shape (1, tokens), ``position_ids``
restarting at 0 at each sample, the first label of each sample -100, and the flash-attention varlen path's
``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k``), so a model that reads them (transformers' varlen path,
or SDPA with the block-diagonal mask it builds from the position ids) never attends across samples. A batch's
samples are counted by its ``cu_seq_lens_q`` (a shape, known to a shape-only estimate too), and it is split
where they say.

transformers reads a packed row's position ids only when the model runs without a cache
(``config.use_cache = False``, as under gradient checkpointing); with one, SDPA attends across samples."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch


def collate(features: list[dict[str, list[int]]]) -> dict[str, Any]:
    """``features`` (one ``input_ids`` list each) packed by ``DataCollatorWithFlattening``."""
    from transformers import DataCollatorWithFlattening

    return dict(DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(features))


def packed_batch(lengths: Sequence[int], generator: torch.Generator, vocab: int) -> dict[str, Any]:
    """One row of samples of ``lengths`` tokens, random ids below ``vocab``. The ids are read through numpy,
    which a shape-only tensor refuses at once (an estimate then builds the row for real, as it must: the
    collator makes it from the values), where ``tolist`` would read it element by element first."""
    ids = torch.randint(vocab, (int(sum(lengths)),), generator=generator).numpy().tolist()
    starts = [0, *itertools.accumulate(int(n) for n in lengths)]
    return collate([{"input_ids": ids[a:b]} for a, b in zip(starts, starts[1:])])


def samples(batch: dict[str, Any]) -> int:
    """Samples in a packed row: one fewer than its ``cu_seq_lens_q``."""
    return int(batch["cu_seq_lens_q"].shape[0]) - 1


def tokens(batch: dict[str, Any]) -> int:
    """Tokens in a packed row (none is padding)."""
    return int(batch["input_ids"].shape[1])


def split(batch: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    """Consecutive samples of a packed row, ``sizes`` of them in each part, each part packed again."""
    cut, ids = batch["cu_seq_lens_q"].tolist(), batch["input_ids"][0].tolist()
    sequences = [{"input_ids": ids[a:b]} for a, b in zip(cut, cut[1:])]
    out, first = [], 0
    for n in sizes:
        out.append(collate(sequences[first:first + n]))
        first += n
    return out
