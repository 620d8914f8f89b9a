"""Test helpers shared by several test files."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
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


@contextlib.contextmanager
def transport_keeps_buffers() -> Iterator[list[list[object]]]:
    """Planted: the collectives FSDP's all-gather and reduce-scatter call keep every argument they were given
    (the list yielded) until the block ends, as gloo's worker threads keep a finished collective's tensors
    until they next run: late, on a loaded machine."""
    kept: list[list[object]] = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                         "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def keeping(original):
        def collective(*args, **kwargs):
            kept.append([*args, *kwargs.values()])
            return original(*args, **kwargs)
        return collective

    for name in names:
        setattr(dist, name, keeping(originals[name]))
    try:
        yield kept
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        kept.clear()
