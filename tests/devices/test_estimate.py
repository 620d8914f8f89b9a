"""Estimates: the fit rule on meta or fake tensors agrees with the real CPU run, using no real memory."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from autotune.devices import CUDA_CONTEXT_ALLOWANCE, CpuDevice, EstimateDevice, get_device
from autotune.devices.estimate import CUDA_ROUNDING, ENGINES
from autotune.errors import BadInput, DeviceError
from autotune.probing.fitrule import fit_rule_work
from autotune.workload import load_workload
from autotune.workload.bookkeeping import noise_buffer

GiB = 1024**3
MiB = 1024**2


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def real_and_estimated(workload, batch, engine="meta"):
    cpu = CpuDevice(memory_budget=8 * GiB)
    _, real = cpu.measure(fit_rule_work(workload, batch))
    estimator = cpu.estimator()
    estimator.engine = engine
    _, est = estimator.measure(fit_rule_work(workload, batch))
    assert estimator.engine == engine
    return real, est


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("batch", [1, 64, 512])
def test_mlp_estimate_is_exactly_the_real_cpu_peak(batch, engine):
    real, est = real_and_estimated(load_workload("mlp"), batch, engine)
    assert est.peak_bytes == real.peak_bytes
    assert est.breakdown == real.breakdown
    assert est.timeline == real.timeline  # the same allocations in the same order


@pytest.mark.parametrize(("name", "batch"), [("gpt", 2), ("convnet", 4)])
@pytest.mark.parametrize("engine", ENGINES)
def test_builtin_probe_estimates_within_one_percent(name, batch, engine):
    real, est = real_and_estimated(load_workload(name), batch, engine)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes, (est.peak_bytes, real.peak_bytes)
    for category, value in real.breakdown.items():
        assert abs(est.breakdown[category] - value) <= 0.01 * real.peak_bytes, category


def test_estimate_of_many_gib_of_activations_allocates_nothing_real():
    workload = load_workload("mlp")
    est = CpuDevice(memory_budget=GiB).estimator()
    est.measure(fit_rule_work(workload, 4))  # warm up: imports, caches
    before = rss_bytes()
    start = time.perf_counter()
    # 4M samples: the batch alone is 1 GiB, each hidden activation 4 GiB.
    _, m = est.measure(fit_rule_work(workload, 4_000_000))
    seconds = time.perf_counter() - start
    grown = rss_bytes() - before
    assert m.peak_bytes > 16 * GiB
    assert m.breakdown["activations"] > 16 * GiB
    assert grown < 64 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"
    assert seconds < 10, f"the estimate took {seconds:.1f} s"

    # The RSS probe itself can see a real allocation of that order.
    before = rss_bytes()
    real = torch.ones(64 * MiB)  # 256 MiB, touched
    assert rss_bytes() - before > 200 * MiB
    del real


def test_mlp_estimate_is_fast():
    workload = load_workload("mlp")
    est = CpuDevice(memory_budget=GiB).estimator()
    start = time.perf_counter()
    est.measure(fit_rule_work(workload, 64))
    assert time.perf_counter() - start < 10  # typically a quarter of a second; only pathology fails


def test_estimates_never_emulate_an_oom():
    _, m = EstimateDevice(capacity=1024, round_to=1, cuda_like=False).measure(
        fit_rule_work(load_workload("mlp"), 64), enforce_capacity=True)
    assert m.peak_bytes > 1024


def test_gpu_estimate_counts_exact_bytes_and_replays_them_through_the_allocator():
    workload = load_workload("mlp")
    _, exact = CpuDevice(memory_budget=GiB).estimator().measure(fit_rule_work(workload, 3))
    _, gpu = get_device("estimate", memory_budget=24 * GiB).measure(fit_rule_work(workload, 3))
    params = sum(p.numel() * 4 for p in workload.model().parameters())
    rounded = sum(-(-p.numel() * 4 // CUDA_ROUNDING) * CUDA_ROUNDING for p in workload.model().parameters())
    assert (params, rounded) == (340_008, 340_480)  # the 10-float bias takes a whole 512-byte block
    # The tracker counts exact bytes; the simulated allocator does the rounding.
    assert gpu.breakdown["parameters"] == gpu.breakdown["gradients"] == params
    assert gpu.breakdown["optimizer_state"] == 2 * params + 6 * 4  # + six 4-byte steps
    # Standing in for CUDA, AdamW takes the foreach path, whose peak temporary
    # is ``_foreach_sqrt(exp_avg_sqs)``: one copy of every parameter at once. The
    # CPU's per-tensor loop instead peaks at two copies of the largest one. Both
    # hold the runner's noise-measurement buffer (six norm slots, a sum, 64 x 4 pending values).
    noise = noise_buffer(6, "meta").numel() * 4
    assert noise == (6 + 1 + 64 * 4) * 4
    assert gpu.breakdown["activations"] == params + noise
    assert exact.breakdown["activations"] == 2 * 256 * 256 * 4 + 256 * 4 + noise
    assert sum(gpu.breakdown.values()) == gpu.tracked_peak_bytes
    # Allocated at the peak (get_allocation_size, round_size of CUDACachingAllocator.cpp, the workspaces of
    # CublasHandlePool.cpp on sm80): the five parameter-sized sets, six steps and the noise buffer in 512-byte
    # blocks, two cuBLAS workspaces of 4096 KiB x 2 + 16 KiB x 8 (forward and backward handles), one 1 MiB
    # cuBLASLt workspace (the forward's addmm with a bias).
    cublas, lt = 4096 * 1024 * 2 + 16 * 1024 * 8, 1024 * 1024
    noise_block = -(-noise // CUDA_ROUNDING) * CUDA_ROUNDING
    assert gpu.allocated_peak_bytes == 5 * rounded + 6 * CUDA_ROUNDING + noise_block + 2 * cublas + lt
    # Reserved: everything up to 1 MiB (the tensors and the cuBLASLt workspace, 2.6 MiB) in two 2 MiB
    # small-pool segments; the workspaces (under 10 MiB) in one 20 MiB segment, the second split from it.
    assert gpu.peak_bytes == 2 * 2 * MiB + 20 * MiB
    assert gpu.alloc_retries == 0


def test_batches_whose_shape_depends_on_values_are_built_for_real_then_faked():
    def make(size, generator):
        x = torch.randn(size, 4, generator=generator)
        return x[x[:, 0] > 0]  # data-dependent shape: fake tensors cannot build it

    def work(session):
        return session.batch(make, 1000, torch.Generator().manual_seed(0))

    for engine in ENGINES:
        batch, m = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False, engine=engine).measure(work)
        expected = make(1000, torch.Generator().manual_seed(0))
        assert isinstance(batch, FakeTensor) or batch.is_meta  # no data either way
        assert batch.shape == expected.shape
        assert m.peak_bytes == expected.numel() * 4


@pytest.mark.parametrize(
    ("budget", "capacity"), [(24 * GiB, 24 * GiB - CUDA_CONTEXT_ALLOWANCE), (80 * GiB, 80 * GiB - 640 * MiB)]
)
def test_estimate_device_for_a_gpu(budget, capacity):
    dev = get_device("estimate", memory_budget=budget)
    assert isinstance(dev, EstimateDevice) and dev.estimated
    assert dev.capacity_bytes() == capacity
    assert (dev.round_to, dev.cuda_like, dev.allowance, dev.simulates) == (1, True, 640 * MiB, True)
    assert dev.estimator() is dev
    desc = dev.describe().to_dict()
    assert desc["summary"] == (
        f"estimate for a CUDA GPU with {budget // GiB}.0 GiB, compute capability 8.0; 640.0 MiB allowed for the "
        "CUDA context and libraries; CUDA's caching allocator simulated (PYTORCH_CUDA_ALLOC_CONF and "
        "PYTORCH_ALLOC_CONF unset)")
    assert desc["compute_capability"] == "8.0" and desc["allocator_conf"] == ""
    assert desc["measured_by"].startswith("reserved peak of a simulated CUDA caching allocator")


def test_the_allocator_settings_are_read_as_torch_reads_them(monkeypatch):
    """PYTORCH_ALLOC_CONF, the device-generic name, when PYTORCH_CUDA_ALLOC_CONF is not set; the output names
    the variable the simulation's settings came from."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    dev = get_device("estimate", memory_budget=GiB)
    info = dev.describe()
    assert dev.allocator is not None and dev.allocator.expandable_segments
    assert (info.allocator_conf, info.allocator_conf_variable) == ("expandable_segments:True", "PYTORCH_ALLOC_CONF")
    assert info.summary.endswith("simulated (PYTORCH_ALLOC_CONF=expandable_segments:True)")
    assert dev.with_other_guesses().describe().allocator_conf_variable == "PYTORCH_ALLOC_CONF"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # both set: torch takes the CUDA name's
    dev = get_device("estimate", memory_budget=GiB)
    info = dev.describe()
    assert dev.allocator is not None and not dev.allocator.expandable_segments
    assert dev.allocator.max_split_size == 64 * MiB
    assert (info.allocator_conf, info.allocator_conf_variable) == ("max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:1")  # refused settings name their variable
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    with pytest.raises(BadInput, match=r"^PYTORCH_ALLOC_CONF='max_split_size_mb:1' cannot be used: .*too small"):
        get_device("estimate", memory_budget=GiB)


