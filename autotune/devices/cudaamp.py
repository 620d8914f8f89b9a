"""``torch.autocast("cuda")`` on an estimate's ``meta`` tensors: CUDA's cast policy, op by op.

On a GPU, autocast is a dispatch key (``AutocastCUDA``) that CUDA tensors carry and ``meta`` tensors do not; its
kernels (``aten/src/ATen/autocast_mode.cpp``, the op lists of ``autocast_mode.h``) cast an op's inputs and
run the op with the key excluded, above autograd, so that the casts are recorded and the lower-precision
inputs are what backward keeps. While an estimate stands in for a CUDA GPU, the session adds that key to
every dispatch of its thread, and :func:`register` puts a kernel of this module's under it for each op of
the lists below: so ``torch.autocast("cuda", ...)``, ``torch.amp.autocast("cuda")`` and
``torch.cuda.amp.autocast`` act on ``meta`` tensors exactly where, and as, they act on CUDA tensors, nested
regions and ``enabled=False`` included (torch's own state decides, through the key).

The policies (``CastPolicy``):

- ``lower``: every floating input (not float64) to the autocast dtype;
- ``fp32``: every floating input to float32;
- ``fp32_set_opt_dtype``: ``dtype=float32`` unless given, when the first input is floating;
- ``fp32_append_dtype``: ``norm`` without a dtype runs as its overload with one (float32);
- ``promote``: the widest floating input type (float32 over the autocast dtype);
- ``banned``: ``binary_cross_entropy`` refuses, as on CUDA.

The weight cache: a float32 leaf that requires grad (a parameter) is cast once per autocast region (until
the outermost region exits, ``torch.clear_autocast_cache()``), and the cast copy stays alive meanwhile.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..compat import AUTOCAST_CUDA, autocast_cuda_ops, op_schema, register_kernel, without_autocast_cuda

LOWER, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE, BANNED = (
    "lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")
#: Ops that some torch builds autocast on CUDA and others do not: cuDNN's fused RNN (CUDA builds; in the lower
#: precision, as the RNN cells are), the named-dimension overloads (torch 2.11's CUDA builds; as their positional
#: overloads), the Hermitian matrix square root (torch 2.14; fp32, as the other matrix functions are).
OPTIONAL_OPS = {"_cudnn_rnn.default": LOWER, "linalg_matrix_sqrth.default": FP32,
                "cumprod.dimname": FP32_SET_OPT_DTYPE, "cumsum.dimname": FP32_SET_OPT_DTYPE,
                "log_softmax.Dimname": FP32_SET_OPT_DTYPE, "softmax.Dimname": FP32_SET_OPT_DTYPE,
                "prod.dim_Dimname": FP32_SET_OPT_DTYPE, "sum.dim_DimnameList": FP32_SET_OPT_DTYPE,
                "norm.names_ScalarOpt_dim": FP32_APPEND_DTYPE}

#: ``AT_FORALL_LOWER_PRECISION_FP`` and the CUDA-only convolutions (``name.overload``; ``default`` for none).
LOWER_OPS = (
    "_convolution.deprecated", "_convolution.default", "conv1d.default", "conv2d.default", "conv3d.default",
    "conv_tbc.default", "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution.default", "prelu.default", "addmm.default", "addmv.default", "addr.default", "matmul.default",
    "einsum.default", "mm.default", "mv.default", "linalg_vecdot.default", "linear.default", "addbmm.default",
    "baddbmm.default", "bmm.default", "chain_matmul.default", "linalg_multi_dot.default",
    "_thnn_fused_lstm_cell.default", "_thnn_fused_gru_cell.default", "lstm_cell.default", "gru_cell.default",
    "rnn_tanh_cell.default", "rnn_relu_cell.default", "_scaled_dot_product_flash_attention.default",
    "scaled_dot_product_attention.default", "cudnn_convolution.default", "cudnn_convolution_transpose.default",
)
#: ``AT_FORALL_FP32``.
FP32_OPS = (
    "acos.default", "asin.default", "cosh.default", "erfinv.default", "exp.default", "expm1.default",
    "log.default", "log10.default", "log2.default", "log1p.default", "reciprocal.default", "rsqrt.default",
    "sinh.default", "tan.default", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus.default",
    "layer_norm.default", "native_layer_norm.default", "group_norm.default", "rms_norm.default",
    "frobenius_norm.dim", "nuclear_norm.default", "nuclear_norm.dim", "cosine_similarity.default",
    "poisson_nll_loss.default", "cosine_embedding_loss.default", "nll_loss.default", "nll_loss2d.default",
    "hinge_embedding_loss.default", "kl_div.default", "l1_loss.default", "smooth_l1_loss.default",
    "huber_loss.default", "mse_loss.default", "margin_ranking_loss.default", "multilabel_margin_loss.default",
    "soft_margin_loss.default", "triplet_margin_loss.default", "multi_margin_loss.default",
    "binary_cross_entropy_with_logits.default", "dist.default", "pdist.default", "cdist.default",
    "renorm.default", "logsumexp.default", "upsample_nearest1d.default", "_upsample_nearest_exact1d.default",
    "upsample_nearest2d.default", "_upsample_nearest_exact2d.default", "upsample_nearest3d.default",
    "_upsample_nearest_exact3d.default", "upsample_linear1d.default", "upsample_bilinear2d.default",
    "_upsample_bilinear2d_aa.default", "upsample_trilinear3d.default", "upsample_bicubic2d.default",
    "_upsample_bicubic2d_aa.default",
)
#: ``AT_FORALL_FP32_SET_OPT_DTYPE`` (the overloads the installed torch registers).
FP32_SET_OPT_DTYPE_OPS = (
    "prod.default", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod.default", "cumsum.default",
    "linalg_vector_norm.default", "linalg_matrix_norm.default", "linalg_matrix_norm.str_ord", "sum.default",
    "sum.dim_IntList",
)
#: ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``: the overload without a dtype -> the one it runs as.
FP32_APPEND_DTYPE_OPS = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
                         "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}
#: ``AT_FORALL_PROMOTE``.
PROMOTE_OPS = (
    "addcdiv.default", "addcmul.default", "atan2.default", "bilinear.default", "cross.default", "dot.default",
    "vdot.default", "grid_sampler.default", "index_put.default", "tensordot.default", "scatter_add.default",
)
BANNED_OPS = ("binary_cross_entropy.default",)


def policies() -> dict[str, str]:
    """Every op of CUDA's autocast (``name.overload``) and its policy."""
    table = {op: LOWER for op in LOWER_OPS}
    table.update({op: FP32 for op in FP32_OPS})
    table.update({op: FP32_SET_OPT_DTYPE for op in FP32_SET_OPT_DTYPE_OPS})
    table.update({op: FP32_APPEND_DTYPE for op in FP32_APPEND_DTYPE_OPS})
    table.update({op: PROMOTE for op in PROMOTE_OPS})
    table.update({op: BANNED for op in BANNED_OPS})
    table.update(OPTIONAL_OPS)  # a kernel is registered only for the ops the installed torch autocasts
    return table


