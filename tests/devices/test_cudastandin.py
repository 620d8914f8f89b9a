"""The CUDA GPU an estimate stands in for, as the user's code sees it: torch.cuda's answers, "cuda" tensors,
autocast("cuda"), fused and foreach optimizers; nothing of it left after the estimate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from autotune import api, compat
from autotune.devices import CpuDevice, EstimateDevice, get_device
from autotune.devices.presets import find_preset
from autotune.devices.session import leftovers
from autotune.probing.fitrule import fit_rule_work
from autotune.workload import load_workload
from autotune.workload.bookkeeping import noise_buffer

from .user_probes import user_probe

GiB = 1024**3
A10G, H100 = "estimate:A10G-24GB", "estimate:H100-80GB"

#: The built-in gpt as people write it for a GPU: the device picked by torch.cuda.is_available(), the model and
#: its tensors put there, the loss under CUDA's autocast, a fused AdamW. ``{build}`` picks the size.
AGNOSTIC = '''
import dataclasses, torch
from autotune.probes import gpt

SEEN = {{}}

class Net(gpt.GPT):
    def forward(self, tokens):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        tokens = tokens.to(dev)
        positions = torch.arange(tokens.shape[1], device=dev)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

def model(**kwargs):
    SEEN.update(available=torch.cuda.is_available(), count=torch.cuda.device_count(),
                current=torch.cuda.current_device(), name=torch.cuda.get_device_properties(0).name,
                total=torch.cuda.get_device_properties(0).total_memory, cc=torch.cuda.get_device_capability(),
                bf16=torch.cuda.is_bf16_supported(), free=torch.cuda.mem_get_info())
    net = Net(gpt.{build}().model.args[0])
    return net.cuda() if torch.cuda.is_available() else net

def loss(model, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return gpt.loss(model, {{k: v.to("cuda:0") for k, v in batch.items()}})

def build():
    return dataclasses.replace(gpt.{build}(), model=model, loss=loss,
                               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
'''

#: Its twin written with no device in it: autotune moves the model and the batch.
PLAIN = '''
import dataclasses, torch
from autotune.probes import gpt

def loss(model, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return gpt.loss(model, batch)

def build():
    return dataclasses.replace(gpt.{build}(), loss=loss,
                               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
'''


def probe_file(tmp_path: Path, name: str, text: str, build: str = "build") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text.format(build=build))
    return str(path)


def untouched() -> None:
    """Nothing of the stand-in is visible: torch answers for this machine, autocast is as torch starts it."""
    assert not torch.cuda.is_available()
    assert torch.cuda.device_count() == 0
    assert not torch.is_autocast_enabled("cuda")
    assert torch.get_autocast_dtype("cuda") == torch.float16
    assert torch.is_autocast_cache_enabled()
    assert not compat.autocast_cuda_included()
    assert torch._C._len_torch_function_stack() == 0
    assert all(getattr(m, n) is fn for m, n, fn in compat.optimizer_device_lists())
    assert torch.clear_autocast_cache.__module__ != "autotune.devices.session"
    assert not hasattr(getattr(*compat.checkpoint_device_type()), "original")
    assert torch.empty(1, device="cpu").device.type == "cpu"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")  # no CUDA here: torch says so again
    assert leftovers() == []


def test_the_users_code_sees_the_gpu_planned_and_runs_on_the_meta_engine(tmp_path):
    spec = probe_file(tmp_path, "agnostic", AGNOSTIC)
    workload = load_workload(spec)
    device = get_device(A10G)
    _, m = device.measure(fit_rule_work(workload, 4))
    assert (device.engine, device.fallback) == ("meta", None)
    preset = find_preset("A10G-24GB")
    seen = workload.model.__globals__["SEEN"]
    assert seen == dict(available=True, count=1, current=0, name=preset.model, total=preset.total_bytes, cc=(8, 6),
                        bf16=True, free=(device.capacity_bytes(), preset.total_bytes))
    notes = " ".join(m.notes)
    assert "autocast('cuda', bfloat16): CUDA's cast policy" in notes
    line = next(i for i, text in enumerate(Path(spec).read_text().splitlines(), 1) if "dev = " in text)
    asked = next(n for n in m.notes if n.startswith("torch.cuda answered as the GPU planned"))
    assert "is_available at " in asked and f"{spec}:{line}" in asked  # the user's own call, where it is
    untouched()


def test_device_agnostic_code_estimates_as_its_device_free_twin(tmp_path):
    agnostic = load_workload(probe_file(tmp_path, "agnostic", AGNOSTIC))
    plain = load_workload(probe_file(tmp_path, "plain", PLAIN))
    measured = []
    for workload in (agnostic, plain):
        device = get_device(H100)
        _, m = device.measure(fit_rule_work(workload, 4))
        assert (device.engine, device.fallback) == ("meta", None)
        measured.append(m)
    a, b = measured
    assert (a.peak_bytes, a.allocated_peak_bytes, a.breakdown, a.timeline) == \
        (b.peak_bytes, b.allocated_peak_bytes, b.breakdown, b.timeline)
    untouched()


def test_nothing_of_the_stand_in_is_left_after_an_error_in_the_users_code(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(PLAIN.format(build="build").replace(
        "        return gpt.loss(model, batch)",
        "        torch.set_autocast_enabled('cuda', True)  # left on by the user's code\n"
        "        torch.set_autocast_dtype('cuda', torch.bfloat16)\n"
        "        torch.set_autocast_cache_enabled(False)\n"
        "        raise ValueError('broken loss')"))
    with pytest.raises(Exception, match="broken loss"):
        get_device(A10G).measure(fit_rule_work(load_workload(str(path)), 2))
    untouched()


def autocast_linear(tmp_path: Path, enabled: bool) -> str:
    forward = f"with torch.autocast('cuda', dtype=torch.bfloat16, enabled={enabled}):\n    return self.layer(x).relu()"
    return str(user_probe(tmp_path / f"linear_{enabled}.py", forward))


def test_the_memory_parts_show_bf16_activations_under_cudas_autocast(tmp_path):
    parts = []
    for enabled in (False, True):
        memory = api.probe(autocast_linear(tmp_path, enabled), device=H100, memory_snapshot=True, at=512,
                           max_batch=1024).memory
        parts.append({p.name: p.bytes for p in memory.parts if p.kind == "activations"})
    fp32, bf16 = parts
    assert fp32["<Net>"] == 512 * 64 * 4  # the relu's output, kept for backward
    assert 512 * 64 * 2 <= bf16["<Net>"] < 512 * 64 * 4  # in bf16 (and the weight's bf16 copy)
    assert bf16["layer"] == 512 * 32 * 2 and "layer" not in fp32  # the input cast to bf16, kept for the weight's grad
    untouched()


@pytest.mark.parametrize("options", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
def test_fused_and_foreach_optimizers_step_on_the_estimate_as_measured_for_real(options):
    workload = dataclasses.replace(load_workload("mlp"),
                                   optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, **options))
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 3))
    device = get_device("estimate", memory_budget=24 * GiB)
    _, gpu = device.measure(fit_rule_work(workload, 3))
    assert (device.engine, device.fallback) == ("meta", None)
    assert gpu.breakdown == real.breakdown  # the step's temporaries too: none fused, a list of them foreach
    untouched()


def test_the_optimizer_step_peak_differs_by_kernel_as_on_cuda():
    peaks = {}
    for name, options in {"fused": dict(fused=True), "foreach": dict(foreach=True),
                          "capturable": dict(capturable=True, foreach=True)}.items():
        workload = dataclasses.replace(load_workload("mlp"),
                                       optimizer=lambda p, o=options: torch.optim.Adam(p, lr=1e-3, **o))
        device = get_device("estimate", memory_budget=24 * GiB)
        _, m = device.measure(fit_rule_work(workload, 3))
        assert (device.engine, device.fallback) == ("meta", None), name
        peaks[name] = m
    params = sum(p.numel() * 4 for p in load_workload("mlp").model().parameters())
    noise = noise_buffer(6, "meta").numel() * 4  # the runner's noise-measurement buffer
    # foreach peaks in the step, holding _foreach_sqrt(exp_avg_sqs): a parameter-sized list of temporaries;
    # the fused kernel holds none (its peak is the backward's), capturable adds its step-sized ones
    assert peaks["foreach"].breakdown["activations"] == params + noise
    assert peaks["fused"].tracked_peak_bytes < peaks["foreach"].tracked_peak_bytes
    assert peaks["capturable"].tracked_peak_bytes > peaks["foreach"].tracked_peak_bytes
    untouched()


@pytest.mark.slow
def test_cuda_autocast_on_the_built_in_gpt_fits_between_fp32_and_a_bf16_model(tmp_path):
    fp32 = tmp_path / "fp32.py"
    fp32.write_text("from autotune.probes import gpt\ndef build():\n    return gpt.build_100m()\n")
    bf16 = tmp_path / "bf16.py"
    bf16.write_text("import dataclasses, torch\nfrom autotune.probes import gpt\ndef build():\n"
                    "    w = gpt.build_100m()\n"
                    "    return dataclasses.replace(w, model=lambda **k: w.model(**k).to(torch.bfloat16))\n")
    autocast = probe_file(tmp_path, "autocast", PLAIN, "build_100m")
    found = {name: api.probe(str(spec), device=A10G).max_micro_batch
             for name, spec in (("fp32", fp32), ("autocast", autocast), ("bf16", bf16))}
    # CUDA's policy keeps layer norms, the residual stream and the log-softmax of the logits in fp32, so autocast
    # lands well below the bf16 model (measured 35 -> 45 -> 70); without the policy applied it would equal fp32
    assert 1.25 * found["fp32"] <= found["autocast"] < found["bf16"], found
    untouched()


@pytest.mark.slow
def test_device_agnostic_gpt_100m_gets_its_twins_estimate_on_h100(tmp_path):
    results = [api.probe(probe_file(tmp_path, name, text, "build_100m"), device=H100)
               for name, text in (("agnostic", AGNOSTIC), ("plain", PLAIN))]
    assert results[0].max_micro_batch == results[1].max_micro_batch
    assert [t.peak_bytes for t in results[0].trials] == [t.peak_bytes for t in results[1].trials]
    assert all(r.device.engine == "meta" and r.device.engine_fallback is None for r in results)
    untouched()


def test_code_written_for_cuda_alone_is_probed_on_the_estimate_of_a_gpu(tmp_path):
    path = tmp_path / "cuda_only.py"
    path.write_text(
        "import torch, autotune\n"
        "def model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()\n"
        "def loss(m, b):\n"
        "    b = b.pin_memory().cuda(non_blocking=True)\n"
        "    return m(b).pow(2).mean() + torch.zeros((), device=torch.device('cuda', 0), pin_memory=False)\n"
        "def build():\n"
        "    return autotune.Workload(name='cuda_only', model=model, loss=loss,\n"
        "        batch=lambda n, g: torch.randn(n, 32, generator=g),\n"
        "        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3, fused=True))\n")
    result = api.probe(str(path), device=H100, max_batch=64)
    assert result.max_micro_batch == 64
    assert (result.device.engine, result.device.engine_fallback) == ("meta", None)
    untouched()


@pytest.mark.slow
def test_torch_compile_runs_under_the_stand_in():
    """Dynamo saves and restores the GPU's random state when CUDA is available: the stand-in gives it one."""
    from autotune.devices.cudastandin import GpuAnswers, StandIn

    answers = GpuAnswers(name="NVIDIA A10G", capability=(8, 6), total_bytes=24 * GiB, free_bytes=20 * GiB)
    with StandIn(torch.device("meta"), answers).installed():
        layer = torch.nn.Linear(8, 4).cuda()
        out = torch.compile(layer, backend="eager")(torch.randn(2, 8, device="cuda"))
        assert (out.shape, out.device.type) == ((2, 4), "meta")
    untouched()


