"""A third-party model as an autotune probe file: a small ``transformers`` BERT masked-LM.

Built from a ``BertConfig`` (nothing downloaded), trained on random token
sequences with 15% of positions masked; the loss is the model's own
masked-LM cross-entropy (mean over masked positions), so ``items`` counts the
masked positions. Needs the ``bench`` extra (``pip install -e .[bench]``).

    autotune probe --probe bench/bert_mlm.py --device cpu --memory-budget 64MiB
"""

from __future__ import annotations

import torch

from autotune import Workload

VOCAB = 1000
SEQ_LEN = 32
IGNORE = -100
MASK_ID = 3
MASK_FRACTION = 0.15


def config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=256, max_position_embeddings=SEQ_LEN, type_vocab_size=1)


def model() -> torch.nn.Module:
    from transformers import BertForMaskedLM

    return BertForMaskedLM(config())


def batch(size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, VOCAB, (size, SEQ_LEN), generator=generator)
    masked = torch.rand(size, SEQ_LEN, generator=generator) < MASK_FRACTION
    masked[:, 0] = True  # at least one masked position per sequence: the loss is never empty
    labels = ids.masked_fill(~masked, IGNORE)
    return {"input_ids": ids.masked_fill(masked, MASK_ID), "attention_mask": torch.ones_like(ids),
            "labels": labels}


def loss(net: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return net(**data).loss


def items(data: dict[str, torch.Tensor]) -> int:
    return int((data["labels"] != IGNORE).sum())


def build() -> Workload:
    return Workload(name="bert-mlm", model=model, batch=batch, loss=loss, items=items)