@functools.cache
def _autocast_ops() -> frozenset[str]:
    return autocast_cuda_ops()


def _overload(name: str) -> Any:
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _eligible(x: Any, device: str) -> bool:
    """``is_eligible``: a floating tensor, not float64, on the device stood in for (CUDA's autocast casts CUDA
    tensors alone)."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 and \
        x.device.type == device


class CudaAutocast:
    """CUDA's autocast policy for the ops of an estimate's thread, whose tensors on ``device`` (the estimate's)
    stand in for CUDA's, with its weight cache; ``counts``: the ops run under it, by policy."""

    def __init__(self, device: str = "meta") -> None:
        self.device = device
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.counts: dict[str, int] = {}
        self.dtypes: set[torch.dtype] = set()

    def clear_cache(self) -> None:
        self._cache.clear()

    def register(self, library: torch.library.Library) -> int:
        """Register a kernel under CUDA's autocast key for every op of the lists that the installed torch
        autocasts on CUDA (the lists grow from release to release); how many."""
        done = 0
        autocast = _autocast_ops()
        for name, policy in policies().items():
            if name not in autocast:
                continue
            packet, overload = name.split(".")
            register_kernel(library, name if overload != "default" else packet, self._kernel(name, policy),
                            AUTOCAST_CUDA)
            done += 1
        return done

    def _cast(self, to: torch.dtype, x: Any) -> Any:
        """``cached_cast``: tensors (also in lists) cast to ``to``; parameters cast to the autocast dtype once per
        region."""
        if isinstance(x, (list, tuple)):
            return type(x)(self._cast(to, v) for v in x)
        if not _eligible(x, self.device) or x.dtype == to:
            return x
        cacheable = (to == torch.get_autocast_dtype("cuda") and x.dtype == torch.float32 and x.requires_grad
                     and x.is_leaf and not x._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return x.to(to)
        hit = self._cache.get(id(x))
        if hit is not None and hit[0]() is x:
            return hit[1]
        cast = x.to(to)
        self._cache[id(x)] = (weakref.ref(x), cast)
        return cast

    def _kernel(self, name: str, policy: str) -> Callable[..., Any]:
        op = _overload(name)
        run = {LOWER: self._lower, FP32: self._fp32, FP32_SET_OPT_DTYPE: self._set_opt_dtype,
               PROMOTE: self._promote, FP32_APPEND_DTYPE: self._append_dtype, BANNED: _banned}[policy]
        target = _overload(FP32_APPEND_DTYPE_OPS[name]) if policy == FP32_APPEND_DTYPE else op

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with without_autocast_cuda():
                self.counts[policy] = self.counts.get(policy, 0) + 1
                return run(target, args, kwargs)

        return kernel

    def _lower(self, op: Any, args: tuple, kwargs: dict) -> Any:
        to = torch.get_autocast_dtype("cuda")
        self.dtypes.add(to)
        return op(*self._cast(to, args), **{k: self._cast(to, v) for k, v in kwargs.items()})

    def _fp32(self, op: Any, args: tuple, kwargs: dict) -> Any:
        return op(*self._cast(torch.float32, args), **{k: self._cast(torch.float32, v) for k, v in kwargs.items()})

    def _set_opt_dtype(self, op: Any, args: tuple, kwargs: dict) -> Any:
        if not _eligible(args[0], self.device):
            return op(*args, **kwargs)
        position = [a.name for a in op_schema(op).arguments].index("dtype")
        if position < len(args):
            if args[position] is None:
                args = (*args[:position], torch.float32, *args[position + 1:])
        elif kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": torch.float32}
        return op(*args, **kwargs)

    def _append_dtype(self, op: Any, args: tuple, kwargs: dict) -> Any:
        dtype = torch.float32 if _eligible(args[0], self.device) else args[0].dtype
        return op(*args, **kwargs, dtype=dtype)

    def _promote(self, op: Any, args: tuple, kwargs: dict) -> Any:
        to = torch.get_autocast_dtype("cuda")
        for x in _tensors((args, kwargs)):
            if _eligible(x, self.device) and x.dtype == torch.float32:
                to = torch.float32
        return op(*self._cast(to, args), **{k: self._cast(to, v) for k, v in kwargs.items()})


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _banned(op: Any, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
                       "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
                       "In this case, combine the two layers using "
                       "torch.nn.functional.binary_cross_entropy_with_logits\n"
                       "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
                       "safe to autocast.")
