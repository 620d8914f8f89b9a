"""A small decoder-only transformer on random token sequences of varying length.

Sequences are right-padded to the longest length (the worst-case shape); the
loss ignores padding and ``items`` counts the real target tokens, so the runner
weights micro-batches by tokens, not by sequences. ``build()`` is tiny (fast on
a CPU); ``build_100m()`` and ``build_1b()`` are realistic sizes for estimates.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from autotune import Workload

PAD = 0
IGNORE = -100


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    seq_len: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1
    min_len: int = 8


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads = c.heads
        self.dropout = c.dropout
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.drop.p if self.drop.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, c: Config, checkpointing: bool = False):
        super().__init__()
        self.checkpointing = checkpointing
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for name, p in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        return self.head(self.ln(x))


def make_batch(size: int, generator: torch.Generator, *, c: Config) -> dict[str, torch.Tensor]:
    """Token sequences of random lengths, right-padded to ``seq_len + 1``."""
    tokens = torch.randint(1, c.vocab, (size, c.seq_len + 1), generator=generator)
    lengths = torch.randint(c.min_len, c.seq_len + 2, (size, 1), generator=generator)
    real = torch.arange(c.seq_len + 1).unsqueeze(0) < lengths
    tokens = tokens.masked_fill(~real, PAD)
    targets = tokens[:, 1:].masked_fill(~real[:, 1:], IGNORE)
    return {"tokens": tokens[:, :-1].contiguous(), "targets": targets.contiguous()}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over real target tokens (padding ignored)."""
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE)


def items(batch: dict[str, torch.Tensor]) -> int:
    """Real target tokens: what the loss averages over."""
    return int((batch["targets"] != IGNORE).sum())


def _workload(name: str, c: Config) -> Workload:
    return Workload(
        name=name,
        model=functools.partial(GPT, c),
        batch=functools.partial(make_batch, c=c),
        loss=loss,
        items=items,
        options={"checkpointing": [False, True]},
    )


def build() -> Workload:
    """~0.13M parameters, up to 32 tokens: fast enough to train on a laptop CPU."""
    return _workload("gpt", Config())


def build_100m() -> Workload:
    """~110M parameters (GPT-2 small shape, 32k vocabulary, 512 tokens)."""
    return _workload("gpt-100m", Config(vocab=32000, seq_len=512, d_model=768, heads=12, layers=12, min_len=128))


def build_1b() -> Workload:
    """~1.1B parameters (2048 wide, 20 layers, 1024 tokens): for estimates."""
    return _workload("gpt-1b", Config(vocab=32000, seq_len=1024, d_model=2048, heads=16, layers=20, min_len=256))
