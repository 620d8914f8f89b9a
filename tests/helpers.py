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
    """A GRU sequence model: the meta engine cannot estimate it (the CPU runs GRUs as oneDNN kernels)."""
    return Workload(name="gru", model=lambda: _Recurrent(width),
                    batch=lambda n, g: torch.randn(n, length, width, generator=g),
                    loss=lambda m, b: m(b).pow(2).mean())
