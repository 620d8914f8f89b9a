"""CUDA's kernel choices where they change memory, stood in for on ``meta`` tensors.

An estimate standing in for a CUDA GPU runs every op on ``meta``, where a
composite op would choose its kernel as no real device does. This module makes
the choices CUDA makes, and adds the device memory CUDA's kernels take through
the caching allocator that no tensor shows:

- ``scaled_dot_product_attention`` picks its backend as PyTorch's
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` does
  (:func:`choose_sdp_backend`: flash, memory-efficient, cuDNN or math, by
  compute capability, dtype, head dimension, mask, dropout, GQA, strides, the
  cuDNN version and the ``torch.backends.cuda.*_sdp`` switches and priority
  order; its note says the call and why each backend tried before refused),
  and runs that backend's own op, which keeps for backward what the kernel
  keeps: flash its output and logsumexp, memory-efficient its output and a
  logsumexp padded to 32 queries, cuDNN its output and logsumexp, math the
  scaled query and key, the softmax (B, H, L, S) and, with dropout, the
  dropout's boolean mask and the dropped matrix (the composite, with the
  upcast to float32 it makes for half inputs);
- ``dropout`` runs CUDA's fused kernel (``native_dropout``), which keeps a
  boolean mask for backward where the composite keeps a noise tensor of the
  input's dtype;
- the backward kernels' scratch buffers, allocated and freed inside the op:
  flash ``softmax_d`` and ``dq_accum`` (flash_api.cpp ``mha_bwd``),
  memory-efficient ``delta`` and a float32 dQ accumulator (a bound: the CUTLASS
  kernel decides its workspace on the GPU), embedding backward's sorted indices
  and per-segment partial sums (bounded by one segment per index);
- the cuBLAS workspace: allocated through the caching allocator at the first
  GEMM of each cuBLAS handle and stream and kept for the process's life
  (``CublasHandlePool.cpp``: ``getChosenWorkspaceSize``, 32 MiB on sm90, else
  4096 KiB x 2 + 16 KiB x 8, or ``CUBLAS_WORKSPACE_CONFIG``), and the cuBLASLt
  workspace (``CUBLASLT_WORKSPACE_SIZE``, 1 MiB) at the first GEMM with a bias
  epilogue. The forward runs on the main thread and the backward on autograd's
  device thread, each with its own handle: two workspaces.

What stays unknowable here is said in :attr:`CudaKernelChoices.notes`:
cuDNN's convolution and attention workspaces (cuDNN picks its algorithm on
the GPU, and takes one needing less workspace when memory is short), counted
as 0 bytes with the largest such convolution's size given for scale.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import current_autograd_node, register_kernel, sdp_priority_order
from .meta import attention_kernels

MiB = 1024**2
FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
_NAMES = {FLASH: "flash attention", EFFICIENT: "memory-efficient attention", CUDNN: "cuDNN attention",
          MATH: "the math path"}
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class CudaTarget:
    """The CUDA GPU and software an estimate stands in for: what the kernel choices read.

    ``cudnn_version`` as ``torch.backends.cudnn.version()`` reports it (91002 is
    9.10.2), ``cuda_version`` as ``torch.version.cuda`` (major, minor).
    """

    capability: tuple[int, int] = (8, 0)
    cudnn_version: int = 91002
    cuda_version: tuple[int, int] = (12, 8)
    cublas_workspace_config: str | None = None  # $CUBLAS_WORKSPACE_CONFIG
    cublaslt_workspace_size: str | None = None  # $CUBLASLT_WORKSPACE_SIZE, KiB
    cublaslt_unified: str | None = None  # $TORCH_CUBLASLT_UNIFIED_WORKSPACE
    cudnn_sdpa_deprioritized: str | None = None  # $TORCH_CUDNN_SDPA_DEPRIORITIZED

    @classmethod
    def from_environment(cls, capability: tuple[int, int], **kwargs: Any) -> CudaTarget:
        """This process's cuBLAS and cuDNN attention settings, for a GPU of ``capability``."""
        env = os.environ
        return cls(capability=capability, cublas_workspace_config=env.get("CUBLAS_WORKSPACE_CONFIG"),
                   cublaslt_workspace_size=env.get("CUBLASLT_WORKSPACE_SIZE"),
                   cublaslt_unified=env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"),
                   cudnn_sdpa_deprioritized=env.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"), **kwargs)

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def cublas_workspace_bytes(self) -> int:
        """``parseChosenWorkspaceSize``: ``:SIZE:COUNT`` pairs in KiB, else 32 MiB on sm90, else 8 MiB + 128 KiB."""
        default = 4096 * 8 * 1024 if self.capability == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
        if self.cublas_workspace_config is None:
            return default
        pairs = re.findall(r":([0-9]+):([0-9]+)", self.cublas_workspace_config)
        return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default

    def cublaslt_workspace_bytes(self) -> int:
        """``getCUDABlasLtWorkspaceSize``: $CUBLASLT_WORKSPACE_SIZE KiB (1024), at most the cuBLAS workspace;
        0 when $TORCH_CUBLASLT_UNIFIED_WORKSPACE makes cuBLASLt share the cuBLAS one."""
        if _env_true(self.cublaslt_unified):
            return 0
        kib = 1024
        if self.cublaslt_workspace_size is not None:
            try:
                kib = int(self.cublaslt_workspace_size)
            except ValueError:
                pass
        size = kib * 1024
        if self.cublaslt_unified is None or _env_true(self.cublaslt_unified):
            size = min(size, self.cublas_workspace_bytes())
        return size


def _env_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on", "y")


@dataclass(frozen=True)
class _Params:
    query: Any
    key: Any
    value: Any
    attn_mask: Any
    dropout: float
    is_causal: bool
    enable_gqa: bool
    requires_grad: bool


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


# Each check below is the sdp_utils.cpp filter its comment names: None when it passes, else why not, in words.


def _shapes4(p: _Params) -> str | None:  # check_tensor_shapes
    return None if p.query.dim() == p.key.dim() == p.value.dim() == 4 else "needs 4-D query, key and value"


def _batch_and_heads(p: _Params) -> str | None:  # check_batch_size_and_num_heads_dense<supports_gqa=true>
    q, k, v = p.query, p.key, p.value
    if not q.size(0) == k.size(0) == v.size(0):
        return "needs one batch size for query, key and value"
    hq, hk, hv = q.size(1), k.size(1), v.size(1)
    if p.enable_gqa:  # check_grouped_query_attention
        return None if hk == hv and hq % hk == 0 else f"needs key/value heads ({hk}, {hv}) dividing {hq}"
    return None if hq == hk == hv else f"needs as many key/value heads as query heads ({hk}, {hq}) without enable_gqa"


def _nonzero_lengths(p: _Params) -> str | None:  # check_nonzero_sequence_lengths_dense
    return None if p.query.size(-2) and p.key.size(-2) else "needs nonzero sequence lengths"


def _last_stride_one(p: _Params, *, ignore_singleton: bool) -> str | None:  # check_last_dim_stride_equals_1_dense
    qkv = all(t.stride(-1) == 1 for t in (p.query, p.key, p.value)) or (ignore_singleton and p.query.size(-1) == 1)
    if qkv and (p.attn_mask is None or p.attn_mask.stride(-1) == 1):
        return None
    return "needs the last dimension of its inputs contiguous (stride 1)"


def _dtype(p: _Params, allowed: tuple[torch.dtype, ...]) -> str | None:  # check_tensor_dtype
    if p.query.dtype == p.key.dtype == p.value.dtype and p.query.dtype in allowed:
        return None
    return f"needs {' or '.join(_dtype_name(d) for d in allowed)} (got {_dtype_name(p.query.dtype)})"


def _first(*checks: Callable[[], str | None]) -> str | None:
    """The first refusal of ``checks``, run in order (later ones may assume earlier ones passed)."""
    for check in checks:
        why = check()
        if why is not None:
            return why
    return None


def _sm_range(cc: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> str | None:
    """``check_sm_version<low, high>``: inclusive."""
    return None if low <= cc <= high else f"needs sm{low[0]}{low[1]} to sm{high[0]}{high[1]}"


def _gemm_alignment(p: _Params, cc: tuple[int, int]) -> int:
    """``minimum_gemm_alignment``."""
    half = p.query.dtype in _HALF
    tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and half)
    align = 4 if cc[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


def _flash_head_dims(p: _Params) -> str | None:  # check_head_dim_size_flash
    d = p.query.size(-1)
    if d == p.key.size(-1) == p.value.size(-1) and d <= 256:
        return None
    return f"needs one head dim of at most 256 for query, key and value (got {d}, {p.key.size(-1)}, {p.value.size(-1)})"


def _flash_training(p: _Params, cc: tuple[int, int]) -> str | None:
    """``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``."""
    d = p.query.size(-1)
    sm86_89_120 = (8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)
    if p.requires_grad and sm86_89_120 and not (d <= 192 or (p.dropout == 0.0 and d > 224)):
        return f"cannot train head dim {d} on sm{cc[0]}{cc[1]} (at most 192, or over 224 without dropout)"
    return None


def flash_refusal(p: _Params, cc: tuple[int, int]) -> str | None:
    """``can_use_flash_attention`` (dense inputs, FA3 off): None when flash runs these inputs, else why not."""
    q, k = p.query, p.key
    return _first(
        lambda: None if torch.backends.cuda.flash_sdp_enabled() else "disabled",
        lambda: _shapes4(p),
        lambda: None if p.attn_mask is None else "takes no attn_mask (is_causal is fine)",
        lambda: _flash_head_dims(p), lambda: _sm_range(cc, (8, 0), (12, 1)), lambda: _flash_training(p, cc),
        lambda: None if not p.is_causal or q.size(-2) == k.size(-2) else  # check_flash_causal_non_square_seqlens
        f"takes is_causal only with as many queries as keys ({q.size(-2)}, {k.size(-2)})",
        lambda: _dtype(p, _HALF if cc[0] >= 8 else (torch.float16,)),  # check_dtypes_flash_attention
        lambda: _batch_and_heads(p), lambda: _nonzero_lengths(p),
        lambda: _last_stride_one(p, ignore_singleton=True))


def _efficient_alignment(p: _Params, cc: tuple[int, int]) -> str | None:
    """``check_head_dim_size_mem_efficient`` and ``check_data_ptr_alignment_mem_efficient``."""
    q, v = p.query, p.value
    align = _gemm_alignment(p, cc)
    if not (q.size(-1) == p.key.size(-1) and q.size(-1) % align == 0 and q.size(-1) > 0
            and v.size(-1) % align == 0 and v.size(-1) > 0):
        return f"needs head dims a multiple of {align} (got {q.size(-1)}, {v.size(-1)})"
    size = align * q.element_size()
    if cc[0] >= 8 and any(t.numel() and (t.storage_offset() * t.element_size()) % size for t in (q, p.key, v)):
        return f"needs inputs starting at a multiple of {size} bytes"
    return None


def efficient_refusal(p: _Params, cc: tuple[int, int]) -> str | None:
    """``can_use_mem_efficient_attention`` (dense inputs, CUDA): None when it runs these inputs, else why not."""
    return _first(
        lambda: None if torch.backends.cuda.mem_efficient_sdp_enabled() else "disabled",
        lambda: _sm_range(cc, (5, 0), (12, 1)), lambda: _shapes4(p), lambda: _efficient_alignment(p, cc),
        lambda: _nonzero_lengths(p), lambda: _last_stride_one(p, ignore_singleton=False),
        lambda: _batch_and_heads(p),
        lambda: _dtype(p, (torch.float16, torch.float32, torch.bfloat16) if cc[0] >= 8 else
                       (torch.float16, torch.float32)))


def _cudnn_mask(p: _Params) -> str | None:
    """``check_attn_mask_shape``: 2-D (L or 1, S or 1), or 4-D with batch and heads 1 or the query's."""
    m, q = p.attn_mask, p.query
    if m is None:
        return None
    if m.requires_grad:
        return "takes no attn_mask that requires grad"
    ok = m.dim() in (2, 4) and m.size(-2) in (q.size(2), 1) and m.size(-1) in (p.key.size(2), 1)
    if ok and (m.dim() == 2 or (m.size(0) in (1, q.size(0)) and m.size(1) in (1, q.size(1)))):
        return None
    return f"needs an attn_mask of shape (L, S) or (B, H, L, S), each possibly 1 (got {tuple(m.shape)})"


def _cudnn_d256(cc: tuple[int, int], cudnn_version: int) -> bool:
    """cuDNN's head dims up to 256: sm90 or sm10x (not sm107 before cuDNN 9.25.1), cuDNN newer than 9.22.0."""
    sm90_10x = cc == (9, 0) or cc[0] == 10
    return sm90_10x and not (cc == (10, 7) and cudnn_version <= 92500) and cudnn_version > 92200


def _cudnn_shapes(p: _Params, cc: tuple[int, int], cudnn_version: int) -> str | None:
    """``check_cudnn_tensor_shapes`` (cuDNN 9) and ``check_cudnn_d256_bprop_head_dim``."""
    q, k, v = p.query, p.key, p.value
    if q.size(0) > 65535 or q.size(1) > 65535:
        return "takes at most 65535 sequences and heads"
    d_qk, d_v, s_q, s_k = q.size(3), v.size(3), q.size(2), k.size(2)
    sm90_10x = cc == (9, 0) or cc[0] == 10
    limit = 256 if _cudnn_d256(cc, cudnn_version) else \
        192 if sm90_10x and cudnn_version >= 91100 and (d_qk, d_v) == (192, 128) else 128
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return f"needs head dims a multiple of 8 up to {limit} (got {d_qk}, {d_v})"
    if s_k == 1 or (p.dropout != 0.0 and s_q == 1):
        return "takes no key length 1, nor query length 1 with dropout"
    if p.requires_grad and _cudnn_d256(cc, cudnn_version) and not (
            (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))):
        return f"cannot train head dims {d_qk}, {d_v}"
    return None


def cudnn_refusal(p: _Params, cc: tuple[int, int], cudnn_version: int) -> str | None:
    """``can_use_cudnn_attention`` (dense inputs, cuDNN >= 9): None when it runs these inputs, else why not."""
    return _first(
        lambda: None if cudnn_version >= 90000 else "needs cuDNN 9",
        lambda: "takes no dropout with cuDNN 9.11 to 9.13" if p.dropout > 0.0 and 91100 < cudnn_version < 91400
        else None,
        lambda: None if torch.backends.cuda.cudnn_sdp_enabled() else "disabled",
        lambda: _shapes4(p),
        lambda: "is not deterministic" if torch.are_deterministic_algorithms_enabled() and
        not torch.is_deterministic_algorithms_warn_only_enabled() else None,  # check_cudnn_deterministic
        lambda: _dtype(p, _HALF if cc[0] >= 8 else (torch.float16,)),  # check_dtypes_low_precision
        lambda: _cudnn_mask(p), lambda: _sm_range(cc, (8, 0), (12, 1)),
        lambda: None if p.dropout * 16.0 == math.floor(p.dropout * 16.0) else "takes dropout in steps of 1/16 only",
        lambda: _nonzero_lengths(p), lambda: _last_stride_one(p, ignore_singleton=True),
        lambda: _batch_and_heads(p), lambda: _cudnn_shapes(p, cc, cudnn_version))


def prefers_cudnn(target: CudaTarget) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN first on sm90/sm10x with cuDNN newer than 9.15.0 (on CUDA 12 only
    sm90, sm100 and sm103), unless $TORCH_CUDNN_SDPA_DEPRIORITIZED is set."""
    cc = target.capability
    if _env_true(target.cudnn_sdpa_deprioritized) or target.cudnn_version <= 91500 or cc[0] not in (9, 10):
        return False
    return target.cuda_version >= (13, 0) or cc[1] in (0, 3)


_BACKEND_IDS = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}  # at::SDPBackend
_DEFAULT_ORDER = [FLASH, EFFICIENT, MATH, CUDNN]  # at::Context's sdp_priority_order


def priority_order() -> list[str]:
    """``at::globalContext().sDPPriorityOrder()`` (``sdpa_kernel(..., set_priority=True)`` changes it)."""
    ids = sdp_priority_order() or [1, 2, 0, 3]
    return [_BACKEND_IDS[i] for i in ids if i in _BACKEND_IDS]


@dataclass(frozen=True)
class SdpChoice:
    """The backend ``select_sdp_backend`` picks and, in words, the call and why the ones tried before refused."""

    backend: str
    call: str
    refused: tuple[tuple[str, str], ...] = ()

    def why(self) -> str:
        """E.g. ``bf16, head dim 64, causal`` or ``fp32, head dim 64, causal (flash: needs fp16 or bf16 ...)``."""
        refused = "; ".join(f"{_NAMES[b].split(' ')[0]}: {why}" for b, why in self.refused)
        return f"{self.call} ({refused})" if refused else self.call


def _describe_call(p: _Params) -> str:
    q, k = p.query, p.key
    words = [_dtype_name(q.dtype), f"head dim {q.size(-1)}" if q.dim() else "no head dim"]
    if p.attn_mask is not None:
        words.append(f"{'boolean' if p.attn_mask.dtype == torch.bool else _dtype_name(p.attn_mask.dtype)} mask "
                     f"{tuple(p.attn_mask.shape)}")
    words.append("causal" if p.is_causal else "no mask" if p.attn_mask is None else "")
    if p.dropout:
        words.append(f"dropout {p.dropout:g}")
    if p.enable_gqa and q.dim() == 4 and k.size(1) != q.size(1):
        words.append(f"GQA {q.size(1)} query / {k.size(1)} key heads")
    if not p.requires_grad:
        words.append("no grad")
    return ", ".join(w for w in words if w)


def choose_sdp_backend(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                       is_causal: bool = False, *, enable_gqa: bool = False,
                       target: CudaTarget = CudaTarget()) -> SdpChoice:
    """``select_sdp_backend``: the first backend in priority order whose checks pass, and why."""
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    p = _Params(query, key, value, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa), requires_grad)
    cc = target.capability
    order = priority_order()
    if order == _DEFAULT_ORDER and prefers_cudnn(target):
        order = [CUDNN, FLASH, EFFICIENT, MATH]
    refusals = {FLASH: lambda: flash_refusal(p, cc), EFFICIENT: lambda: efficient_refusal(p, cc),
                CUDNN: lambda: cudnn_refusal(p, cc, target.cudnn_version),
                MATH: lambda: None if torch.backends.cuda.math_sdp_enabled() else "disabled"}
    refused: list[tuple[str, str]] = []
    for backend in order:
        why = refusals[backend]()
        if why is None:
            return SdpChoice(backend, _describe_call(p), tuple(refused))
        refused.append((backend, why))
    whys = "; ".join(f"{_NAMES[b]} {why}" for b, why in refused)
    raise RuntimeError(f"No available kernel for scaled_dot_product_attention on {target.sm}: {whys}")


def select_sdp_backend(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                       is_causal: bool = False, *, enable_gqa: bool = False,
                       target: CudaTarget = CudaTarget()) -> str:
    """The backend :func:`choose_sdp_backend` picks."""
    return choose_sdp_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa,
                              target=target).backend


# ----------------------------------------------------------------------------------- ops


def _bytes(*shape: int, itemsize: int = 4) -> int:
    return math.prod(shape) * itemsize


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def _flash_backward_scratch(args: tuple, kwargs: dict, out: Any) -> list[int]:
    """``mha_bwd``: ``softmax_d`` (B, H, Sq rounded to 128) and ``dq_accum`` (B, Sq_128, H, D rounded to 32),
    float32; for GQA, dK and dV expanded to every query head."""
    q, k = args[1], args[2]
    b, h, s_q, d = q.shape
    s_k, h_k = k.size(2), k.size(1)
    sizes = [_bytes(b, h, _round(s_q, 128)), _bytes(b, _round(s_q, 128), h, _round(d, 32))]
    if h_k != h:
        sizes += [_bytes(b, s_k, h, d, itemsize=q.element_size())] * 2
    return sizes


def _efficient_backward_scratch(args: tuple, kwargs: dict, out: Any) -> list[int]:
    """``_efficient_attention_backward``: ``delta`` (B, H, Sq) float32 and the gradient accumulator
    workspace, taken as a float32 dQ (a bound: the kernel's ``workspace_size`` is decided on the GPU)."""
    q = args[1]
    b, h, s_q, d = q.shape
    return [_bytes(b, h, s_q), _bytes(b, s_q, h, d)]


def _embedding_backward_scratch(args: tuple, kwargs: dict, out: Any) -> list[int]:
    """``embedding_backward_cuda_kernel``: sorted and original indices, segment offsets and partial-segment
    bookkeeping (int64), and per-segment partial sums (float32), bounded by one segment per index."""
    grad, indices = args[0], args[1]
    n = indices.numel()
    dim = grad.size(-1) if grad.dim() else 1
    return [8 * n] * 6 + [_bytes(n, dim)]


_SCRATCH: dict[Any, Callable[[tuple, dict, Any], list[int]]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_scratch,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_scratch,
    torch.ops.aten.embedding_dense_backward.default: _embedding_backward_scratch,
}
_aten = torch.ops.aten
_GEMMS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.addbmm.default,
          _aten.addmv.default, _aten.mv.default, _aten.dot.default, _aten.vdot.default,
          _aten._addmm_activation.default}
_LT = {_aten.addmm.default, _aten._addmm_activation.default}  # with a 1-D bias: cuBLASLt's bias epilogue
_CONVS = {_aten.convolution.default, _aten.convolution_backward.default}


class CudaKernelChoices:
    """While active, ``scaled_dot_product_attention`` on ``meta`` tensors runs the backend CUDA would
    choose, and the tracker's trace gets the memory CUDA's kernels take through the caching allocator.

    ``tracker`` is the estimate's :class:`~autotune.devices.tracker.LiveStorageTracker` (it must record
    a trace); ``notes`` collects what was bounded or assumed, in words. ``key``: the autograd dispatch
    key of the tensors the estimate runs on (``AutogradCPU`` for FakeTensorMode's CPU-faked tensors).
    """

    def __init__(self, tracker: Any, target: CudaTarget, *, attention: bool = True, key: str = "AutogradMeta"):
        self.tracker = tracker
        self.target = target
        self.attention = attention
        self.key = key
        self.notes: dict[str, None] = {}
        self.backends: dict[str, int] = {}
        self.choices: dict[tuple[str, str], int] = {}  # (backend, why) -> calls
        self._workspaces: dict[tuple[str, str, int], int] = {}
        self._conv_scale = 0
        self._kernels = contextlib.ExitStack()

    def __enter__(self) -> CudaKernelChoices:
        if self.attention:
            library = self._kernels.enter_context(attention_kernels(self._attention, self.key))
            register_kernel(library, "dropout", _dropout, self.key)
        self.tracker.after_op = self.after_op
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracker.after_op = None
        self._kernels.close()
        for kind in ("cuBLAS", "cuBLASLt"):
            sizes = [n for (k, _, _), n in self._workspaces.items() if k == kind and n]
            if sizes:
                self.notes[f"{kind} workspaces held: {len(sizes)} x {sizes[0] / MiB:.3g} MiB (one per handle and "
                           "stream: the forward's thread and autograd's backward thread each have a handle)"] = None
        for (backend, why), calls in self.choices.items():
            self.notes[f"scaled_dot_product_attention as CUDA runs it: {_NAMES[backend]} on {self.target.sm}: {why} "
                       f"({calls} calls)"] = None
        if self._conv_scale:
            self.notes[f"cuDNN convolution workspaces counted as 0 bytes: cuDNN chooses the algorithm on the GPU "
                       f"and takes one needing less workspace when memory is short; a workspace as large as the "
                       f"largest convolution operand here ({self._conv_scale / MiB:.1f} MiB) would raise the "
                       "reserved peak by that much"] = None

    # -- the memory CUDA's kernels allocate that no tensor shows ---------------------

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Called by the tracker after it counted ``func``'s outputs."""
        if func in _GEMMS:
            self._cublas_workspaces(func, args)
        elif func in _CONVS:
            shapes = [t for t in (*args[:2], *(out if isinstance(out, (tuple, list)) else (out,)))
                      if isinstance(t, torch.Tensor)]
            self._conv_scale = max(self._conv_scale, *(t.numel() * t.element_size() for t in shapes))
        scratch = _SCRATCH.get(func)
        if scratch is not None:
            self.tracker.scratch(scratch(args, kwargs, out))

    def _cublas_workspaces(self, func: Any, args: tuple) -> None:
        # One handle per thread: the forward's (this thread) and the backward's (autograd's device thread).
        handle = "backward" if current_autograd_node() is not None else "forward"
        stream = self.tracker.stream
        if ("cuBLAS", handle, stream) not in self._workspaces:
            size = self._workspaces["cuBLAS", handle, stream] = self.target.cublas_workspace_bytes()
            self.tracker.device_alloc(size, "cuBLAS workspace")
        bias = args[0] if args else None
        if func in _LT and isinstance(bias, torch.Tensor) and bias.dim() == 1 and \
                bias.dtype in (torch.float32, *_HALF) and ("cuBLASLt", handle, stream) not in self._workspaces:
            size = self._workspaces["cuBLASLt", handle, stream] = self.target.cublaslt_workspace_bytes()
            if size:
                self.tracker.device_alloc(size, "cuBLASLt workspace")

    # -- attention -----------------------------------------------------------------------

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False) -> torch.Tensor:
        choice = choose_sdp_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa,
                                    target=self.target)
        backend = choice.backend
        self.backends[backend] = self.backends.get(backend, 0) + 1
        self.choices[backend, choice.why()] = self.choices.get((backend, choice.why()), 0) + 1
        if backend == MATH:
            return _SDPA.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                   enable_gqa=enable_gqa)
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if backend == FLASH:
            return self._flash(query, key, value, dropout_p, is_causal, scale)
        if backend == EFFICIENT:
            if enable_gqa and key.size(1) != query.size(1):
                repeat = query.size(1) // key.size(1)
                key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
            mask = _efficient_mask(attn_mask, query) if attn_mask is not None else None
            return self._kept(2, torch.ops.aten._scaled_dot_product_efficient_attention.default,
                              query, key, value, mask, requires_grad, dropout_p, is_causal, scale=scale)
        self.notes["cuDNN attention's workspace counted as 0 bytes (cuDNN sizes it on the GPU)"] = None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = _additive(attn_mask, query.dtype)
        return self._kept(2, torch.ops.aten._scaled_dot_product_cudnn_attention.default, query, key, value,
                          attn_mask, requires_grad, dropout_p, is_causal, False, scale=scale)

    def _flash(self, query, key, value, dropout_p, is_causal, scale) -> torch.Tensor:
        head = query.size(-1)
        scale = scale if scale is not None else 1.0 / math.sqrt(head)
        if head % 8:  # pad_last_dim<8>: padded copies go to the kernel and are kept for backward
            pad = 8 - head % 8
            query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
        out = self._kept(2, torch.ops.aten._scaled_dot_product_flash_attention.default, query, key, value,
                         dropout_p, is_causal, False, scale=scale)
        return out[..., :head] if head % 8 else out

    def _kept(self, kept: int, op: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run a fused attention op; of its outputs only the first ``kept`` (output and logsumexp) are device
        memory (the philox seed and offset live on the host outside graph capture)."""
        with self.tracker.paused():
            outs = op(*args, **kwargs)
        self.tracker.register(t for t in outs[:kept] if isinstance(t, torch.Tensor))
        return outs[0]


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``dropout`` as on CUDA, where ``is_fused_kernel_acceptable`` holds: ``native_dropout``, which keeps a
    boolean mask for backward (the composite elsewhere keeps a scaled noise tensor of the input's dtype)."""
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    if p == 0.0 or not train or input.numel() == 0:
        return input.view_as(input)  # the composite returns its input: a view shares its storage as that does
    return torch.ops.aten.dropout.default.decompose(input, p, train)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``convert_boolean_attn_mask``: 0 where attended, -inf elsewhere."""
    return torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device))


def _efficient_mask(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` for memory-efficient attention: additive, its rows aligned to 16 elements (a padded
    copy otherwise), broadcast to (B, H, Sq, Sk)."""
    if mask.dtype == torch.bool:
        mask = _additive(mask, query.dtype)
    last = mask.size(-1)
    if any(s % 16 for s, n in zip(mask.stride()[:-1], mask.shape[:-1]) if n > 1):
        padded = torch.nn.functional.pad(mask, (0, _round(last, 16) - last))
        mask = padded[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), mask.size(-1))
