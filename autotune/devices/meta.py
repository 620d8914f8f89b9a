"""Fast fake execution on the ``meta`` device: memoised meta kernels, CPU kernel choices.

An estimate runs the fit rule on ``meta`` tensors: they carry shape, strides and
dtype but no data, so every kernel only works out its outputs' metadata. Most of
those kernels are Python (``torch._refs``), and a training step calls the same
few of them again and again with the same shapes (every layer, every
micro-step). :class:`MetaKernels` remembers, per op and per input metadata, what
the op returned (fresh tensors of a shape, or its in-place argument) and replays
that instead of running the kernel again.

Some composite ops pick a kernel by the device they run on: :func:`attention_kernels`
registers the kernel choices of the device stood in for
(:mod:`autotune.devices.cpukernels`, :mod:`autotune.devices.cudakernels`).
What the meta engine cannot stand in for stops the run with
:class:`NeedsFakeTensors`, or with torch's own error for a ``meta`` tensor where
real data or a CPU tensor is needed (:func:`meta_cannot_run` tells those from
the work's own errors): the estimate then runs under ``FakeTensorMode``, which
sees a CPU device throughout.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..compat import op_schema, register_kernel, storage_key
from ..errors import first_line
from .session import aten_kernels

_META = torch.device("meta")
_HASHABLE = {int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout}
_DYNAMIC = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)

# Replay recipes: how to rebuild an op's output from its inputs.
_NEW, _ARG, _VALUE, _SEQ = range(4)
_ALWAYS_RUN = object()  # memo entry: this op's output cannot be replayed


class NeedsFakeTensors(Exception):
    """A layer whose memory on the CPU the meta device cannot stand in for."""


class _Unhashable(Exception):
    pass


#: The types torch's errors for a ``meta`` tensor come as (``NotImplementedError`` is a RuntimeError).
META_ERRORS = (RuntimeError, TypeError)
_NAMES_META = re.compile(r"\bmeta\b", re.IGNORECASE)


def meta_cannot_run(exc: BaseException) -> str | None:
    """Why the meta engine cannot run the work that raised ``exc`` (``FakeTensorMode`` can), in one line; None
    when ``exc`` is the work's own error.

    The meta engine's inability is :class:`NeedsFakeTensors`, or torch's own error naming the ``meta`` device
    (no ``Meta`` kernel for an op, ``Cannot copy out of meta tensor``, ``can't convert meta device type tensor to
    numpy``, a CPU tensor where a meta one is expected), raised directly or as the explicit cause of the error
    that wraps it (a model factory's, in :class:`~autotune.errors.WorkloadError`)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        line = first_line(cause)[:300]
        if isinstance(cause, NeedsFakeTensors) or (isinstance(cause, META_ERRORS) and _NAMES_META.search(line)):
            return line
        cause = cause.__cause__
    return None


def _signature(x: Any, tensors: list[torch.Tensor], sigs: list[tuple]) -> Any:
    """``x`` as a hashable key; its tensors (all on ``meta``) collected in order."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise _Unhashable
        sig = (x.shape, x.stride(), x.dtype, x.storage_offset())  # stride() raises for a sparse layout
        tensors.append(x)
        sigs.append(sig)
        return sig
    kind = type(x)
    if kind is list or kind is tuple:
        return tuple([_signature(v, tensors, sigs) for v in x])
    if kind in _HASHABLE:
        return x
    raise _Unhashable  # a Generator, a SymInt, an opaque object: always run


_NEVER_MEMO: dict = {}


def _never_memo(func) -> bool:
    """Views (their outputs share an input's storage) and data-dependent ops always run."""
    flag = _NEVER_MEMO.get(func)
    if flag is None:
        returns = op_schema(func).returns
        flag = any(r.alias_info is not None and not r.alias_info.is_write for r in returns) or any(
            tag in _DYNAMIC for tag in func.tags)
        _NEVER_MEMO[func] = flag
    return flag


def _dense_bytes(shape: torch.Size, stride: tuple[int, ...], itemsize: int) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * itemsize


class MetaKernels:
    """Runs aten ops on ``meta`` tensors, replaying remembered outputs where it can.

    A replay is exact: an op's output metadata on ``meta`` depends only on the
    op, its arguments' metadata and its non-tensor arguments, which make the key.
    Outputs are replayed only when the op returned fresh dense tensors (each its
    own storage) or handed back an argument unchanged (in-place and ``out=``).
    Anything else (views, ops on real tensors, data-dependent shapes, an op that
    resized its argument) runs every time.
    """

    def __init__(self) -> None:
        self._memo: dict[Any, Any] = {}
        self.replayed = 0

    def __call__(self, func, args: tuple, kwargs: dict) -> Any:
        if torch.is_autocast_enabled("cpu"):
            raise NeedsFakeTensors("autocast on the CPU does not apply to meta tensors")
        if _never_memo(func):
            return func(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        sigs: list[tuple] = []
        try:
            key = (func, _signature(args, tensors, sigs),
                   _signature(tuple(kwargs.items()), tensors, sigs) if kwargs else None)
        except (_Unhashable, RuntimeError):
            return func(*args, **kwargs)
        recipe = self._memo.get(key)
        if recipe is not None and recipe is not _ALWAYS_RUN:
            self.replayed += 1
            return _replay(recipe, tensors)
        out = func(*args, **kwargs)
        if recipe is None:
            self._memo[key] = _recipe(out, tensors, sigs)
        return out

    def __len__(self) -> int:
        return len(self._memo)


def _replay(recipe: tuple, tensors: list[torch.Tensor]) -> Any:
    kind = recipe[0]
    if kind == _NEW:
        return torch.empty_strided(recipe[1], recipe[2], dtype=recipe[3], device=_META)
    if kind == _ARG:
        return tensors[recipe[1]]
    if kind == _VALUE:
        return recipe[1]
    return recipe[1]([_replay(r, tensors) for r in recipe[2]])


def _recipe(out: Any, tensors: list[torch.Tensor], sigs: list[tuple]) -> Any:
    """How to rebuild ``out`` from the inputs, or ``_ALWAYS_RUN``."""
    # An op that changed an argument's metadata (resize_, set_, in-place views) is never replayed.
    for t, sig in zip(tensors, sigs):
        if (t.shape, t.stride(), t.dtype, t.storage_offset()) != sig:
            return _ALWAYS_RUN
    inputs = {storage_key(t.untyped_storage()) for t in tensors}
    fresh: set[int] = set()

    def leaf(x: Any) -> tuple | None:
        if not isinstance(x, torch.Tensor):
            return (_VALUE, x) if isinstance(x, (int, float, bool, type(None))) else None
        for i, t in enumerate(tensors):
            if x is t:
                return (_ARG, i)
        if not x.is_meta or type(x) is not torch.Tensor or x.layout != torch.strided:
            return None
        if x.storage_offset() != 0 or x.is_conj() or x.is_neg():
            return None
        storage = x.untyped_storage()
        key = storage_key(storage)
        if key in inputs or key in fresh:
            return None
        if storage.nbytes() != _dense_bytes(x.shape, x.stride(), x.element_size()):
            return None
        fresh.add(key)
        return (_NEW, x.shape, x.stride(), x.dtype)

    if isinstance(out, (tuple, list)):
        parts = [leaf(x) for x in out]
        if any(p is None for p in parts):
            return _ALWAYS_RUN
        return (_SEQ, type(out), tuple(parts))
    return leaf(out) or _ALWAYS_RUN


_RECURRENT = ("lstm", "gru", "rnn_tanh", "rnn_relu")


@contextlib.contextmanager
def attention_kernels(attention: Callable[..., Any], key: str = "AutogradMeta",
                      recurrent: Callable[[torch.library.Library], None] | None = None
                      ) -> Iterator[torch.library.Library]:
    """While inside, ``attention`` is ``scaled_dot_product_attention``'s kernel for tensors of the autograd
    dispatch ``key``, above autograd, where the composite would decompose (the kernels it picks record their own
    backward). On ``meta`` tensors, ``recurrent(library)`` registers the recurrent layers' kernels; without it
    they raise :class:`NeedsFakeTensors`."""
    with aten_kernels() as library:
        register_kernel(library, "scaled_dot_product_attention", attention, key)
        if key == "AutogradMeta" and recurrent is not None:
            recurrent(library)
        elif key == "AutogradMeta":  # FakeTensorMode runs recurrent layers; meta tensors cannot by default
            for name in _RECURRENT:
                for overload in ("input", "data"):
                    register_kernel(library, f"{name}.{overload}", _recurrent(name), "AutogradMeta")
        yield library


def _recurrent(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NeedsFakeTensors(f"torch.{name} runs as a cuDNN kernel on a CUDA GPU, whose reserve space meta "
                               "tensors do not stand in for")

    return kernel
