"""The CPU's kernel choices on ``meta`` tensors: attention and recurrent layers as the CPU runs them.

Some composite ops pick a kernel by the device they run on, and on ``meta``
they would pick another one than on the CPU, with other temporaries.
:class:`CpuKernelChoices` makes ``scaled_dot_product_attention`` choose as on
the CPU (the fused flash kernel where the CPU takes it, instead of the math
path that materialises the attention matrix) and runs recurrent layers as the
CPU does (:mod:`autotune.devices.recurrent`: oneDNN's LSTM kernel with its
workspace, RNN.cpp's cells otherwise). :mod:`autotune.devices.cudakernels`
does the same for a CUDA GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from ..compat import fused_sdp_choice
from .meta import attention_kernels
from .recurrent import register_cpu_recurrent

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
        self._kernels = contextlib.ExitStack()

    def __enter__(self) -> CpuKernelChoices:
        self._kernels.enter_context(attention_kernels(
            self._attention, recurrent=lambda library: register_cpu_recurrent(library, self._pause)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._kernels.close()

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
                choice = fused_sdp_choice(q, k, v, m, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
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


def _stand_in(x: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor with ``x``'s sizes, dtype and last stride, holding a handful of bytes:
    what the CPU's kernel choice looks at."""
    if x.dim() == 0:
        return torch.empty((), dtype=x.dtype, requires_grad=x.requires_grad)
    last = x.stride(-1)
    base = torch.empty((x.shape[-1] - 1) * last + 1 if x.shape[-1] else 1, dtype=x.dtype,
                       requires_grad=x.requires_grad)
    return base.as_strided(x.shape, (0,) * (x.dim() - 1) + (last,))