@pytest.mark.slow
def test_both_engines_run_code_written_for_cuda_alike(tmp_path):
    workload = load_workload(probe_file(tmp_path, "agnostic", AGNOSTIC))
    measured = {}
    for engine in ("meta", "fake"):
        device = get_device(A10G)
        device.engine = engine
        _, measured[engine] = device.measure(fit_rule_work(workload, 4))
        assert (device.engine, device.fallback) == (engine, None)
    assert measured["meta"].breakdown == measured["fake"].breakdown
    assert measured["meta"].peak_bytes == measured["fake"].peak_bytes
    untouched()


def _import_time(tmp_path: Path, model: bool = True) -> Path:
    """PLAIN with its device chosen at import, as scripts do, the batch (and the ``model``) moved there."""
    path = tmp_path / "import_time.py"
    text = PLAIN.format(build="build").replace(
        "def loss(model, batch):\n",
        "DEV = 'cuda' if torch.cuda.is_available() else 'cpu'\n\n"
        "def loss(model, batch):\n"
        "    batch = {k: v.to(DEV) for k, v in batch.items()}\n")
    if model:
        text = text.replace("gpt.build(), loss=loss,",
                            "gpt.build(), model=lambda: gpt.build().make_model().to(DEV), loss=loss,")
    path.write_text(text)
    return path


