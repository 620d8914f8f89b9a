"""Token sequences, a tiny next-token network and its full-batch float64 reference, for the framework tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from autotune import PlanSampler

VOCAB, WIDTH = 50, 16


class TokenNet(nn.Module):
    """Next-token prediction with per-position layers: padding at the end changes no real token's output."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.emb(x))))


def sequences(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Token sequences (ids 1..VOCAB-1; 0 pads) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


#: 42 sequences of 2 to 14 tokens: two effective batches of 21.
MIXED = [2 + (7 * i) % 13 for i in range(42)]


def pad(seqs: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the batch's real (not padding) target tokens."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), ignore_index=0)


def tokens(batch: torch.Tensor) -> int:
    return int((batch[:, 1:] != 0).sum())


def plan_loader(data: list[torch.Tensor], plan) -> DataLoader:
    """Each rank its share of every effective batch of ``plan``, in order."""
    return DataLoader(data, batch_sampler=PlanSampler(len(data), plan, shuffle=False), collate_fn=pad)


def reference_parameters(data: list[torch.Tensor], target: int, steps: int, lr: float = 0.5) -> list[torch.Tensor]:
    """SGD in float64 on whole effective batches of ``target`` sequences from TokenNet's weights under seed 0:
    what exact accumulation must reproduce."""
    return reference_run(data, target, steps, lr)[0]


def reference_run(data: list[torch.Tensor], target: int, steps: int,
                  lr: float = 0.5) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`reference_parameters`, and the full-batch gradient of every step (all parameters, flat)."""
    torch.manual_seed(0)
    model = TokenNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for step in range(steps):
        token_loss(model, pad(data[step * target:(step + 1) * target])).backward()
        grads.append(flat_grad(model))
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()], grads


def flat_grad(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flat, in float64."""
    return torch.cat([p.grad.detach().double().flatten() for p in model.parameters()])


def relative_error(grad: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(grad.double() - reference) / torch.linalg.vector_norm(reference))


def max_error(model: nn.Module, reference: list[torch.Tensor]) -> float:
    return max(float((p.detach().double() - r).abs().max()) for p, r in zip(model.parameters(), reference))