def test_per_process_memory_fraction_caps_the_capacity_the_margin_is_taken_from(monkeypatch):
    """On a T4 (15.0 GiB, 14.4 GiB after the CUDA context) a fraction of 0.5 lets the allocator reserve 7.5 GiB:
    that is the capacity, usable = min(capacity, fraction x total) x (1 - margin), and the output says so."""
    from autotune import api

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "per_process_memory_fraction:0.5")
    dev = get_device("estimate:T4-16GB")
    assert dev.capacity_bytes() == int(0.5 * 15360 * MiB) < dev.capacity - dev.allowance
    result = api.probe("mlp", device="estimate:T4-16GB", max_batch=64)
    assert result.capacity_bytes == dev.capacity_bytes() and result.usable_bytes == int(0.9 * dev.capacity_bytes())
    assert "of 6.8 GiB usable (7.5 GiB capacity: per_process_memory_fraction 0.5 x the GPU's 15.0 GiB, margin 10%)" \
        in result.summary()
    assert "the allocator may reserve 7.5 GiB (per_process_memory_fraction 0.5 x the GPU's 15.0 GiB; below the " \
        "14.4 GiB from" in result.device.summary
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "per_process_memory_fraction:0.99")  # 14.9 GiB: the context decides
    dev = get_device("estimate:T4-16GB")
    assert dev.capacity_bytes() == dev.capacity - dev.allowance and "may reserve" not in dev.describe().summary


