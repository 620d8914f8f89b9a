"""Builders for the tests of known values and the shape rules: an estimate's kernel stack on meta tensors, a
batch moved to meta with its value kept, a tensor whose value is unknown."""

from __future__ import annotations

import contextlib

import torch

from autotune.devices.meta import MetaKernels
from autotune.devices.tracker import LiveStorageTracker
from autotune.devices.values import KnownValues


@contextlib.contextmanager
def estimate(**kwargs):
    """An estimate's kernel stack on meta tensors: (values, tracker), the tracker active."""
    values = KnownValues(MetaKernels(), **kwargs)
    tracker = LiveStorageTracker(kernel=values, values=values, fake_scalars=True)
    with tracker:
        yield values, tracker


def known(values: KnownValues, host: torch.Tensor) -> torch.Tensor:
    """``host`` moved to meta as a batch is, its value kept."""
    return values.move(host, torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="meta"))


def unknown(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
