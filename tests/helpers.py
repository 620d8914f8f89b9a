"""Test helpers shared by several test files."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from autotune.devices import session
from autotune.probing.fitrule import run_trial
from autotune.probing.search import search_max
from autotune.workload import Workload


def exhaustive_max(workload, device, usable: int, limit: int, *, peaks: dict[int, int | None] | None = None) -> int:
    """The largest micro-batch that fits by real runs alone: doubling from 1, then bisection.

    Every step is a real run of the fit rule, measured whole (no estimate
    involved); the ground truth the probe's answer is checked against (by the
    tests, and by bench/probe_accuracy.py, probe_vs_peers.py and gpu_check.py).
    ``peaks`` (batch size -> real peak bytes, None for an OOM) is filled in and
    reused, so one cache serves several budgets of the same workload and device.
    """
    peaks = {} if peaks is None else peaks

    def fits(b: int) -> bool:
        if b not in peaks:
            peaks[b] = run_trial(device, workload, b, usable, source="real", capacity_guard=False).peak_bytes
        peak = peaks[b]
        return peak is not None and peak <= usable

    if not fits(1):
        return 0
    return search_max(fits, low=1, high=limit)


def fake_groups() -> list[str]:
    """Names of the fake process groups an estimate of FSDP has registered now (none outside a measurement)."""
    return sorted(session._FAKE_GROUPS)


def held_bytes(model: nn.Module) -> int:
    """Bytes FSDP holds for ``model`` beyond its shards: unsharded parameters and gradients."""
    from autotune.probing.fsdp import _param_groups, _unsharded_gradients

    total = 0
    for group in _param_groups(model):
        for param in group.fsdp_params:
            for t in getattr(param, "all_gather_outputs", ()):
                total += t.untyped_storage().nbytes()
    for grad in _unsharded_gradients(model):
        if grad is not None:
            total += grad.untyped_storage().nbytes()
    return total


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
