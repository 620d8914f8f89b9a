"""The meta engine of estimates: memoised meta kernels, CPU kernel choices, the fallback."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.devices import CpuDevice, EstimateDevice
from autotune.devices import estimate as estimate_mod
from autotune.devices.cpukernels import CpuKernelChoices
from autotune.devices.cudakernels import CudaKernelChoices, CudaTarget
from autotune.devices.estimate import ENGINES
from autotune.devices.meta import (
    _ALWAYS_RUN,
    MetaKernels,
    NeedsFakeTensors,
    _recipe,
)
from autotune.devices.tracker import LiveStorageTracker
from autotune.errors import BadInput
from autotune.probing.fitrule import fit_rule_work
from autotune.workload import Workload, load_workload

from ..helpers import recurrent_workload

GiB = 1024**3


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


class Ops(TorchDispatchMode):
    """The aten ops that reach the dispatcher, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


# -- MetaKernels --------------------------------------------------------------------


def test_a_repeated_op_is_replayed_with_the_same_metadata_in_a_fresh_storage():
    kernels = MetaKernels()
    a, b = meta(8, 16), meta(16, 4)
    with LiveStorageTracker(kernel=kernels) as tracker:
        first = torch.mm(a, b)
        second = torch.mm(a, b)
    assert (kernels.replayed, len(kernels)) == (1, 1)
    assert second.is_meta
    assert (second.shape, second.stride(), second.dtype) == (first.shape, first.stride(), first.dtype)
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert tracker.peak_bytes == 2 * 8 * 4 * 4  # both counted


def test_the_key_holds_strides_a_transposed_input_is_not_a_contiguous_one():
    kernels = MetaKernels()
    with LiveStorageTracker(kernel=kernels):
        a = torch.empty_strided((6, 4), (1, 6), device="meta").clone()  # clone keeps a's column-major layout
        b = meta(6, 4).clone()
        c = torch.empty_strided((6, 4), (1, 6), device="meta").clone()
    assert a.stride() == c.stride() == (1, 6)
    assert b.stride() == (4, 1)


def test_views_always_run_and_share_their_input_storage():
    kernels = MetaKernels()
    x = meta(4, 6)
    with LiveStorageTracker(kernel=kernels):
        views = [x.view(6, 4), x.view(6, 4), x.t()]
    assert kernels.replayed == 0 and len(kernels) == 0
    assert all(v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in views)


def test_an_in_place_op_replays_as_its_own_argument():
    kernels = MetaKernels()
    x, y = meta(3, 5), meta(3, 5)
    with LiveStorageTracker(kernel=kernels):
        assert x.mul_(2) is x
        assert y.mul_(2) is y
    assert kernels.replayed == 1


def test_an_op_that_changes_its_argument_is_never_replayed():
    kernels = MetaKernels()
    first, second = meta(4), meta(4)
    with LiveStorageTracker(kernel=kernels):
        torch.ops.aten.resize_.default(first, [10])
        torch.ops.aten.resize_.default(second, [10])  # a replay would hand `second` back still of size 4
    assert first.shape == second.shape == (10,)
    assert kernels.replayed == 0


@pytest.mark.parametrize("case", ["offset", "larger storage", "input storage", "shared between outputs"])
def test_outputs_a_fresh_tensor_would_misstate_are_never_replayed(case):
    x = meta(4, 6)
    fresh = meta(10)
    out = {
        "offset": fresh[2:],                      # its storage holds 2 more elements than it shows
        "larger storage": fresh[:4],              # offset 0, but 40 bytes of storage for 16
        "input storage": x.view(24),              # the input's own storage, not a new one
        "shared between outputs": (fresh, fresh.view(2, 5)),
    }[case]
    assert _recipe(out, [x], [(x.shape, x.stride(), x.dtype, x.storage_offset())]) is _ALWAYS_RUN
    assert _recipe(meta(3, 2), [x], [(x.shape, x.stride(), x.dtype, x.storage_offset())]) is not _ALWAYS_RUN


def test_real_tensors_always_run():
    kernels = MetaKernels()
    step = torch.zeros(())
    with LiveStorageTracker(kernel=kernels):
        for _ in range(3):
            step.add_(1)  # an optimizer's step counter: its value matters
    assert step.item() == 3 and kernels.replayed == 0


