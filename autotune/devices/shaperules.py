"""Shape rules: the outputs of ops whose shapes come from their inputs' values, on shape-only tensors.

PyTorch has no ``meta`` kernel (and ``FakeTensorMode`` no rule without a
shape environment) for ops whose output shape depends on the data, and some
composites read their inputs' data. Given the values
:class:`~autotune.devices.values.KnownValues` keeps, these shapes follow, and
each rule here builds the outputs the real op builds (same sizes, strides,
dtype, device and storage bytes; ``tests/devices/test_shaperules.py`` checks
each against the real op):

- :data:`RULES`, ops always handled here: ``_pack_padded_sequence`` (the packed
  rows are the sum of the lengths; ``batch_sizes`` stays on the host, as the
  real op leaves it), ``_ctc_loss`` with tensor lengths (``log_alpha`` is
  ``(batch, time, 2 x longest target + 1)``) and its backward (the gradient of
  the log-probabilities), a boolean index and ``masked_select`` (the true
  elements of a known mask, whatever the data), and ``_embedding_bag`` as the
  CPU lays it out when the estimate stands in for the CPU (the meta kernel lays
  it out as CUDA does);
- :func:`rule_library`: ``_pad_packed_sequence``, which PyTorch composes above
  autograd from its batch sizes' data, op for op as PyTorch composes it;
- :data:`BOUNDS`, data-dependent sizes of values that depend on parameters:
  the size at the upper bound of its range (what ``FakeTensorMode``'s unbacked
  symbol would be constrained to): ``nonzero``, a boolean index and
  ``masked_select`` every element, ``unique`` every element distinct, CTC's
  longest target the targets' width, packed rows every time step of every
  sequence. Sizes with no bound (``repeat_interleave`` of unknown repeats
  without ``output_size``, ``bincount`` of unknown values) stop the estimate
  with the engine's own error.

Each rule's ``(values, func, args, kwargs)`` receives the
:class:`~autotune.devices.values.KnownValues` the estimate runs with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from .. import compat
from .session import aten_kernels

aten = torch.ops.aten
_MASKS = (torch.bool, torch.uint8)


class KnownValues(Protocol):
    """What the rules use of :class:`~autotune.devices.values.KnownValues` (the estimate's kernel, which runs
    them)."""

    cpu: bool
    shapes: int
    inner: Callable[[Any, tuple, dict], Any]

    def value(self, t: torch.Tensor) -> torch.Tensor | None: ...

    def known(self, *tensors: torch.Tensor | None) -> bool: ...

    def is_device(self, t: torch.Tensor) -> bool: ...

    def host(self) -> contextlib.AbstractContextManager: ...

    def attach(self, t: torch.Tensor, host: torch.Tensor, *, own: bool = False) -> bool: ...

    def to_device(self, host: torch.Tensor) -> torch.Tensor: ...

    def bound(self, func: Any) -> None: ...

    def generic(self, func: Any, args: tuple, kwargs: dict) -> Any: ...

    def dynamic(self, func: Any, args: tuple, kwargs: dict) -> Any: ...


def _empty(like: torch.Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor on ``like``'s device (meta, or a fake CPU tensor under FakeTensorMode)."""
    return torch.empty(tuple(shape), dtype=dtype or like.dtype, device=like.device)


# -- ops handled here -------------------------------------------------------------------------------


