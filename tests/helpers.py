"""Test helpers shared by several test files."""

from __future__ import annotations

import torch
from torch import nn

from autotune.probing.finder import exhaustive_max
from autotune.workload import Workload


def true_max(workload, device, usable: int, high: int) -> tuple[int, int]:
    """The largest micro-batch that fits by exhaustive real search under the fit rule; (max, real runs)."""
    peaks: dict[int, int | None] = {}
    return exhaustive_max(workload, device, usable, high, peaks=peaks), len(peaks)


class _Recurrent(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.rnn = nn.GRU(width, 2 * width, batch_first=True)
        self.head = nn.Linear(2 * width, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def recurrent_workload(width: int = 16, length: int = 6) -> Workload:
    """A GRU sequence model: estimated on meta tensors for the CPU, under FakeTensorMode for a GPU (cuDNN)."""
    return Workload(name="gru", model=lambda: _Recurrent(width),
                    batch=lambda n, g: torch.randn(n, length, width, generator=g),
                    loss=lambda m, b: m(b).pow(2).mean())


def _autocast_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(batch).float().pow(2).mean()


def autocast_workload(width: int = 64) -> Workload:
    """An MLP under CPU autocast, which applies to CPU tensors only: the meta engine cannot estimate it."""
    return Workload(name="bf16-autocast",
                    model=lambda: nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)),
                    batch=lambda n, g: torch.randn(n, width, generator=g), loss=_autocast_loss)