def test_meta_scalars_are_answered_as_unknown():
    with LiveStorageTracker(fake_scalars=True):
        assert meta(3).sum().item() == 1.0
        assert bool(meta(3, dtype=torch.bool).any()) is False
    with pytest.raises((RuntimeError, NotImplementedError)), LiveStorageTracker():
        meta(3).sum().item()


# -- CpuKernelChoices -------------------------------------------------------------


def flash_model() -> nn.Module:
    """Attention without dropout: the CPU runs its fused flash kernel, never the attention matrix."""
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)


def sequences(dim: int, length: int = 64) -> Workload:
    return Workload(name="attention", model=flash_model,
                    batch=lambda n, g: torch.randn(n, length, dim, generator=g),
                    loss=lambda m, b: m(b).pow(2).mean())


def test_attention_chooses_the_cpu_flash_kernel_on_meta_tensors():
    q = meta(2, 4, 16, 8).requires_grad_()
    ops = Ops()
    with CpuKernelChoices(contextlib.nullcontext), ops:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops.names
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in ops.names
    assert "aten.bmm.default" not in ops.names


def test_attention_keeps_the_math_path_where_the_cpu_takes_it():
    q = meta(2, 4, 16, 8).requires_grad_()
    ops = Ops()
    with CpuKernelChoices(contextlib.nullcontext), ops:
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)  # the CPU's flash kernel has no dropout
    assert "aten.bmm.default" in ops.names
    assert not any("flash" in name for name in ops.names)


def test_attention_follows_an_sdpa_kernel_context_as_the_cpu_does():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = meta(2, 4, 16, 8).requires_grad_()
    with CpuKernelChoices(contextlib.nullcontext):
        ops = Ops()
        with ops, sdpa_kernel([SDPBackend.MATH]):
            F.scaled_dot_product_attention(q, q, q)
        assert not any("flash" in name for name in ops.names)
        ops = Ops()
        with ops:  # the same shapes again, outside the context
            F.scaled_dot_product_attention(q, q, q)
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops.names


def test_kernel_choices_are_removed_on_exit_even_after_an_error():
    q = meta(2, 4, 16, 8).requires_grad_()
    with pytest.raises(KeyError), CpuKernelChoices(contextlib.nullcontext):
        raise KeyError("inside")
    ops = Ops()
    with ops:
        F.scaled_dot_product_attention(q, q, q)
    assert not any("flash" in name for name in ops.names)  # stock meta behaviour: the math path


def test_without_cpu_kernel_choices_the_estimate_would_count_the_attention_matrix(monkeypatch):
    workload = sequences(32)
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 8))
    estimator = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False)
    _, est = estimator.measure(fit_rule_work(workload, 8))
    assert estimator.engine == "meta"
    assert est.peak_bytes == real.peak_bytes and est.timeline == real.timeline

    monkeypatch.setattr(estimate_mod, "CpuKernelChoices", lambda pause: contextlib.nullcontext())
    _, planted = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False).measure(fit_rule_work(workload, 8))
    assert planted.peak_bytes > real.peak_bytes  # the math path's b x heads x 64 x 64 scores


def test_standing_in_for_a_gpu_recurrent_layers_stop_the_meta_engine():
    lstm = nn.LSTM(4, 8, device="meta")
    with pytest.raises(NeedsFakeTensors, match="torch.lstm runs as a cuDNN kernel"), \
            CudaKernelChoices(LiveStorageTracker(record=True), CudaTarget()):
        lstm(meta(5, 2, 4))


# -- the engines against the real CPU --------------------------------------------------


