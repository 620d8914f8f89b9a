"""A tiny GPT-2 built from a config, token data as a list of dicts and a padding collator: no downloads."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 64


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config)


class Forwarding(GPT2LMHeadModel):
    """A GPT-2 whose forward takes ``*args, **kwargs``, as wrappers' do: its signature names no column."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def examples(lengths: list[int], seed: int = 0) -> list[dict]:
    """Tokenized examples as a list of dicts, with a field the model does not take (the Trainer drops it)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist(), "source": f"doc-{i}"}
            for i, n in enumerate(lengths)]


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Pads to the longest example of the batch; labels are the inputs, -100 on padding."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


#: Mostly short examples and a few long ones, the long ones last.
LENGTHS = [12] * 96 + [64] * 4
