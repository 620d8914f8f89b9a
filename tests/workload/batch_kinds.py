"""Workloads whose batches are not one row per sample: a graph batch built as PyG builds one (node
features, edge index offset per graph, graph index per node), and padding-free packing (one row of
concatenated samples, position ids restarting per sample) made by Hugging Face's DataCollatorWithFlattening."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autotune.workload import Workload

FEATURES = 8
#: Memory budgets (bytes) under which each workload's max micro-batch is well below a target of 31 samples.
RUN_BUDGETS = {"gnn": 600_000, "packed-lm": 4_000_000, "jagged": 300_000, "jagged-attention": 500_000}


# -- graphs ----------------------------------------------------------------------------------------

LARGEST = 12


def graphs(n: int, g: torch.Generator, smallest: int = 3) -> dict[str, torch.Tensor]:
    """``n`` ring graphs of ``smallest``..12 nodes each, batched as PyG does: ``x`` (nodes, F), ``edge_index``
    (2, edges) offset per graph (each graph's ring forward, then backward), ``batch`` (nodes,) the graph of each
    node, ``y`` (n,), ``ptr``/``eptr`` (n+1,) offsets. Built by whole-batch ops (no loop over the graphs)."""
    sizes = torch.randint(smallest, LARGEST + 1, (n,), generator=g)
    x = torch.randn(int(sizes.sum()), FEATURES, generator=g)
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    # edge k of a graph of s nodes from node `start`: k < s goes k -> k+1 (mod s), then k - s goes back
    size = torch.repeat_interleave(sizes, 2 * sizes)
    start = torch.repeat_interleave(ptr[:-1], 2 * sizes)
    k = torch.arange(int(2 * sizes.sum())) - torch.repeat_interleave(2 * ptr[:-1], 2 * sizes)
    node, forward = k % size, k < size
    ahead = (node + 1) % size
    src = torch.where(forward, node, ahead) + start
    dst = torch.where(forward, ahead, node) + start
    return {"x": x, "edge_index": torch.stack([src, dst]), "batch": torch.repeat_interleave(torch.arange(n), sizes),
            "y": torch.randn(n, generator=g), "ptr": ptr, "eptr": 2 * ptr}


def graph_count(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["y"].shape[0])


def split_graphs(batch: dict[str, torch.Tensor], sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    """Consecutive graphs of ``sizes``, node and edge indices rebased to each micro-batch."""
    ptr, eptr = batch["ptr"].tolist(), batch["eptr"].tolist()
    out, first = [], 0
    for n in sizes:
        last = first + n
        a, b, ea, eb = ptr[first], ptr[last], eptr[first], eptr[last]
        out.append({"x": batch["x"][a:b], "edge_index": batch["edge_index"][:, ea:eb] - a,
                    "batch": batch["batch"][a:b] - first, "y": batch["y"][first:last],
                    "ptr": batch["ptr"][first:last + 1] - a, "eptr": batch["eptr"][first:last + 1] - ea})
        first = last
    return out


class GNN(nn.Module):
    """Message passing by ``index_add_``: each node adds its neighbours' states; graphs pooled by sum."""

    def __init__(self, width: int = 64, layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor, graphs: int) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.layers:
            agg = torch.zeros_like(h).index_add_(0, edge_index[1], h[edge_index[0]])
            h = torch.relu(layer(h + agg))
        pooled = torch.zeros(graphs, h.shape[1], dtype=h.dtype, device=h.device).index_add_(0, batch, h)
        return self.out(pooled).squeeze(-1)


def graph_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(b["x"], b["edge_index"], b["batch"], graph_count(b)), b["y"])


def graph_workload(*, described: bool = True, worst: bool = False) -> Workload:
    """The GNN; ``described=False`` leaves out ``samples``/``split`` (as a workload written for rows would);
    ``worst``: every graph of the most nodes (the batch at its worst-case shape)."""
    extra: dict[str, Any] = {"samples": graph_count, "split": split_graphs} if described else {}
    smallest = LARGEST if worst else 3
    return Workload(name="gnn", model=GNN, batch=lambda n, g: graphs(n, g, smallest), loss=graph_loss, **extra)


# -- padding-free packing ------------------------------------------------------------------------------

VOCAB = 97


def _collator() -> Any:
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)


LONGEST = 40


def packed(n: int, g: torch.Generator, shortest: int = 8) -> dict[str, Any]:
    """``n`` sequences of ``shortest``..40 tokens packed into one row by DataCollatorWithFlattening."""
    return packed_of(torch.randint(shortest, LONGEST + 1, (n,), generator=g).tolist(), g)


