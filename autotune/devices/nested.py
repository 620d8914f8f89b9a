"""Nested tensors of jagged layout on the meta engine: a batch's ``torch.nested`` tensor moved to the estimate.

A nested tensor of ``layout=torch.jagged`` (NJT) wraps plain tensors: its ``values`` (every sequence's rows
concatenated), its ``offsets`` (where each sequence starts), optionally ``lengths``, and a cache of its
shortest and longest sequence (tensors of no bytes whose first size is that length); its ragged size is a
nested int tied to the offsets. ``FakeTensorMode`` cannot build one without a shape environment, but the meta
engine can: the batch is built for real on the host, and :func:`to_meta` makes an NJT whose inner tensors are
``meta`` tensors with the host's as their known values (see :mod:`autotune.devices.values`). Every op on it
then runs as on the CPU: the NJT's own dispatch runs each op on its inner tensors, which pass through the
estimate's tracker as plain ``meta`` tensors, their values known where they come from the offsets alone (the
sequence lengths NJT ops read with ``.item()`` and ``.tolist()``). Its memory is counted as a real device's
move counts it: ``clone()`` copies the values (made contiguous where there are lengths), and the offsets and
cache it keeps are counted by the session, as on the CPU.

Attention (``scaled_dot_product_attention`` over NJTs) takes autocast's state of the device stood in for
(:func:`attention_on_meta`). On the CPU it takes the math backend, which runs over nested tensors of strided
layout; those live on the CPU or a GPU only: neither ``meta`` tensors nor ``FakeTensorMode`` (which refuses
every op on them) can hold one, so the estimate stops with :class:`NotShapeOnly` and says so, and the probe
searches on the device. Standing in for a CUDA GPU, whose fused kernels over nested tensors (flash,
memory-efficient, cuDNN attention) the estimate does not stand in for, it stops the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .session import EstimateSession

Move = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NotShapeOnly(Exception):
    """Work that no shape-only engine can run (neither ``meta`` tensors nor ``FakeTensorMode``)."""


def is_jagged(t: torch.Tensor) -> bool:
    """Is ``t`` a nested tensor of jagged layout?"""
    return t.is_nested and t.layout == torch.jagged


def to_meta(t: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor], move: Move) -> torch.Tensor:
    """The host NJT ``t`` as an NJT of ``meta`` tensors laid out as the host's: ``copy(inner)`` makes each inner
    tensor's shape-only copy, ``move(inner, copy)`` gives it the host's value. What it creates is for the
    caller to count (a real device's move is ``clone()`` of it)."""
    from torch.nested._internal.nested_tensor import NestedTensor

    assert isinstance(t, NestedTensor)

    def meta(inner: torch.Tensor | None) -> Any:
        return None if inner is None else move(inner, copy(inner))

    cache = {key: meta(value) for key, value in t._metadata_cache.items()}
    return NestedTensor(meta(t._values), meta(t._offsets), lengths=meta(t._lengths), _ragged_idx=t._ragged_idx,
                        _metadata_cache=cache, requires_grad=t.requires_grad)


@contextlib.contextmanager
def attention_on_meta(device_type: str) -> Iterator[None]:
    """While inside, attention over NJTs of ``meta`` tensors takes autocast's state of ``device_type`` (the
    device stood in for), as it takes the device's own there (torch asks autocast about ``meta``, which it
    refuses), and stops with :class:`NotShapeOnly` where it takes the math backend."""
    import torch.utils.flop_counter  # noqa: F401  # NJT attention asks it about meta tensors without importing it
    from torch.nested._internal import sdpa

    autocast, select = sdpa._autocast, sdpa._select_sdp_backend

    def cast_as_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None) -> tuple[Any, Any, Any, Any]:
        if query.device.type != "meta":
            return autocast(query, key, value, attn_mask)
        if not torch.is_autocast_enabled(device_type):
            return query, key, value, attn_mask
        dtype = torch.get_autocast_dtype(device_type)

        def cast(x: torch.Tensor | None) -> Any:
            if x is None or not x.dtype.is_floating_point or x.dtype in (dtype, torch.float64):
                return x
            return x.to(dtype)

        return cast(query), cast(key), cast(value), cast(attn_mask)

    def backend(query: torch.Tensor, *args: Any) -> Any:
        if query.device.type == "meta" and device_type == "cuda":
            raise NotShapeOnly("attention over a nested tensor of jagged layout on a CUDA GPU: the estimate does "
                               "not stand in for CUDA's kernels over nested tensors (flash, memory-efficient, "
                               "cuDNN attention)")
        choice = select(query, *args)
        if query.device.type == "meta" and choice == sdpa.SDPBackend.MATH:
            raise NotShapeOnly(
                f"attention over a nested tensor of jagged layout takes the math backend on the {device_type}, "
                "which runs over nested tensors of strided layout: neither meta tensors nor FakeTensorMode can "
                "hold one")
        return choice

    with EstimateSession():
        sdpa._autocast, sdpa._select_sdp_backend = cast_as_device, backend
        try:
            yield
        finally:
            sdpa._autocast, sdpa._select_sdp_backend = autocast, select