def pack_padded_sequence(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """``_pack_padded_sequence(input, lengths, batch_first)``: the real op on a stand-in of ``input`` with no
    trailing width gives the row count and ``batch_sizes`` (and the op's own checks) from ``lengths``."""
    data, lengths, batch_first = args[0], args[1], args[2] if len(args) > 2 else kwargs["batch_first"]
    host_lengths = values.value(lengths)
    rest = tuple(data.shape[2:])
    if host_lengths is None:  # every time step of every sequence
        steps, batch = (data.shape[1], data.shape[0]) if batch_first else (data.shape[0], data.shape[1])
        values.bound(func)
        return _empty(data, (steps * batch, *rest)), torch.empty(steps, dtype=torch.long)
    with values.host():
        stand_in = torch.empty((*data.shape[:2], 1), dtype=torch.uint8)
        rows, batch_sizes = compat.pack_padded_sequence(stand_in, host_lengths, batch_first)
    values.shapes += 1
    out = _empty(data, (rows.shape[0], *rest))
    host = values.value(data)
    if host is not None:
        with values.host():
            values.attach(out, compat.pack_padded_sequence(host, host_lengths, batch_first)[0])
    return out, batch_sizes


def ctc_loss(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """``_ctc_loss.Tensor``: ``neg_log_likelihood`` (batch,) and ``log_alpha`` (batch, time, 2 x longest + 1),
    as LossCTC.cpp and LossCTC.cu allocate them, from the target lengths' values (else the targets' width)."""
    log_probs, targets, target_lengths = args[0], args[1], args[3]
    longest = values.value(target_lengths)
    if longest is not None:
        values.shapes += 1
        width = int(longest.max()) if longest.numel() else 0
    else:
        values.bound(func)
        width = targets.shape[-1] if targets.dim() == 2 else targets.numel()
    batched = log_probs.dim() == 3
    batch = log_probs.shape[1] if batched else 1
    return _empty(log_probs, (batch,)), _empty(log_probs, (batch, log_probs.shape[0], 2 * width + 1))


def ctc_loss_backward(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """``_ctc_loss_backward``: the gradient of the log-probabilities, ``full_like(log_probs)`` contiguous."""
    log_probs = args[1]
    return _empty(log_probs, log_probs.shape)


def embedding_bag(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """``_embedding_bag`` and ``_embedding_bag_forward_only`` as the CPU lays them out (EmbeddingBag.cpp; the
    meta kernel lays them out as CUDA does, which an estimate for a GPU keeps): ``offset2bag`` only off the
    fast path of ``sum`` (``(n,)`` in a storage of ``n + 1``), ``bag_size`` a storage of one per offset resized
    to one per bag where backward or the mode needs it, ``max_indices`` ``(bags, dim)`` for ``max``, else like
    ``bag_size``; index tensors in the promoted type of indices and offsets."""
    if not values.cpu:
        return values.generic(func, args, kwargs)
    weight, indices, offsets = args[0], args[1], args[2]
    mode, last = _arg(func, args, kwargs, "mode"), _arg(func, args, kwargs, "include_last_offset")
    scale, padding = _arg(func, args, kwargs, "per_sample_weights"), _arg(func, args, kwargs, "padding_idx")
    index = torch.promote_types(indices.dtype, offsets.dtype)
    n, bags, width = indices.shape[0], offsets.shape[0] - (1 if last else 0), weight.shape[1]
    output = _empty(weight, (bags, width))
    fast = weight.dtype in _fast_dtypes() and weight.stride(1) == 1 and padding < 0 and \
        (scale is None or scale.stride(0) == 1)
    offset2bag = _empty(offsets, (0,), index)
    if mode != _SUM or not fast:
        offset2bag = _empty(offsets, (n + 1,), index).resize_(n)
    bag_size = _empty(offsets, offsets.shape, index)
    if func is aten._embedding_bag.default or mode != _SUM:
        bag_size.resize_(bags)
    max_indices = _empty(offsets, bag_size.shape, index)
    if mode == _MAX:
        max_indices.resize_(bags, width)
    return output, offset2bag, bag_size, max_indices


_SUM, _MAX = 0, 2


def _fast_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes of the CPU's fast ``sum`` path: bfloat16 joins float and half only in builds without
    FBGEMM."""
    global _FAST
    if _FAST is None:
        with compat.disable_current_modes():
            out = torch.ops.aten._embedding_bag_forward_only(torch.zeros(1, 1, dtype=torch.bfloat16),
                                                             torch.zeros(1, dtype=torch.long),
                                                             torch.zeros(1, dtype=torch.long))
        _FAST = (torch.float32, torch.float16) + ((torch.bfloat16,) if out[1].numel() == 0 else ())
    return _FAST


_FAST: tuple[torch.dtype, ...] | None = None


def index(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """``index.Tensor`` with boolean masks: each mask becomes the positions of its true elements (one long
    index per mask dimension), as the real kernel expands it; at most every element when the mask is unknown."""
    self, indices = args[0], list(args[1])
    masks = [i for i, x in enumerate(indices) if x is not None and x.dtype in _MASKS and values.is_device(x)]
    if not masks or values.known(self, *[x for x in indices if x is not None]):
        return values.dynamic(func, args, kwargs) if masks else values.inner(func, args, kwargs)
    expanded: list[torch.Tensor | None] = []
    for i, x in enumerate(indices):
        if i not in masks:
            expanded.append(x)
            continue
        host = values.value(x)
        if host is None:
            values.bound(func)
            expanded.extend(_empty(x, (x.numel(),), torch.long) for _ in range(x.dim()))
        else:
            values.shapes += 1
            with values.host():
                where = host.nonzero()
            expanded.extend(values.to_device(where[:, d].contiguous()) for d in range(x.dim()))
    return values.inner(func, (self, expanded), kwargs)


def pad_packed_sequence(values: KnownValues, data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool,
                        padding_value: float, total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_pad_packed_sequence``, op for op as PackedSequence.cpp composes it (so autograd records the same
    backward), reading ``batch_sizes`` from its value: ``(steps, batch, *)`` filled with ``padding_value``, each
    run of equal batch sizes copied in, the lengths on the host."""
    host = values.value(batch_sizes)
    if host is None:
        raise RuntimeError("_pad_packed_sequence: the batch sizes of a packed sequence are not known")
    sizes = [int(s) for s in host.tolist()]
    steps, batch, rest = len(sizes), sizes[0], tuple(data.shape[1:])
    if total_length > 0:
        if total_length < steps:
            raise RuntimeError(f"Expected total_length to be at least the length of the longest sequence "
                               f"({steps}), but got total_length={total_length}")
        steps = total_length
    output = data.new_full((steps, batch, *rest), padding_value)
    offset, previous, start = 0, batch, 0
    for i in range(len(sizes) + 1):
        size = sizes[i] if i < len(sizes) else 0
        if size != previous:
            rows = previous * (i - start)
            output[start:i, :previous].copy_(data[offset:offset + rows].view(i - start, previous, *rest))
            offset, start = offset + rows, i
        previous = size
    with values.host():
        lengths = torch.tensor([sum(1 for s in sizes if s > k) for k in range(batch)], dtype=torch.long)
    if values.cpu:  # the CPU's lengths are device memory too
        lengths = torch.empty(batch, dtype=torch.long).copy_(lengths)
    return output.transpose(0, 1) if batch_first else output, lengths


@contextlib.contextmanager
def rule_kernels(values: KnownValues, key: str) -> Iterator[None]:
    """While inside, the rules PyTorch composes above autograd (``_pad_packed_sequence`` reads its batch sizes'
    data, which shape-only tensors lack) are kernels for tensors of the autograd dispatch ``key``
    (``AutogradMeta``, or ``AutogradCPU`` for FakeTensorMode's tensors)."""
    with aten_kernels() as library:
        compat.register_kernel(library, "_pad_packed_sequence", lambda *args: pad_packed_sequence(values, *args), key)
        yield


def masked_select(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """``masked_select(self, mask)``: one element per true element of the mask broadcast to both shapes."""
    self, mask = args[0], args[1]
    host = values.value(mask)
    if host is None or values.known(self):
        return values.dynamic(func, args, kwargs)
    values.shapes += 1
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    with values.host():
        count = int(host.expand(shape).count_nonzero())
    return _empty(self, (count,))


RULES: dict[Any, Callable[[KnownValues, Any, tuple, dict], Any]] = {
    aten._pack_padded_sequence.default: pack_padded_sequence,
    aten._ctc_loss.Tensor: ctc_loss,
    aten._ctc_loss_backward.Tensor: ctc_loss_backward,
    aten._ctc_loss_backward.default: ctc_loss_backward,
    aten.index.Tensor: index,
    aten.masked_select.default: masked_select,
    aten._embedding_bag.default: embedding_bag,
    aten._embedding_bag_forward_only.default: embedding_bag,
}


# -- worst cases for sizes of values that depend on parameters -----------------------------------------


def _arg(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The argument ``name`` of a call of ``func``, given or defaulted."""
    for i, a in enumerate(compat.op_schema(func).arguments):
        if a.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, a.default_value)
    raise KeyError(name)


def _nonzero(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    x = args[0]
    return _empty(x, (x.numel(), x.dim()), torch.long)


def _masked_select(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    x, mask = args[0], args[1]
    return _empty(x, (torch.broadcast_shapes(x.shape, mask.shape).numel(),))


def _unique(values: KnownValues, func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """``_unique2``, ``unique_dim`` and ``unique_consecutive``: every element (or slice along ``dim``) distinct."""
    x = args[0]
    dim = _arg(func, args, kwargs, "dim") if any(a.name == "dim" for a in compat.op_schema(func).arguments) \
        else None
    inverse, counts = _arg(func, args, kwargs, "return_inverse"), _arg(func, args, kwargs, "return_counts")
    if dim is None:
        unique, positions = (x.numel(),), x.shape
    else:
        unique, positions = x.shape, (x.shape[dim],)
    return (_empty(x, unique), _empty(x, positions if inverse else (0,), torch.long),
            _empty(x, (unique[0] if dim is None else x.shape[dim],) if counts else (0,), torch.long))


BOUNDS: dict[Any, Callable[[KnownValues, Any, tuple, dict], Any]] = {
    aten.nonzero.default: _nonzero,
    aten.masked_select.default: _masked_select,
    aten._unique2.default: _unique,
    aten.unique_consecutive.default: _unique,
    aten.unique_dim.default: _unique,
}
