"""The fingerprint changes whenever the probe's answer could, and only then."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from autotune.devices import CpuDevice, CudaDevice, EstimateDevice
from autotune.results.request import FitRule, ProbeRequest
from autotune.store.fingerprint import Untraceable, device_part, fingerprint
from autotune.workload import Workload, load_workload

from ..devices.fakes import FakeCuda

GiB = 1024**3


def tiny(*, width: int = 8, features: int = 4, dtype: torch.dtype = torch.float32, batch_dtype=torch.float32,
         lr: float = 1e-3, optimizer=torch.optim.AdamW, square: bool = True, buffer: bool = False,
         name: str = "tiny") -> Workload:
    def model() -> nn.Module:
        net = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, 1)).to(dtype)
        if buffer:
            net.register_buffer("scale", torch.ones(width))
        return net

    def batch(n: int, g: torch.Generator) -> torch.Tensor:
        return torch.randn(n, features, generator=g).to(batch_dtype)

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(b.to(dtype))
        return out.pow(2).mean() if square else out.abs().mean()

    return Workload(name=name, model=model, batch=batch, loss=loss, optimizer=lambda p: optimizer(p, lr=lr))


def estimate(budget: int = GiB) -> EstimateDevice:
    return EstimateDevice.for_gpu(budget)


def asked(margin: float = 0.1, precision: str = "fp32", **rule) -> ProbeRequest:
    """A probe's request: ``rule`` is its FitRule's (parallel, world_size, rank, buckets)."""
    rule = {"parallel": "ddp", "world_size": 1, **rule}
    return ProbeRequest(margin=margin, precision=precision, rule=FitRule.of(**rule))


def digest(workload: Workload | None = None, device=None, **settings) -> str:
    return fingerprint(workload or tiny(), device or estimate(), asked(**settings)).digest


def test_the_same_probe_has_the_same_fingerprint_every_time():
    assert digest() == digest()  # factories rebuilt, new closures, new device objects


@pytest.mark.parametrize("what,change", [
    ("a layer's width", dict(workload=tiny(width=9))),
    ("the parameters' dtype", dict(workload=tiny(dtype=torch.float64))),
    ("a buffer", dict(workload=tiny(buffer=True))),
    ("the batch's shape", dict(workload=tiny(features=5))),
    ("the batch's dtype", dict(workload=tiny(batch_dtype=torch.float64))),
    ("the optimizer's hyperparameters", dict(workload=tiny(lr=1e-2))),
    ("the optimizer's class", dict(workload=tiny(optimizer=torch.optim.SGD))),
    ("the loss's ops alone", dict(workload=tiny(square=False))),
    ("the workload's name", dict(workload=tiny(name="other"))),
    ("the estimate's budget", dict(device=estimate(2 * GiB))),
    ("the estimate's engine", dict(device=EstimateDevice.for_gpu(GiB, engine="fake"))),
    ("the margin", dict(margin=0.2)),
    ("the world size", dict(world_size=8)),
    ("DDP's buckets in the fit rule", dict(buckets=True)),
    ("the parallel strategy", dict(parallel="fsdp")),
    ("the precision", dict(precision="bf16")),
    ("FSDP's rank", dict(rank=1, parallel="fsdp", world_size=2)),
    ("FSDP's precision", dict(precision="bf16", parallel="fsdp", world_size=2)),
])
def test_everything_the_answer_depends_on_changes_the_fingerprint(what, change):
    base = {"parallel": "fsdp", "world_size": 2} if "FSDP" in what else {}
    assert digest(**change) != digest(**base), what


def test_what_the_fit_rule_holds_besides_the_model_changes_the_fingerprint(monkeypatch):
    from autotune.store import fingerprint as module

    before = digest()
    monkeypatch.setattr(module, "noise_buffer_numel", lambda parameters: parameters + 2)
    assert digest() != before


def test_fsdps_rule_is_written_out_in_the_parts():
    parts = fingerprint(tiny(), estimate(), asked(parallel="fsdp", world_size=2, rank=1)).components
    assert parts["rule"] == {"sharding": {"autotune.probing.fsdp.FsdpRule": {
        "world_size": 2, "rank": 1, "precision": "fp32", "real_group": False, "sync_every": False}}}
    every = fingerprint(tiny(), estimate(), asked(parallel="fsdp", world_size=2, rank=1, fsdp_sync="every"))
    assert every.components["rule"]["sharding"]["autotune.probing.fsdp.FsdpRule"]["sync_every"] is True
    assert every.digest != fingerprint(tiny(), estimate(), asked(parallel="fsdp", world_size=2, rank=1)).digest


def test_fsdps_cpu_offload_changes_the_fingerprint_and_leaves_the_others_as_stored():
    from dataclasses import replace

    plain = asked(parallel="fsdp", world_size=2, fsdp_sync="every")
    offloaded = replace(plain, rule=replace(plain.rule, offload=True))
    parts = fingerprint(tiny(), estimate(), offloaded).components["rule"]["sharding"]["autotune.probing.fsdp.FsdpRule"]
    assert parts["offload"] is True and "host_apart" not in parts
    assert "offload" not in fingerprint(tiny(), estimate(), plain).components["rule"]["sharding"][
        "autotune.probing.fsdp.FsdpRule"]
    assert fingerprint(tiny(), estimate(), offloaded).digest != fingerprint(tiny(), estimate(), plain).digest


def test_the_allocator_settings_change_the_fingerprint(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    before = digest()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert digest() != before


def test_the_allocator_settings_under_the_generic_name_change_the_fingerprint(monkeypatch):
    """PYTORCH_ALLOC_CONF is read as torch reads it: the settings decide, whichever name they came under."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    before = digest()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    generic = digest()
    assert generic != before
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    assert digest() not in (before, generic)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # both: torch takes this one
    assert digest() == generic


