"""A tiny MLP classifier on random features: fast, the test suite's workhorse."""

from __future__ import annotations

import torch
from torch import nn

from autotune import Workload

FEATURES = 64
HIDDEN = 256
CLASSES = 10


def model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (size,), generator=generator)
    return x, y


def loss(net: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return nn.functional.cross_entropy(net(x), y)


def build() -> Workload:
    return Workload(name="mlp", model=model, batch=batch, loss=loss)