def test_a_probe_file_choosing_its_device_at_import_sees_the_gpu_planned(tmp_path):
    """A probe file named to the estimate of a GPU is imported as on that GPU: its device chosen at import
    (``'cuda' if torch.cuda.is_available() else 'cpu'``) is the GPU's, so the model and the batch go where the
    GPU's run puts them, on the meta engine, the estimate its device-free twin's; probed on the CPU it is the
    CPU's; nothing of the stand-in is left."""
    path = _import_time(tmp_path)
    for device, chosen in ((A10G, "cuda"), ("cpu", "cpu")):
        assert api.load_for(str(path), get_device(device)).loss.__globals__["DEV"] == chosen
        untouched()
    twin = api.probe(probe_file(tmp_path, "plain", PLAIN), device=A10G, max_batch=8)
    found = api.probe(str(path), device=A10G, max_batch=8)
    assert (found.max_micro_batch, found.trials[-1].peak_bytes) == (twin.max_micro_batch, twin.trials[-1].peak_bytes)
    assert not any("FakeTensorMode" in n or "moved a device tensor to the CPU" in n for n in found.notes), \
        found.notes
    untouched()


def test_a_device_chosen_when_the_workload_was_imported_is_named(tmp_path):
    """A Workload imported before the estimate (by the caller, not named to it): torch.cuda.is_available() was
    this machine's answer (False) then, and the code moves its batch to the CPU, which the GPU would not."""
    path = _import_time(tmp_path, model=False)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "v.to(DEV)" in text)
    device = get_device(A10G)
    _, m = device.measure(fit_rule_work(load_workload(str(path)), 2))
    assert device.engine == "fake" and "meta" in device.fallback  # a meta tensor cannot be copied to the CPU
    note = next(n for n in m.notes if "moved a device tensor to the CPU" in n)
    assert f"{path}:{line}" in note and "torch.cuda.is_available() is False" in note
    untouched()


