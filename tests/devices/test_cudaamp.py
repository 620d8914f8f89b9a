"""CUDA's autocast policy on an estimate's meta tensors: the op lists, each policy, the weight cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autotune import compat
from autotune.devices.cudaamp import (
    BANNED,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER,
    OPTIONAL_OPS,
    PROMOTE,
    policies,
)
from autotune.devices.cudastandin import GpuAnswers, StandIn

BF16 = torch.bfloat16


@pytest.fixture
def stand_in():
    answers = GpuAnswers(name="NVIDIA A10G", capability=(8, 6), total_bytes=24 << 30, free_bytes=20 << 30)
    standing = StandIn(torch.device("meta"), answers)
    with standing.installed():
        yield standing
    assert not compat.autocast_cuda_included() and not torch.is_autocast_enabled("cuda")


def test_the_lists_are_the_ops_torch_registers_for_cudas_autocast():
    assert compat.autocast_cuda_ops() <= set(policies())  # every op torch autocasts on CUDA has its policy here
    if compat.TORCH >= (2, 13):  # the lists as of torch 2.13 (an older torch autocasts fewer: those alone)
        assert set(policies()) - set(OPTIONAL_OPS) == compat.autocast_cuda_ops() - set(OPTIONAL_OPS)
    table = policies()
    assert {table[op] for op in ("linear.default", "matmul.default", "bmm.default", "baddbmm.default",
                                 "addmm.default", "conv2d.default", "scaled_dot_product_attention.default")} == {LOWER}
    assert {table[op] for op in ("layer_norm.default", "nll_loss.default", "exp.default", "mse_loss.default",
                                 "group_norm.default")} == {FP32}
    assert {table[op] for op in ("softmax.int", "log_softmax.int", "sum.default", "cumsum.default")} == \
        {FP32_SET_OPT_DTYPE}
    assert table["norm.Scalar"] == FP32_APPEND_DTYPE
    assert {table[op] for op in ("addcmul.default", "index_put.default", "scatter_add.default")} == {PROMOTE}
    assert table["binary_cross_entropy.default"] == BANNED


def test_each_policy_gives_cudas_dtypes(stand_in):
    layer = nn.Linear(8, 4).cuda()
    x = torch.randn(2, 8, device="cuda")
    target = torch.zeros(2, dtype=torch.long, device="cuda")
    with torch.autocast("cuda", dtype=BF16):
        y = layer(x)
        assert (y.dtype, (y @ y.T).dtype, torch.bmm(y[None], y.T[None]).dtype) == (BF16, BF16, BF16)
        assert torch.softmax(y, -1).dtype == torch.float32  # dtype=float32 set
        assert torch.softmax(y, -1, dtype=BF16).dtype == BF16  # unless given
        assert F.cross_entropy(y, target).dtype == torch.float32  # log_softmax and nll_loss in fp32
        assert (F.layer_norm(y, (4,)).dtype, y.exp().dtype, y.sum().dtype) == (torch.float32,) * 3
        assert y.norm().dtype == torch.float32  # norm.Scalar runs as norm with dtype=float32
        assert torch.addcmul(y.float(), y, y).dtype == torch.float32  # promote: the widest
        assert torch.addcmul(y, y, y).dtype == BF16
        assert (y + 1).dtype == BF16 and torch.relu(y).dtype == BF16  # not listed: as they come
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32  # host tensors: not CUDA's
        with torch.autocast("cuda", enabled=False):
            assert layer(x).dtype == torch.float32
        assert layer(x).dtype == BF16
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(y.float()), torch.rand(2, 4, device="cuda"))
    with pytest.warns(FutureWarning, match="deprecated"):
        old_spelling = torch.cuda.amp.autocast()
    with old_spelling:  # float16 by default, as on CUDA
        assert layer(x).dtype == torch.float16
    with torch.amp.autocast("cuda", dtype=BF16):
        out = layer(x)
    assert layer(x).dtype == torch.float32  # outside: as it was
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32  # the casts are recorded: fp32 gradients
    assert stand_in.amp.counts[LOWER] > 0 and BF16 in stand_in.amp.dtypes


def test_a_parameter_is_cast_once_per_autocast_region(stand_in):
    layer = nn.Linear(8, 4).cuda()
    x = torch.randn(2, 8, device="cuda")

    def weight_cast(out: torch.Tensor) -> object:
        addmm = out.grad_fn
        transposed = next(n for n, _ in addmm.next_functions if type(n).__name__ == "TBackward0")
        return transposed.next_functions[0][0]  # the ToCopyBackward0 of the weight's bf16 copy

    with torch.autocast("cuda", dtype=BF16):
        first, second = layer(x), layer(x)
    with torch.autocast("cuda", dtype=BF16):
        third = layer(x)
    assert type(weight_cast(first)).__name__ == "ToCopyBackward0"
    assert weight_cast(first) is weight_cast(second)  # one copy in the region, its memory counted once
    assert weight_cast(third) is not weight_cast(first)  # the cache is dropped when the region ends
    with torch.autocast("cuda", dtype=BF16, cache_enabled=False):
        assert weight_cast(layer(x)) is not weight_cast(layer(x))