@pytest.mark.parametrize("fraction", ["0", "0.0"])
def test_a_fraction_of_0_is_refused(fraction, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", f"per_process_memory_fraction:{fraction}")
    with pytest.raises(BadInput, match=r"^PYTORCH_ALLOC_CONF='per_process_memory_fraction:0(\.0)?': "
                                       r"per_process_memory_fraction 0 lets the allocator reserve nothing.*above 0"):
        get_device("estimate:T4-16GB")


def test_a_tiny_fraction_says_micro_batch_1_does_not_fit(monkeypatch):
    """Past the fraction's cap the estimate replays on a GPU large enough (no fraction there): a figure, not an
    out-of-memory error inside the estimate."""
    from autotune import api
    from autotune.errors import DoesNotFit

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "per_process_memory_fraction:0.00001")
    with pytest.raises(DoesNotFit, match=r"micro-batch 1 needs [\d.]+ MiB \(estimated\), usable memory is"):
        api.probe("mlp", device="estimate:T4-16GB", max_batch=64)


def test_budget_that_leaves_nothing_after_the_allowance():
    with pytest.raises(ValueError, match="leaves nothing after the 640.0 MiB allowance"):
        EstimateDevice.for_gpu(CUDA_CONTEXT_ALLOWANCE)
    with pytest.raises(DeviceError, match="640.0 MiB is not more than the 640.0 MiB a CUDA context takes"):
        get_device("estimate", memory_budget=CUDA_CONTEXT_ALLOWANCE)


def test_other_errors_propagate_from_an_estimate():
    def work(session):
        raise KeyError("the user's bug")

    with pytest.raises(KeyError, match="the user's bug"):
        CpuDevice(memory_budget=GiB).estimator().measure(work)