def test_checkpointed_blocks_recompute_under_cudas_autocast(tmp_path):
    """Checkpointing saves the autocast state of its inputs' device type: the recomputation in the backward,
    outside the autocast region, runs in bf16 as in the forward (else its activations' metadata differ)."""
    path = tmp_path / "checkpointed.py"
    path.write_text(PLAIN.format(build="build").replace(
        "    return dataclasses.replace(gpt.build(), loss=loss,",
        "    import functools\n"
        "    c = gpt.build().model.args[0]\n"
        "    return dataclasses.replace(gpt.build(), loss=loss,\n"
        "                               model=functools.partial(gpt.GPT, c, checkpointing=True),"))
    peaks = {}
    for name, spec in (("checkpointed", str(path)), ("plain", probe_file(tmp_path, "plain", PLAIN))):
        device = get_device(A10G)
        _, m = device.measure(fit_rule_work(load_workload(spec), 16))
        assert (device.engine, device.fallback) == ("meta", None), name
        peaks[name] = m.breakdown["activations"]
    assert peaks["checkpointed"] < peaks["plain"]
    untouched()


def test_an_estimate_of_this_machines_gpu_leaves_torch_cuda_to_answer_for_it(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a machine with the GPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or "the real one")
    device = EstimateDevice(capacity=24 * GiB, real_gpu=True)

    def work(session):
        return torch.cuda.get_device_name(0), torch.empty(2, device="cuda").device.type

    assert device.measure(work)[0] == ("the real one", "meta")  # torch's answer; the tensor still shape-only
    assert asked == [0]
    monkeypatch.undo()
    assert EstimateDevice(capacity=24 * GiB, real_gpu=True).measure(lambda s: torch.cuda.get_device_name())[0] == \
        "CUDA GPU (estimate)"  # no GPU here after all: the stand-in answers
    untouched()
