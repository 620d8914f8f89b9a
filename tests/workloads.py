"""Workloads that break naive probes: each stands for a class of models users bring.

Every builder returns a fresh :class:`autotune.Workload`; ``probe_file`` writes
the same workload as a probe file for the command line.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from torch import nn

from autotune.workload import Workload


def _is_real(t: torch.Tensor) -> bool:
    return not t.is_meta and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _features(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def oom_above(limit: int, error: type[BaseException] | None = None, message: str = "CUDA out of memory. "
              "Tried to allocate 2.00 GiB") -> Workload:
    """A loss that raises ``error(message)`` for real micro-batches above ``limit`` samples, while
    estimates (meta or fake tensors) see nothing wrong: a device whose memory runs out where the
    estimate cannot see it (by default with ``torch.OutOfMemoryError``, as CUDA raises it)."""
    error = torch.OutOfMemoryError if error is None else error

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if _is_real(x) and x.shape[0] > limit:
            raise error(message)
        return nn.functional.cross_entropy(model(x), y)

    return Workload(name="oom-above", model=_small_mlp, batch=_features, loss=loss)


class _Workspace(torch.autograd.Function):
    """The identity, whose real kernel keeps a workspace of ``per_sample`` bytes a sample for its backward
    (as oneDNN's LSTM kernel does); run on shape-only tensors, it keeps none."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, per_sample: int) -> torch.Tensor:  # type: ignore[override]
        if _is_real(x):
            ctx.save_for_backward(torch.empty(x.shape[0] * per_sample, dtype=torch.uint8, device=x.device))
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _HiddenWorkspace(nn.Module):
    def __init__(self, per_sample: int):
        super().__init__()
        self.per_sample = per_sample
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(_Workspace.apply(x, self.per_sample))


def hidden_workspace(per_sample: int = 1024) -> Workload:
    """A model whose real kernel holds ``per_sample`` bytes a sample that no estimate sees (a vendor kernel's
    workspace): the estimate under-counts, by more the larger the batch, and only real runs show how much."""
    return Workload(name="hidden-workspace", model=lambda: _HiddenWorkspace(per_sample), batch=_features,
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


class MoE(nn.Module):
    """A mixture-of-experts layer with top-2 routing: ``nonzero``, ``index_select``, ``index_add``."""

    def __init__(self, width: int = 32, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                   nn.Linear(4 * width, width)) for _ in range(experts))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, idx = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (idx == e).any(-1).nonzero().squeeze(-1)
            weight = (top * (idx == e)).sum(-1).index_select(0, rows).unsqueeze(-1)
            out = out.index_add(0, rows, expert(x.index_select(0, rows)) * weight)
        return self.head(out)


def moe() -> Workload:
    return Workload(name="moe", model=MoE, batch=lambda n, g: (torch.randn(n, 32, generator=g),
                                                               torch.randint(0, 4, (n,), generator=g)),
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


TRIM_SEQ = 256


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.ff = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 100))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.ff(self.emb(t))


def _padded(n: int, g: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(1, 100, (n, TRIM_SEQ), generator=g)
    lengths = torch.randint(TRIM_SEQ // 2, TRIM_SEQ + 1, (n, 1), generator=g)
    return tokens.masked_fill(torch.arange(TRIM_SEQ).unsqueeze(0) >= lengths, 0)


def _trimmed_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    longest = int((tokens != 0).sum(1).max().item())  # a shape read from the data
    tokens = tokens[:, :longest]
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=0)


def trim_padding() -> Workload:
    """A loss that trims padding to the longest real sequence, a length it reads with ``.item()``."""
    return Workload(name="trim", model=_Tokens, batch=_padded, loss=_trimmed_loss)


class _GatedLength(nn.Module):
    """Keeps as many positions as its gate says: a length that depends on parameters, read with ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 1)
        self.ff = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = int(torch.sigmoid(self.gate(x.mean((0, 1)))).mul(x.shape[1]).ceil().item())
        return self.ff(x[:, :keep])


def gated_length() -> Workload:
    """A shape read from values that depend on parameters: no batch value answers it."""
    return Workload(name="gated", model=_GatedLength, batch=lambda n, g: torch.randn(n, 64, 16, generator=g),
                    loss=lambda m, b: m(b).pow(2).mean())


class _RepeatRouting(nn.Module):
    """Each token copied as many times as its router says (``repeat_interleave`` of parameter-dependent
    counts): a size with no bound."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.router = nn.Linear(width, 1)
        self.expert = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copies = torch.sigmoid(self.router(x)).squeeze(-1).mul(3).round().long()
        owner = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), copies)
        out = torch.zeros_like(x).index_add(0, owner, self.expert(x.index_select(0, owner)))
        return self.head(out)


def unbounded_routing() -> Workload:
    return Workload(name="unbounded-routing", model=_RepeatRouting,
                    batch=lambda n, g: (torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)),
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


def nan_loss() -> Workload:
    return Workload(name="nan", model=_small_mlp, batch=_features,
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]) * float("nan"))


def fixed_batch(rows: int = 8) -> Workload:
    """``batch(n)`` that ignores ``n``."""
    return Workload(name="fixed", model=_small_mlp, batch=lambda n, g: _features(rows, g),
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


def tokens(seq_len: int = 6, vocab: int = 50) -> Workload:
    """Samples of ``seq_len`` tokens each, the loss averaged over every token (``items``)."""

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten())

    return Workload(name="tokens", model=lambda: nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab)),
                    batch=lambda n, g: torch.randint(0, vocab, (n, seq_len), generator=g), loss=loss,
                    items=lambda b: b.numel())


def probe_file(folder: Path, name: str, builder: str, *args: object) -> Path:
    """A probe file whose ``build()`` returns ``tests.workloads.<builder>(*args)``."""
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from tests import workloads

        def build():
            return workloads.{builder}(*{args!r})
        """))
    return path


def oom_message_above(limit: int) -> Workload:
    """A user's own ``RuntimeError`` that merely says "CUDA out of memory", raised on any device."""
    return oom_above(limit, RuntimeError, "CUDA out of memory (my own check)")


def large_graph_batch(*, read: bool = False) -> Workload:
    """A GNN-style batch over the estimate's limit for a batch built for real (32 MiB of features per graph), whose
    nodes per graph (from the batch alone) size ``repeat_interleave`` (``read``: a tensor, read with ``.item()``)."""
    def batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 1 << 23, generator=g), torch.randint(1, 4, (n,), generator=g)

    def loss(net: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, nodes = data
        if read:
            return net(x[:, :8]).square().mean() + x.new_zeros(int(nodes.sum().item()), 8).sum()
        graph_of_node = torch.repeat_interleave(nodes)  # 0, 0, 1, 2, 2, 2, ...: each node's graph
        return net(x[graph_of_node, :8]).square().mean()

    return Workload(name="large-graph-batch", model=lambda: nn.Linear(8, 2), batch=batch, loss=loss)