class HalfPrecision(nn.Module):
    """A model converted to bf16 after it is built (a dtype change of every parameter)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(torch.bfloat16)

    def forward(self, x):
        return self.net(x.to(torch.bfloat16)).float()


class MaskedAttention(nn.Module):
    """Attention through F.scaled_dot_product_attention with a boolean, float or causal mask."""

    def __init__(self, mask: str):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.mask = mask

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        if self.mask == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = keep if self.mask == "bool" else torch.zeros(n, n, device=x.device).masked_fill(~keep, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def layered(name: str, model, shape: tuple[int, ...]) -> Workload:
    return Workload(name=name, model=model, batch=lambda n, g: torch.randn((n,) + shape, generator=g),
                    loss=lambda m, b: m(b).pow(2).mean())


LAYERS = [
    layered("bf16", lambda: HalfPrecision(), (10, 16)),
    *(layered(f"attention-{mask}", lambda mask=mask: MaskedAttention(mask), (10, 16))
      for mask in ("causal", "bool", "float")),
    layered("conv-norms", lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, stride=2),
        nn.GroupNorm(2, 8), nn.AdaptiveAvgPool2d(1)), (3, 16, 16)),
    layered("upsampling", lambda: nn.Sequential(
        nn.ConvTranspose2d(3, 4, 3, stride=2), nn.InstanceNorm2d(4), nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.Dropout2d(0.1), nn.PixelShuffle(2)), (3, 8, 8)),
    layered("norms", lambda: nn.Sequential(nn.LayerNorm(16), nn.RMSNorm(16), nn.Linear(16, 16), nn.SiLU(),
                                           nn.Dropout(0.2)), (10, 16)),
    layered("transformer", lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2), (10, 16)),
    layered("transformer-flash", lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2), (10, 16)),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("workload", LAYERS, ids=lambda w: w.name)
def test_both_engines_count_exactly_what_the_cpu_holds(workload, engine):
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 3))
    estimator = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False, engine=engine)
    _, est = estimator.measure(fit_rule_work(workload, 3))
    assert estimator.engine == engine
    assert est.peak_bytes == real.peak_bytes
    assert est.timeline == real.timeline


@pytest.mark.parametrize("engine", ENGINES)
def test_a_fused_optimizer_on_the_cpu_is_estimated_exactly_by_either_engine(engine):
    """fused=True (the Hugging Face Trainer's default AdamW): the CPU's fused kernels take the meta engine's
    tensors, as they take the CPU's, so the meta engine runs it (no fallback); torch's lists as before after."""
    from autotune.devices.session import leftovers

    workload = Workload(name="fused", model=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                        batch=lambda n, g: torch.randn(n, 16, generator=g), loss=lambda m, b: m(b).pow(2).mean(),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 3))
    estimator = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False, engine=engine)
    _, est = estimator.measure(fit_rule_work(workload, 3))
    assert (estimator.engine, estimator.fallback) == (engine, None)
    assert est.peak_bytes == real.peak_bytes and est.timeline == real.timeline
    assert "meta" not in torch.utils._foreach_utils._get_fused_kernels_supported_devices() and not leftovers()


def test_moving_a_model_keeps_tied_weights_tied():
    from autotune.devices.measurement import _move_module

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    moved = _move_module(model, lambda t: torch.empty_like(t, device="meta"))
    assert moved[0].weight is moved[1].weight and moved[0].weight.is_meta
    assert len(list(moved.parameters())) == 1


def checkpointed_gpt() -> Workload:
    from autotune.probes import gpt

    plain = load_workload("gpt")
    return Workload(name="gpt-checkpointed", model=lambda: gpt.GPT(gpt.Config(), checkpointing=True),
                    batch=plain.batch, loss=plain.loss, items=plain.items)


@pytest.mark.parametrize("build", [lambda: load_workload("gpt"), lambda: load_workload("convnet"), checkpointed_gpt],
                         ids=["gpt", "convnet", "gpt-checkpointed"])
def test_meta_engine_on_the_builtin_probes(build):
    workload = build()
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 3))
    _, est = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False).measure(fit_rule_work(workload, 3))
    assert est.timeline == real.timeline


@pytest.mark.slow
def test_a_recurrent_workload_on_a_gpu_stand_in_falls_back_to_fake_tensors_and_says_why():
    workload = recurrent_workload()
    estimator = EstimateDevice.for_gpu(GiB)
    _, est = estimator.measure(fit_rule_work(workload, 3))
    assert estimator.engine == "fake"
    assert "torch.gru runs as a cuDNN kernel" in estimator.fallback
    desc = estimator.describe().to_dict()
    assert desc["engine"] == "fake" and "torch.gru" in desc["engine_fallback"]
    assert "FakeTensorMode" in desc["measured_by"]
    _, fake = EstimateDevice.for_gpu(GiB, engine="fake").measure(fit_rule_work(workload, 3))
    assert est.timeline == fake.timeline
    # It stays there: the next measurement goes straight to FakeTensorMode.
    estimator.measure(fit_rule_work(workload, 4))
    assert estimator.engine == "fake"


def test_cpu_autocast_falls_back_to_fake_tensors_which_it_applies_to():
    def loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(batch).float().pow(2).mean()

    workload = Workload(name="bf16", model=lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
                        batch=lambda n, g: torch.randn(n, 64, generator=g), loss=loss)
    estimator = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False)
    _, est = estimator.measure(fit_rule_work(workload, 16))
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 16))
    assert estimator.engine == "fake" and "autocast" in estimator.fallback
    assert est.peak_bytes == real.peak_bytes


def test_an_error_in_both_engines_is_the_workloads_and_changes_nothing():
    def work(session):
        raise KeyError("the user's bug")

    estimator = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False)
    with pytest.raises(KeyError, match="the user's bug"):
        estimator.measure(work)
    assert estimator.engine == "meta" and estimator.fallback is None


def test_the_engine_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_ESTIMATE_ENGINE", "fake")
    assert EstimateDevice.for_gpu(GiB).engine == "fake"
    assert CpuDevice(memory_budget=GiB).estimator().engine == "fake"
    assert EstimateDevice.for_gpu(GiB, engine="meta").engine == "meta"  # an explicit choice wins
    monkeypatch.setenv("AUTOTUNE_ESTIMATE_ENGINE", "")
    assert EstimateDevice.for_gpu(GiB).engine == "meta"


def test_unknown_engine(monkeypatch):
    with pytest.raises(BadInput, match="unknown estimate engine 'jit'; use one of meta, fake"):
        EstimateDevice(capacity=GiB, engine="jit")
    monkeypatch.setenv("AUTOTUNE_ESTIMATE_ENGINE", "jit")
    with pytest.raises(BadInput, match="AUTOTUNE_ESTIMATE_ENGINE='jit' is not an estimate engine"):
        EstimateDevice.for_gpu(GiB)


def test_an_error_in_the_forward_is_the_workloads_own_and_never_switches_the_engine():
    """A user's error on the meta engine surfaces as that error: no second run under FakeTensorMode (where a
    forward that fails once would pass and hide it), the engine stays."""
    from autotune.errors import WorkloadError
    from autotune.probing.fitrule import run_trial

    calls = []

    class FailsOnce(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            calls.append(x.device.type)
            if len(calls) == 1:
                raise ValueError("the user's check failed")
            return self.linear(x)

    workload = Workload(name="fails-once", model=FailsOnce, batch=lambda n, g: torch.randn(n, 8, generator=g),
                        loss=lambda m, b: m(b).pow(2).mean())
    estimator = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False)
    with pytest.raises(WorkloadError, match="ValueError: the user's check failed"):
        run_trial(estimator, workload, 4, GiB, source="estimate")
    assert calls == ["meta"]  # the user's code ran once
    assert estimator.engine == "meta" and estimator.fallback is None


@pytest.mark.parametrize(("error", "why"), [
    (NeedsFakeTensors("autocast on the CPU does not apply to meta tensors"), "NeedsFakeTensors: autocast"),
    (TypeError("can't convert meta device type tensor to numpy. Use Tensor.cpu()"), "TypeError: can't convert meta"),
    (NotImplementedError("Cannot copy out of meta tensor; no data!"), "NotImplementedError: Cannot copy out of meta"),
    (NotImplementedError("Could not run 'aten::foo' with arguments from the 'Meta' backend."), "NotImplementedError"),
    (RuntimeError("Tensor on device cpu is not on the expected device meta!"), "RuntimeError: Tensor on device cpu"),
    (RuntimeError("a and b must have same reduction dim, but got [2, 5] X [4, 2]."), None),  # a shape error
    (ValueError("expected a meta-learning config"), None),  # the user's own error, whatever it says
    (KeyError("meta"), None),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB"), None),
    (RuntimeError("metadata mismatch"), None),
])
def test_only_the_meta_engines_own_inability_switches_it(error, why):
    from autotune.devices.meta import meta_cannot_run

    found = meta_cannot_run(error)
    assert (found is None) == (why is None) and (why is None or found.startswith(why))


def test_a_model_factory_that_needs_real_data_is_the_meta_engines_inability_even_wrapped():
    from autotune.devices.meta import meta_cannot_run
    from autotune.errors import WorkloadError

    def make():
        torch.empty(2, device="meta").numpy()

    try:
        Workload(name="real-only", model=make, batch=lambda n, g: torch.randn(n, 2), loss=lambda m, b: b.sum()
                 ).make_model()
    except WorkloadError as exc:
        assert meta_cannot_run(exc).startswith("TypeError: can't convert meta device type tensor to numpy")
        assert meta_cannot_run(WorkloadError(str(exc))) is None  # no cause: nothing to go by