def test_a_batch_sliced_from_a_host_dataset_counts_as_its_own_elements():
    from torch import nn

    from autotune.probing.fitrule import run_trial
    from autotune.workload import Workload

    data, labels = torch.randn(50_000, 64), torch.randint(0, 10, (50_000,))
    sliced = Workload(name="sliced", model=lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
                      batch=lambda n, g: (data[:n], labels[:n]),
                      loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    cpu = CpuDevice(memory_budget=64 * 2**20)
    real = run_trial(cpu, sliced, 8, 2**40, source="real", capacity_guard=False).peak_bytes
    fake = run_trial(cpu.estimator(), sliced, 8, 2**40, source="estimate").peak_bytes
    assert fake == real < data.numel() * 4  # not the 12.8 MB dataset the slices are views of


@pytest.mark.slow
def test_fake_tensors_standing_in_for_a_gpu_run_cudas_attention_as_the_meta_engine_does():
    # FSDP estimates run under FakeTensorMode: its peak for a GPU must be the meta engine's, attention included
    # (the CPU's attention kernels would keep more for backward at this size: 736 MiB against 552 MiB)
    from autotune.probes.gpt import Config, _workload

    workload = _workload("gpt-10m", Config(vocab=16000, seq_len=256, d_model=256, heads=8, layers=8, min_len=64))
    meta = get_device("estimate:A100-80GB").estimator()
    fake = get_device("estimate:A100-80GB").estimator()
    fake.engine = "fake"
    _, on_meta = meta.measure(fit_rule_work(workload, 4))
    _, on_fake = fake.measure(fit_rule_work(workload, 4))
    assert on_fake.peak_bytes == on_meta.peak_bytes
    assert any("as CUDA runs it: memory-efficient attention on sm80: fp32, head dim 32, causal, dropout 0.1 "
               "(flash: needs fp16 or bf16 (got fp32))" in n for n in on_fake.notes), on_fake.notes


def test_the_built_in_gpt_in_bf16_on_an_a10g_runs_flash_attention_and_says_why():
    from autotune.probes.gpt import GPT, Config, _workload

    bf16 = dataclasses.replace(_workload("gpt-bf16", Config()), model=lambda: GPT(Config()).to(torch.bfloat16))
    _, m = get_device("estimate:A10G-24GB").estimator().measure(fit_rule_work(bf16, 4))
    # 2 layers x 4 micro-steps; in training the model's dropout goes to the kernel too
    assert "scaled_dot_product_attention as CUDA runs it: flash attention on sm86: bf16, head dim 16, causal, " \
           "dropout 0.1 (8 calls)" in m.notes, m.notes


LLAMA_ON_THE_ESTIMATE = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from autotune import Workload
from autotune.devices import get_device
from autotune.probing.fitrule import fit_rule_work, isolate
from autotune.probing.fsdp import Sharding

config = LlamaConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False)
workload = isolate(Workload(name="llama", model=lambda: LlamaForCausalLM(config),
                            batch=lambda n, g: {"input_ids": torch.randint(0, 128256, (n, 2048), generator=g),
                                                "labels": torch.randint(0, 128256, (n, 2048), generator=g)},
                            loss=lambda net, data: net(**data).loss))
device = get_device("estimate:H100-80GB").estimator()
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch and transformers loaded, nothing built
_, whole = device.measure(fit_rule_work(workload, 1))
_, sharded = device.measure(fit_rule_work(workload, 1, sharding=Sharding(8)))
assert device.engine == "meta", device.fallback
with torch.device("meta"):
    params = sum(p.numel() * 4 for p in workload.make_model().parameters())
print(params, whole.breakdown["parameters"], sharded.breakdown["parameters"],
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - loaded)
"""


@pytest.mark.slow
def test_an_llm_is_estimated_without_a_parameter_on_the_host():
    """Issue 40, item 6: an 8B-shaped Llama's embedding and head (4.2 GB in fp32), with and without FSDP over 8
    ranks, are estimated in under 1 GiB of host memory, all of it counted on the estimated device."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LLAMA_ON_THE_ESTIMATE], capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    params, whole, sharded, rss = (int(x) for x in done.stdout.split()[-4:])
    assert params > 4 * 10**9 and params <= whole < params + 2**20  # every parameter on the device (512-byte blocks)
    assert params // 8 <= sharded < params // 8 + 2**20  # this rank's shards
    # what the estimates added to the host's peak RSS over the libraries' (a CUDA build of torch alone loads more)
    assert rss < GiB, f"the estimates raised the host's peak RSS by {rss / MiB:.0f} MiB"