def test_the_chosen_workload_options_change_the_fingerprint():
    base = replace(tiny(), options={"checkpointing": [False, True]})
    assert digest(base.configure(checkpointing=True)) != digest(base.configure(checkpointing=False))


def test_the_op_trace_sees_what_the_module_tree_does_not():
    parts = fingerprint(tiny(square=False), estimate(), asked()).components
    same = fingerprint(tiny(), estimate(), asked()).components
    assert parts["model"] == same["model"] and parts["batch"] == same["batch"]
    assert parts["ops"]["traced"] and parts["ops"]["digest"] != same["ops"]["digest"]


def test_free_memory_and_the_gpu_index_are_not_part_of_it(monkeypatch):
    busy = CudaDevice(0, cuda=FakeCuda(free=20 * GiB), nvml=None)
    idle = CudaDevice(1, cuda=FakeCuda(free=75 * GiB), nvml=None)
    assert busy.capacity_bytes() != idle.capacity_bytes()
    assert device_part(busy.describe()) == device_part(idle.describe())
    other = CudaDevice(0, cuda=FakeCuda(total=40 * GiB, name="Fake A100"), nvml=None)
    assert device_part(other.describe()) != device_part(busy.describe())
    budgeted = CudaDevice(0, cuda=FakeCuda(free=75 * GiB), nvml=None, memory_budget=16 * GiB)
    assert device_part(budgeted.describe()) != device_part(idle.describe())
    from autotune.devices import cpu

    monkeypatch.setattr(cpu, "ram_bytes", lambda: (24 * GiB, 10 * GiB))
    now = CpuDevice()
    monkeypatch.setattr(cpu, "ram_bytes", lambda: (24 * GiB, 12 * GiB))
    later = CpuDevice()
    assert device_part(now.describe()) == device_part(later.describe())
    assert device_part(CpuDevice(memory_budget=GiB).describe()) != device_part(now.describe())


def test_a_workload_the_estimate_cannot_run_still_has_a_fingerprint():
    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(b)
        return out.mean() * float(out.detach().numpy().sum() * 0 + 1)  # needs real data

    untraced = replace(tiny(), loss=loss)
    parts = fingerprint(untraced, estimate(), asked()).components
    assert parts["ops"]["traced"] is False and ".numpy()" in parts["ops"]["why"]


def test_a_model_that_cannot_be_built_without_data_has_none():
    def model() -> nn.Module:
        net = nn.Linear(4, 1)
        net.weight.detach().numpy()  # real data only
        return net

    with pytest.raises(Untraceable):
        fingerprint(replace(tiny(), model=model), estimate(), asked())


@pytest.mark.slow
def test_the_fingerprint_is_the_same_in_another_process():
    code = ("from autotune.store.fingerprint import fingerprint\nfrom autotune.devices import EstimateDevice\n"
            "from autotune.workload import load_workload\n"
            "from autotune.results.request import ProbeRequest\n"
            "print(fingerprint(load_workload('gpt'), EstimateDevice.for_gpu(2**30), "
            "ProbeRequest()).digest)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    here = fingerprint(load_workload("gpt"), estimate(), ProbeRequest())
    assert other.stdout.strip() == here.digest
