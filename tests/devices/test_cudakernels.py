"""CUDA's kernel choices on meta tensors: attention backends, what they keep, the cuBLAS workspaces.

Every expected backend and size below is worked out from the PyTorch source
the function names in ``autotune/devices/cudakernels.py`` (sdp_utils.cpp,
attention.cpp, flash_api.cpp, CublasHandlePool.cpp); each row says the rule.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from autotune.devices.cudakernels import (
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    CudaKernelChoices,
    CudaTarget,
    choose_sdp_backend,
    select_sdp_backend,
)
from autotune.devices.meta import MetaKernels
from autotune.devices.tracker import LiveStorageTracker

MiB = 2**20
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def qkv(b=2, h=4, sq=128, d=64, dtype=F16, sk=None, dv=None, grad=True, hk=None):
    q = torch.empty(b, h, sq, d, dtype=dtype, device="meta", requires_grad=grad)
    k = torch.empty(b, hk or h, sk or sq, d, dtype=dtype, device="meta", requires_grad=grad)
    v = torch.empty(b, hk or h, sk or sq, dv or d, dtype=dtype, device="meta", requires_grad=grad)
    return q, k, v


SM = {"sm60": (6, 0), "sm75": (7, 5), "sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0),
      "sm100": (10, 0), "sm107": (10, 7)}
OLD_CUDNN, NEW_CUDNN = 91002, 91600  # 9.10.2 (CUDA 12 wheels), 9.16.0 (newer than 9.15.0)

# (why, capability, tensors, sdpa arguments, cuDNN version, expected backend)
SELECTION = [
    ("flash first in the default order (priority_order)", "sm80", {}, {}, OLD_CUDNN, FLASH),
    ("flash takes half/bf16 only: fp32 goes to memory-efficient (check_dtypes_flash_attention)", "sm80",
     {"dtype": F32}, {}, OLD_CUDNN, EFFICIENT),
    ("flash needs sm80..sm121 (check_flash_attention_hardware_support)", "sm75", {}, {}, OLD_CUDNN, EFFICIENT),
    ("flash takes no mask (check_for_attn_mask)", "sm80", {}, {"mask": True}, OLD_CUDNN, EFFICIENT),
    ("head dim up to 256 for flash (check_head_dim_size_flash)", "sm80", {"d": 256}, {}, OLD_CUDNN, FLASH),
    ("head dim over 256: memory-efficient, a multiple of 8 (check_head_dim_size_mem_efficient)", "sm80",
     {"d": 264}, {}, OLD_CUDNN, EFFICIENT),
    ("training with head dim in (192, 224] on sm86 (check_requires_grad_and_head_dim_gt192...)", "sm86",
     {"d": 200}, {}, OLD_CUDNN, EFFICIENT),
    ("... but inference there takes flash", "sm86", {"d": 200, "grad": False}, {}, OLD_CUDNN, FLASH),
    ("fp32 head dim 18: not a multiple of 4 (minimum_gemm_alignment), so math", "sm80",
     {"dtype": F32, "d": 18}, {}, OLD_CUDNN, MATH),
    ("causal with seqlen_q != seqlen_k: no flash (check_flash_causal_non_square_seqlens)", "sm80",
     {"sk": 256}, {"is_causal": True}, OLD_CUDNN, EFFICIENT),
    ("memory-efficient runs from sm50 (check_mem_efficient_hardware_support)", "sm60", {"dtype": F32}, {},
     OLD_CUDNN, EFFICIENT),
    ("bf16 is memory-efficient's only from sm80", "sm60", {"dtype": BF16}, {}, OLD_CUDNN, MATH),
    ("cuDNN first on sm90 with cuDNN newer than 9.15.0 (check_prefer_cudnn_attention)", "sm90", {"dtype": BF16},
     {}, NEW_CUDNN, CUDNN),
    ("... on sm100 too", "sm100", {}, {}, NEW_CUDNN, CUDNN),
    ("... not with an older cuDNN", "sm90", {}, {}, OLD_CUDNN, FLASH),
    ("... not on sm80", "sm80", {}, {}, NEW_CUDNN, FLASH),
    ("cuDNN dropout in steps of 1/16 only (check_cudnn_dropout)", "sm90", {}, {"dropout_p": 0.1}, NEW_CUDNN,
     FLASH),
    ("cuDNN head dim a multiple of 8 (check_cudnn_tensor_shapes)", "sm90", {"d": 60}, {}, NEW_CUDNN, FLASH),
    ("GQA: flash takes fewer key heads (check_batch_size_and_num_heads_dense)", "sm80", {"hk": 2},
     {"enable_gqa": True}, OLD_CUDNN, FLASH),
    ("GQA without enable_gqa: the fused kernels refuse, math", "sm80", {"hk": 2}, {}, OLD_CUDNN, MATH),
    ("bf16 head dim 64 causal on sm86 (an A10G): flash", "sm86", {"dtype": BF16}, {"is_causal": True}, OLD_CUDNN,
     FLASH),
    ("fp32 on sm86: memory-efficient", "sm86", {"dtype": F32}, {"is_causal": True}, OLD_CUDNN, EFFICIENT),
    ("training head dim 256 with dropout on sm89: not flash (over 224 only without dropout)", "sm89", {"d": 256},
     {"dropout_p": 0.1}, OLD_CUDNN, EFFICIENT),
    ("... without dropout flash trains it", "sm89", {"d": 256}, {}, OLD_CUDNN, FLASH),
    ("cuDNN takes a 2-D (L, S) mask (check_attn_mask_shape)", "sm90", {}, {"mask": (128, 128)}, NEW_CUDNN, CUDNN),
    ("... and a 4-D (B, 1, L, S) one", "sm90", {}, {"mask": (2, 1, 128, 128)}, NEW_CUDNN, CUDNN),
    ("... and (1, S), broadcast over queries", "sm90", {}, {"mask": (1, 128)}, NEW_CUDNN, CUDNN),
    ("... but no 3-D mask: memory-efficient then (flash takes no mask)", "sm90", {}, {"mask": (2, 128, 128)},
     NEW_CUDNN, EFFICIENT),
    ("... nor a 4-D one with a batch it cannot broadcast", "sm90", {}, {"mask": (3, 1, 128, 128)}, NEW_CUDNN,
     EFFICIENT),
    ("cuDNN head dims up to 256 on sm90 with cuDNN newer than 9.22 (check_cudnn_tensor_shapes)", "sm90",
     {"d": 256}, {}, 92300, CUDNN),
    ("... not on sm107 with cuDNN 9.25.0 or older: 128 there", "sm107", {"d": 256}, {}, 92300, FLASH),
    ("cuDNN trains head dims 160 only up to 128 or as 192/128 or 256/256 (check_cudnn_d256_bprop_head_dim)",
     "sm90", {"d": 160}, {}, 92300, FLASH),
    ("... inference takes it", "sm90", {"d": 160, "grad": False}, {}, 92300, CUDNN),
    ("cuDNN takes no dropout with cuDNN 9.11 to 9.13", "sm90", {}, {"dropout_p": 0.125}, 91200, FLASH),
]


def choose(capability, tensors, args, cudnn, **target):
    q, k, v = qkv(**tensors)
    mask = args.pop("mask", None)
    shape = (q.size(2), k.size(2)) if mask is True else mask
    mask = torch.empty(shape, dtype=torch.bool, device="meta") if shape else None
    target = CudaTarget(capability=SM[capability], cudnn_version=cudnn, cuda_version=(12, 8), **target)
    return select_sdp_backend(q, k, v, mask, target=target, **args)


@pytest.mark.parametrize(("why", "capability", "tensors", "args", "cudnn", "expected"), SELECTION,
                         ids=[row[0][:60] for row in SELECTION])
def test_sdpa_backend_selection_as_sdp_utils_cpp(why, capability, tensors, args, cudnn, expected):
    assert choose(capability, tensors, dict(args), cudnn) == expected


@pytest.mark.parametrize(("enabled", "expected"), [
    ([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], EFFICIENT),
    ([SDPBackend.MATH], MATH),
    ([SDPBackend.FLASH_ATTENTION], FLASH),
])
def test_sdpa_kernel_switches_are_read(enabled, expected):
    with sdpa_kernel(enabled):
        assert choose("sm80", {}, {}, OLD_CUDNN) == expected


def test_a_priority_order_set_by_the_user_is_followed():
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert choose("sm80", {}, {}, OLD_CUDNN) == MATH
        assert choose("sm90", {}, {}, NEW_CUDNN) == MATH  # no cuDNN preference over an order the user set
    assert choose("sm80", {}, {}, OLD_CUDNN) == FLASH


def test_no_backend_left_is_an_error():
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="No available kernel"):
        choose("sm75", {}, {}, OLD_CUDNN)  # flash is the only one enabled and sm75 cannot run it


def test_a_planted_fault_in_the_selection_is_caught(monkeypatch):
    from autotune.devices import cudakernels

    flash = cudakernels.flash_refusal
    monkeypatch.setattr(cudakernels, "flash_refusal", lambda p, cc: flash(p, (9, 0)))  # flash on every GPU
    wrong = [why for why, cap, t, a, c, e in SELECTION if choose(cap, t, dict(a), c) != e]
    assert "flash needs sm80..sm121 (check_flash_attention_hardware_support)" in wrong
    assert "training head dim 256 with dropout on sm89: not flash (over 224 only without dropout)" in wrong


def test_cudnn_first_unless_deprioritized_and_deterministic_only_when_warn_only():
    assert choose("sm90", {}, {}, NEW_CUDNN, cudnn_sdpa_deprioritized="1") == FLASH  # $TORCH_CUDNN_SDPA_DEPRIORITIZED
    assert choose("sm90", {}, {}, NEW_CUDNN, cudnn_sdpa_deprioritized="0") == CUDNN
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert choose("sm90", {}, {}, NEW_CUDNN) == CUDNN  # check_cudnn_deterministic: warn-only lets it run
        torch.use_deterministic_algorithms(True)
        assert choose("sm90", {}, {}, NEW_CUDNN) == FLASH
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(("capability", "tensors", "args", "expected"), [
    ("sm86", {"dtype": BF16}, {"is_causal": True}, "flash: bf16, head dim 64, causal"),
    ("sm86", {"dtype": F32}, {"is_causal": True, "dropout_p": 0.1},
     "efficient: fp32, head dim 64, causal, dropout 0.1 (flash: needs fp16 or bf16 (got fp32))"),
    ("sm75", {}, {"mask": True}, "efficient: fp16, head dim 64, boolean mask (128, 128) "
                                 "(flash: takes no attn_mask (is_causal is fine))"),
    ("sm86", {"d": 200}, {}, "efficient: fp16, head dim 200, no mask (flash: cannot train head dim 200 on sm86 "
                             "(at most 192, or over 224 without dropout))"),
    ("sm80", {"hk": 2}, {"enable_gqa": True}, "flash: fp16, head dim 64, no mask, GQA 4 query / 2 key heads"),
    ("sm80", {"dtype": F32, "d": 18, "grad": False}, {},
     "math: fp32, head dim 18, no mask, no grad (flash: needs fp16 or bf16 (got fp32); "
     "memory-efficient: needs head dims a multiple of 4 (got 18, 18))"),
])
def test_the_choice_says_the_call_and_why_the_backends_before_it_refused(capability, tensors, args, expected):
    q, k, v = qkv(**tensors)
    mask = torch.empty(q.size(2), k.size(2), dtype=torch.bool, device="meta") if args.pop("mask", False) else None
    choice = choose_sdp_backend(q, k, v, mask, target=CudaTarget(capability=SM[capability]), **args)
    assert f"{choice.backend}: {choice.why()}" == expected


# -- what each backend keeps, what its backward allocates -----------------------------------------------


@contextlib.contextmanager
def stand_in(capability=(8, 0), cudnn_version=OLD_CUDNN):
    tracker = LiveStorageTracker(record=True, kernel=MetaKernels())
    choices = CudaKernelChoices(tracker, CudaTarget(capability=capability, cudnn_version=cudnn_version))
    with choices, tracker:
        yield tracker, choices


def kept_by_forward(tensors, capability=(8, 0), **args):
    with stand_in(capability) as (tracker, choices):
        q, k, v = qkv(**tensors)
        tracker.register((q, k, v))
        before = tracker.current_bytes
        out = F.scaled_dot_product_attention(q, k, v, **args)
        kept = tracker.current_bytes - before
        return kept, out, dict(choices.backends), tracker, (q, k, v)


def test_flash_keeps_its_output_and_logsumexp():
    b, h, s, d = 2, 4, 128, 64
    kept, out, backends, *_ = kept_by_forward({"b": b, "h": h, "sq": s, "d": d})
    assert backends == {FLASH: 1}
    assert kept == b * h * s * d * 2 + b * h * s * 4  # out (fp16) + logsumexp (B, H, Sq) float32
    assert out.shape == (b, h, s, d)


def test_memory_efficient_keeps_its_output_and_a_logsumexp_padded_to_32_queries():
    b, h, s, d = 2, 4, 100, 64
    kept, _, backends, *_ = kept_by_forward({"b": b, "h": h, "sq": s, "d": d, "dtype": F32})
    assert backends == {EFFICIENT: 1}
    assert kept == b * h * s * d * 4 + b * h * 128 * 4  # ceil(100 / 32) * 32 = 128


def test_memory_efficient_without_grad_keeps_no_logsumexp():
    b, h, s, d = 2, 4, 100, 64
    kept, *_ = kept_by_forward({"b": b, "h": h, "sq": s, "d": d, "dtype": F32, "grad": False})
    assert kept == b * h * s * d * 4


def test_math_keeps_the_attention_matrix():
    b, h, s, d = 2, 4, 128, 18  # fp32 head dim 18: the math path
    kept, _, backends, *_ = kept_by_forward({"b": b, "h": h, "sq": s, "d": d, "dtype": F32})
    assert backends == {MATH: 1}
    assert kept >= b * h * s * s * 4  # softmax(Q K^T), saved for backward


def test_flash_pads_head_dims_to_a_multiple_of_8():
    b, h, s, d = 1, 2, 64, 60
    kept, out, backends, *_ = kept_by_forward({"b": b, "h": h, "sq": s, "d": d})
    assert backends == {FLASH: 1} and out.shape == (b, h, s, d)
    # pad_last_dim<8>: q, k, v copied to 64 wide (kept for backward), the padded output, logsumexp
    assert kept == 4 * b * h * s * 64 * 2 + b * h * s * 4


B, H, L, D = 2, 4, 100, 64  # L not a multiple of 32 (memory-efficient pads its logsumexp) nor of 16
OUT, LSE, SCORES = B * H * L * D, B * H * L, B * H * L * L  # elements: output, logsumexp, one attention matrix

# (why, capability, dtype, sdpa arguments, backends enabled, backend, bytes kept for backward by the call)
KEPT = [
    ("flash: output and logsumexp (B, H, L) float32", "sm80", F16, {}, None, FLASH, OUT * 2 + LSE * 4),
    ("flash with dropout: the same (its RNG state lives on the host)", "sm86", BF16,
     {"dropout_p": 0.1, "is_causal": True}, None, FLASH, OUT * 2 + LSE * 4),
    ("memory-efficient: output and logsumexp padded to 32 queries", "sm80", F32, {}, None, EFFICIENT,
     OUT * 4 + B * H * 128 * 4),
    ("memory-efficient with a boolean mask: its additive copy, rows padded to 16", "sm80", F16, {"mask": True},
     None, EFFICIENT, OUT * 2 + B * H * 128 * 4 + L * 112 * 2),
    ("cuDNN: output and logsumexp (B, H, L, 1) float32", "sm90", BF16, {}, None, CUDNN, OUT * 2 + LSE * 4),
    ("math: scaled Q and K, the softmax (B, H, L, S), the output", "sm80", F32, {}, [SDPBackend.MATH], MATH,
     OUT * 4 * 3 + SCORES * 4),
    ("math with dropout: and the dropout's boolean mask and the dropped matrix", "sm80", F32, {"dropout_p": 0.5},
     [SDPBackend.MATH], MATH, OUT * 4 * 3 + SCORES * 4 * 2 + SCORES),
    ("math on half inputs computes in float32: Q, K, V upcast, the output cast back", "sm80", F16,
     {"dropout_p": 0.5}, [SDPBackend.MATH], MATH, OUT * 4 * 3 + SCORES * 4 * 2 + SCORES + OUT * 2),
]


@pytest.mark.parametrize(("why", "capability", "dtype", "args", "enabled", "backend", "kept"), KEPT,
                         ids=[row[0][:50] for row in KEPT])
def test_what_each_backend_keeps_for_backward(why, capability, dtype, args, enabled, backend, kept):
    switch = sdpa_kernel(enabled) if enabled else contextlib.nullcontext()
    with switch, stand_in(SM[capability], cudnn_version=NEW_CUDNN) as (tracker, choices):
        q, k, v = qkv(b=B, h=H, sq=L, d=D, dtype=dtype)
        tracker.register((q, k, v))
        before = tracker.current_bytes
        mask = torch.ones(L, L, dtype=torch.bool, device="meta") if args.pop("mask", False) else None
        tracker.register(t for t in (mask,) if t is not None)
        out = F.scaled_dot_product_attention(q, k, v, mask, **args)
        assert (tracker.current_bytes - before - (mask.numel() if mask is not None else 0), choices.backends) == \
            (kept, {backend: 1})
        assert out.shape == (B, H, L, D) and out.dtype == dtype


def test_dropout_keeps_a_boolean_mask_as_cudas_fused_kernel_does():
    with stand_in() as (tracker, _):
        x = torch.empty(1000, 100, device="meta", requires_grad=True)
        tracker.register((x,))
        before = tracker.current_bytes
        y = F.dropout(x, 0.1)
        assert tracker.current_bytes - before == x.numel() * 4 + x.numel()  # output + mask (1 byte each)
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
        before = tracker.current_bytes
        assert F.dropout(x, 0.1, training=False).untyped_storage() is x.untyped_storage()  # no copy in eval
        assert tracker.current_bytes == before


def scratch_events(trace, start):
    """(size, freed right after?) of the allocations in trace[start:] whose free follows at once."""
    events = trace[start:]
    allocs = {key: n for key, n, _ in events if n >= 0}
    return [allocs[key] for key, n, _ in events if n < 0 and key in allocs]


def test_flash_backward_allocates_softmax_d_and_dq_accum():
    b, h, s, d = 2, 4, 100, 64
    with stand_in() as (tracker, _):
        q, k, v = qkv(b=b, h=h, sq=s, d=d)
        out = F.scaled_dot_product_attention(q, k, v)
        start = len(tracker.trace)
        out.sum().backward()
        freed = scratch_events(tracker.trace, start)
    softmax_d, dq_accum = b * h * 128 * 4, b * 128 * h * 64 * 4  # seqlen rounded to 128, head dim to 32
    assert [softmax_d, dq_accum] == [n for n in freed if n in (softmax_d, dq_accum)]


def test_memory_efficient_backward_allocates_delta_and_a_float_dq_accumulator():
    b, h, s, d = 2, 4, 100, 64
    with stand_in() as (tracker, _):
        q, k, v = qkv(b=b, h=h, sq=s, d=d, dtype=F32)
        out = F.scaled_dot_product_attention(q, k, v)
        start = len(tracker.trace)
        out.sum().backward()
        freed = scratch_events(tracker.trace, start)
    assert b * h * s * 4 in freed and b * s * h * d * 4 in freed


# -- cuBLAS workspaces ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("capability", "config", "expected"), [
    ((9, 0), None, 32 * MiB),  # 4096 * 8 * 1024 on sm90
    ((8, 0), None, 4096 * 1024 * 2 + 16 * 1024 * 8),  # ":4096:2:16:8"
    ((10, 0), None, 4096 * 1024 * 2 + 16 * 1024 * 8),  # only sm90 gets 32 MiB
    ((8, 0), ":4096:8", 32 * MiB),
    ((9, 0), ":16:8", 128 * 1024),  # the deterministic setting
    ((8, 0), ":4096:2:16:8", 4096 * 1024 * 2 + 16 * 1024 * 8),
    ((9, 0), "nonsense", 32 * MiB),  # unparsable: the default, as torch warns
])
def test_cublas_workspace_size_as_parseChosenWorkspaceSize(capability, config, expected):
    assert CudaTarget(capability=capability, cublas_workspace_config=config).cublas_workspace_bytes() == expected


@pytest.mark.parametrize(("config", "lt_size", "unified", "expected"), [
    (None, None, None, MiB),  # 1024 KiB
    (None, "4096", None, 4 * MiB),
    (":16:8", None, None, 128 * 1024),  # never more than the cuBLAS workspace
    (None, None, "1", 0),  # unified: cuBLASLt uses the cuBLAS workspace
])
def test_cublaslt_workspace_size_as_getCUDABlasLtWorkspaceSize(config, lt_size, unified, expected):
    target = CudaTarget(capability=(8, 0), cublas_workspace_config=config, cublaslt_workspace_size=lt_size,
                        cublaslt_unified=unified)
    assert target.cublaslt_workspace_bytes() == expected


def workspaces(trace, sizes):
    return [n for _, n, _ in trace if n in sizes]


def test_one_cublas_workspace_per_handle_forward_and_backward():
    cublas = 4096 * 1024 * 2 + 16 * 1024 * 8
    with stand_in() as (tracker, choices):
        a = torch.empty(64, 32, device="meta", requires_grad=True)
        w = torch.empty(32, 16, device="meta", requires_grad=True)
        (a @ w).sum().backward()
        (a @ w).sum().backward()  # the same handles again: no new workspace
        with torch.no_grad():
            a @ w
    assert workspaces(tracker.trace, {cublas}) == [cublas, cublas]
    assert any("cuBLAS workspaces held: 2 x" in note for note in choices.notes)


def test_a_linear_with_bias_takes_a_cublaslt_workspace_once():
    with stand_in() as (tracker, _):
        x = torch.empty(8, 32, device="meta")
        layer = torch.nn.Linear(32, 16, device="meta")
        with torch.no_grad():
            layer(x)
            layer(x)
    assert workspaces(tracker.trace, {MiB}) == [MiB]


def test_convolutions_state_the_workspace_bound_they_used():
    with stand_in() as (tracker, choices):
        x = torch.empty(2, 3, 256, 256, device="meta")
        conv = torch.nn.Conv2d(3, 8, 3, device="meta")
        with torch.no_grad():
            conv(x)
    (note,) = [n for n in choices.notes if "cuDNN convolution" in n]
    assert "counted as 0 bytes" in note and f"{2 * 8 * 254 * 254 * 4 / MiB:.1f} MiB" in note
