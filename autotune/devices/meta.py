"""Fast fake execution on the ``meta`` device: memoised meta kernels, CPU kernel choices.

An estimate runs the fit rule on ``meta`` tensors: they carry shape, strides and
dtype but no data, so every kernel only works out its outputs' metadata. Most of
those kernels are Python (``torch._refs``), and a training step calls the same
few of them again and again with the same shapes (every layer, every
micro-step). :class:`MetaKernels` remembers, per op and per input metadata, what
the op returned (fresh tensors of a shape, or its in-place argument) and replays
that instead of running the kernel again.

Some composite ops pick a kernel by the device they run on, and on ``meta``
they would pick another one than on the CPU, with other temporaries.
:class:`CpuKernelChoices` makes ``scaled_dot_product_attention`` choose as on
the CPU (the fused flash kernel where the CPU takes it, instead of the math
path that materialises the attention matrix) and runs recurrent layers as the
CPU does (:mod:`autotune.devices.recurrent`: oneDNN's LSTM kernel with its
workspace, RNN.cpp's cells otherwise). What the meta engine cannot stand in for
stops the run with :class:`NeedsFakeTensors`: the estimate then runs under
``FakeTensorMode``, which sees a CPU device throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend

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
        returns = func._schema.returns
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
    inputs = {t.untyped_storage()._cdata for t in tensors}
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
        if storage._cdata in inputs or storage._cdata in fresh:
            return None
        if storage.nbytes() != _dense_bytes(x.shape, x.stride(), x.element_size()):
            return None
        fresh.add(storage._cdata)
        return (_NEW, x.shape, x.stride(), x.dtype)

    if isinstance(out, (tuple, list)):
        parts = [leaf(x) for x in out]
        if any(p is None for p in parts):
            return _ALWAYS_RUN
        return (_SEQ, type(out), tuple(parts))
    return leaf(out) or _ALWAYS_RUN


_RECURRENT = ("lstm", "gru", "rnn_tanh", "rnn_relu")
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class CpuKernelChoices:
    """While active, composite ops on ``meta`` tensors choose their kernels as on the CPU.

    A context manager: it registers ``meta`` kernels for the composite ops that
    choose by device and removes them on exit. ``pause``: a context manager
    under which the stand-ins used to ask the CPU for its choice are not counted
    as device memory.
    """

    def __init__(self, pause: Callable[[], Any]):
        self._pause = pause
        self._choices: dict[tuple, int] = {}
        self._library: torch.library.Library | None = None

    def __enter__(self) -> CpuKernelChoices:
        from .recurrent import register_cpu_recurrent  # it raises NeedsFakeTensors, defined here

        self._library = attention_library(self._attention,
                                          recurrent=lambda library: register_cpu_recurrent(library, self._pause))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._library is not None:
            self._library._destroy()
            self._library = None

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False) -> torch.Tensor:
        args = (query, key, value, attn_mask, dropout_p, is_causal)
        # What the CPU's choice reads: sizes, last strides, dtypes, the arguments, and
        # which kernels are enabled (sdpa_kernel(...) contexts change that).
        signature = tuple((t.shape, t.stride(-1), t.dtype, t.requires_grad) if t is not None else None
                          for t in args[:4]) + (dropout_p, is_causal, scale, enable_gqa,
                                                torch.backends.cuda.flash_sdp_enabled(),
                                                torch.backends.cuda.math_sdp_enabled())
        choice = self._choices.get(signature)
        if choice is None:
            with self._pause():
                q, k, v = (_stand_in(t) for t in (query, key, value))
                m = _stand_in(attn_mask) if attn_mask is not None else None
                choice = int(torch._fused_sdp_choice(q, k, v, m, dropout_p, is_causal, scale=scale,
                                                     enable_gqa=enable_gqa))
            self._choices[signature] = choice
        if choice != SDPBackend.FLASH_ATTENTION.value:
            # The math path: the same composite on meta as on the CPU.
            return _SDPA.decompose(*args, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # As the CPU does: a boolean mask becomes an additive one first.
            attn_mask = torch.where(attn_mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=query.dtype,
                                                                        device=attn_mask.device))
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out


def attention_library(attention: Callable[..., Any], key: str = "AutogradMeta",
                      recurrent: Callable[[torch.library.Library], None] | None = None) -> torch.library.Library:
    """``attention`` as ``scaled_dot_product_attention``'s kernel for tensors of the autograd dispatch ``key``,
    above autograd, where the composite would decompose (the kernels it picks record their own backward). On
    ``meta`` tensors, ``recurrent(library)`` registers the recurrent layers' kernels; without it they raise
    :class:`NeedsFakeTensors`. Destroy the library to undo it."""
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("scaled_dot_product_attention", attention, key)
        if key == "AutogradMeta" and recurrent is not None:
            recurrent(library)
        elif key == "AutogradMeta":  # FakeTensorMode runs recurrent layers; meta tensors cannot by default
            for name in _RECURRENT:
                for overload in ("input", "data"):
                    library.impl(f"{name}.{overload}", _recurrent(name), "AutogradMeta")
    except BaseException:
        library._destroy()
        raise
    return library


def _recurrent(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NeedsFakeTensors(f"torch.{name} runs as a cuDNN kernel on a CUDA GPU, whose reserve space meta "
                               "tensors do not stand in for")

    return kernel


def _stand_in(x: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor with ``x``'s sizes, dtype and last stride, holding a handful of bytes:
    what the CPU's kernel choice looks at."""
    if x.dim() == 0:
        return torch.empty((), dtype=x.dtype, requires_grad=x.requires_grad)
    last = x.stride(-1)
    base = torch.empty((x.shape[-1] - 1) * last + 1 if x.shape[-1] else 1, dtype=x.dtype,
                       requires_grad=x.requires_grad)
    return base.as_strided(x.shape, (0,) * (x.dim() - 1) + (last,))