def packed_of(lengths: list[int], g: torch.Generator) -> dict[str, Any]:
    """Sequences of ``lengths`` tokens packed into one row by DataCollatorWithFlattening."""
    features = [{"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist()} for length in lengths]
    return _collator()(features)


def sequence_count(batch: dict[str, Any]) -> int:
    return int(batch["cu_seq_lens_q"].shape[0]) - 1


def target_tokens(batch: dict[str, Any]) -> int:
    """Tokens the loss averages over: every label but the first of each sequence (-100)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def split_packed(batch: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    """Consecutive sequences of ``sizes``, packed again by the same collator."""
    cu, ids = batch["cu_seq_lens_q"].tolist(), batch["input_ids"][0].tolist()
    sequences = [{"input_ids": ids[a:b]} for a, b in zip(cu, cu[1:])]
    out, first = [], 0
    for n in sizes:
        out.append(_collator()(sequences[first:first + n]))
        first += n
    return out


class PackedLM(nn.Module):
    """A small causal transformer over one packed row: attention stays inside each sequence (a block-diagonal
    causal mask for SDPA, built from the position ids)."""

    def __init__(self, width: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(64, width)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                 for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos(position_ids)
        seq = (position_ids == 0).cumsum(-1)  # which sequence each token belongs to
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
        mask = ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]
        for qkv, mlp in zip(self.qkv, self.mlp):
            q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv(h).chunk(3, dim=-1))
            h = h + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
            h = h + mlp(h)
        return self.head(h)


def packed_loss(model: nn.Module, b: dict[str, Any]) -> torch.Tensor:
    logits = model(b["input_ids"], b["position_ids"])
    return F.cross_entropy(logits[0, :-1], b["labels"][0, 1:], ignore_index=-100)


def packed_workload(*, worst: bool = False) -> Workload:
    """The packed causal LM; ``worst``: every sequence of the most tokens (the batch at its worst-case shape)."""
    shortest = LONGEST if worst else 8
    return Workload(name="packed-lm", model=PackedLM, batch=lambda n, g: packed(n, g, shortest), loss=packed_loss,
                    samples=sequence_count, split=split_packed, items=target_tokens, lengths_batch=packed_of,
                    tokens=lambda b: int(b["input_ids"].shape[1]))


# -- nested (jagged) tensors -----------------------------------------------------------------------------

def jagged(n: int, g: torch.Generator, shortest: int = 4) -> torch.Tensor:
    """``n`` sequences of ``shortest``..16 feature vectors as one nested tensor of jagged layout, (n, j, F)."""
    return jagged_of(torch.randint(shortest, 17, (n,), generator=g).tolist(), g)


def jagged_of(lengths: list[int], g: torch.Generator) -> torch.Tensor:
    """Sequences of ``lengths`` feature vectors as one nested tensor of jagged layout."""
    return torch.nested.nested_tensor([torch.randn(length, FEATURES, generator=g) for length in lengths],
                                      layout=torch.jagged)


def split_jagged(batch: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    rows, out, first = batch.unbind(), [], 0
    for n in sizes:
        out.append(torch.nested.as_nested_tensor(list(rows[first:first + n]), layout=torch.jagged))
        first += n
    return out


def jagged_workload(*, worst: bool = False) -> Workload:
    """A token-wise autoencoder over a jagged batch; the loss is the mean over every vector (the items);
    ``worst``: every sequence of the most vectors."""
    shortest = 16 if worst else 4
    return Workload(name="jagged", model=lambda: nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(),
                                                               nn.Linear(256, FEATURES)),
                    batch=lambda n, g: jagged(n, g, shortest), loss=lambda m, b: (m(b) - b).values().pow(2).mean(),
                    samples=lambda b: int(b.shape[0]), split=split_jagged, items=lambda b: int(b.values().shape[0]),
                    lengths_batch=jagged_of)


class JaggedAttention(nn.Module):
    """Self-attention within each sequence of a jagged batch (SDPA over nested tensors), then a token-wise MLP."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.inp = nn.Linear(FEATURES, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(width, FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        q, k, v = (layer(h).unflatten(-1, (self.heads, -1)).transpose(1, 2) for layer in (self.q, self.k, self.v))
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2))
        return self.out(h)


def jagged_attention_workload(*, worst: bool = False) -> Workload:
    """:func:`jagged_workload` with attention inside each sequence."""
    return replace(jagged_workload(worst=worst), name="jagged-attention", model=JaggedAttention)
