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

from ..compat import disable_current_modes, nested_internals, nested_view_dummy, tree_flatten
from .session import EstimateSession

Move = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NotShapeOnly(Exception):
    """Work that no shape-only engine can run (neither ``meta`` tensors nor ``FakeTensorMode``)."""


def is_jagged(t: torch.Tensor) -> bool:
    """Is ``t`` a nested tensor of jagged layout?"""
    return t.is_nested and t.layout == torch.jagged


def make_view_dummy() -> None:
    """Make the dummy NJT torch passes to every view of values as an NJT (two ``meta`` tensors, made once per
    process on first use): made inside a measurement, the first one to build such a view would count it."""
    make = nested_view_dummy()
    if make is None:  # a torch that makes none
        return
    with disable_current_modes():  # (made outside any FakeTensorMode the first measurement runs under)
        make()


def to_meta(t: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor], move: Move) -> torch.Tensor:
    """The host NJT ``t`` as an NJT of ``meta`` tensors laid out as the host's: ``copy(inner)`` makes each inner
    tensor's shape-only copy, ``move(inner, copy)`` gives it the host's value. What it creates is for the
    caller to count (a real device's move is ``clone()`` of it)."""
    NestedTensor = nested_internals()[2]  # noqa: N806
    assert isinstance(t, NestedTensor)
    nt: Any = t

    def meta(inner: torch.Tensor | None) -> Any:
        return None if inner is None else move(inner, copy(inner))

    cache = {key: meta(value) for key, value in nt._metadata_cache.items()}
    return NestedTensor(meta(nt._values), meta(nt._offsets), lengths=meta(nt._lengths), _ragged_idx=nt._ragged_idx,
                        _metadata_cache=cache, requires_grad=nt.requires_grad)


@contextlib.contextmanager
def nested_on_meta(device_type: str, move: Move) -> Iterator[None]:
    """While inside, NJTs of ``meta`` tensors stand in for NJTs on ``device_type`` (the device stood in for)
    where they can, and stop with :class:`NotShapeOnly` where they cannot: CPU autocast (it casts an NJT's ops
    on the CPU, and no ``meta`` tensor takes it), attention standing in for a CUDA GPU, attention through the
    math backend. Elsewhere attention runs as torch runs it, without asking autocast about ``meta`` (which it
    refuses). An NJT built from a list of tensors counts the sizes it makes its offsets of, ``move(host,
    device_tensor)`` giving them their values (see :func:`to_meta`)."""
    import torch.utils.flop_counter  # noqa: F401  # NJT attention asks it about meta tensors without importing it
    nested_tensor, sdpa, NestedTensor = nested_internals()  # noqa: N806

    autocast, select = sdpa._autocast, sdpa._select_sdp_backend
    from_list = nested_tensor.jagged_from_list

    def uncast(query: torch.Tensor, *rest: Any) -> tuple[Any, ...]:
        # Autocast over a meta NJT stops before: at its op on the CPU, at the backend standing in for CUDA.
        return (query, *rest) if query.is_meta else autocast(query, *rest)

    def jagged_from_list(tensors: Any, offsets: Any, *args: Any, **kwargs: Any) -> Any:
        if offsets is not None or not tensors or not tensors[0].is_meta:
            return from_list(tensors, offsets, *args, **kwargs)
        with _sizes_counted(move):
            return from_list(tensors, offsets, *args, **kwargs)

    stand_ins = {(sdpa, "_autocast"): uncast, (sdpa, "_select_sdp_backend"): _backend(select, device_type),
                 (NestedTensor, "__torch_function__"): _autocast_stops(vars(NestedTensor)["__torch_function__"],
                                                                      device_type),
                 (nested_tensor, "jagged_from_list"): jagged_from_list}
    originals = {(owner, name): vars(owner)[name] for owner, name in stand_ins}
    with EstimateSession():
        for (owner, name), value in stand_ins.items():
            setattr(owner, name, value)
        try:
            yield
        finally:
            for (owner, name), value in originals.items():
                setattr(owner, name, value)


def _backend(select: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """NJT attention's backend choice ``select``, stopping where a meta NJT cannot stand in for it."""
    from torch.nn.attention import SDPBackend

    def backend(query: torch.Tensor, *args: Any) -> Any:
        if query.is_meta and device_type == "cuda":
            raise NotShapeOnly("attention over a nested tensor of jagged layout on a CUDA GPU: the estimate does "
                               "not stand in for CUDA's kernels over nested tensors (flash, memory-efficient, "
                               "cuDNN attention)")
        choice = select(query, *args)
        if query.is_meta and choice == SDPBackend.MATH:
            raise NotShapeOnly(
                f"attention over a nested tensor of jagged layout takes the math backend on the {device_type}, "
                "which runs over nested tensors of strided layout: neither meta tensors nor FakeTensorMode can "
                "hold one")
        return choice

    return backend


def _autocast_stops(function: Any, device_type: str) -> Any:
    """The NJT's ``__torch_function__`` (the classmethod ``function``), stopping where CPU autocast would cast a
    meta NJT's op (standing in for the CPU)."""
    NestedTensor: Any = nested_internals()[2]  # noqa: N806

    def torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if device_type == "cpu" and torch.is_autocast_enabled("cpu") and any(
                isinstance(t, NestedTensor) and t._values.is_meta for t in tree_flatten((args, kwargs))[0]):
            raise NotShapeOnly("CPU autocast over a nested tensor of jagged layout: it casts the nested tensor's "
                               "ops on the CPU, which no meta tensor takes, and FakeTensorMode cannot hold a "
                               "nested tensor")
        return function.__func__(cls, func, types, args, kwargs)

    return classmethod(torch_function)


@contextlib.contextmanager
def _sizes_counted(move: Move) -> Iterator[None]:
    """While inside, ``torch.tensor(data, device=...)`` (the sizes an NJT built from a list turns into its
    offsets) is made on the host and copied to its device, ``move(host, device_tensor)`` giving it the host's
    value: a copy the estimate counts, as the CPU counts the tensor it makes (a ``meta`` tensor made directly
    passes no dispatch: uncounted, its value unknown)."""
    made = torch.tensor

    def tensor(data: Any, *, device: Any = None, requires_grad: bool = False, **options: Any) -> torch.Tensor:
        if device is None:
            return made(data, requires_grad=requires_grad, **options)
        with disable_current_modes():
            host = made(data, **options)
        out = move(host, torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device))
        return out.requires_grad_() if requires_grad else out

    setattr(torch, "tensor", tensor)  # noqa: B010  # torch.tensor's own type is not this function's
    try:
        yield
    finally:
        setattr(torch, "tensor", made)  # noqa: B010
