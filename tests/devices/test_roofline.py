"""The roofline estimate of a micro-step's time on a GPU by name: FLOPs as torch's own counter counts them, bytes
of every op that moves data, the preset's peaks by precision."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autotune.devices import get_device
from autotune.devices.presets import PRESETS, find_preset
from autotune.devices.roofline import Counting, OpCounts, count_micro_step, preset_of, seconds, seconds_per_sample
from autotune.workload import Workload, load_workload


def linear_workload(dtype: torch.dtype = torch.float32) -> Workload:
    return Workload(name="linear", model=lambda: nn.Linear(64, 32, dtype=dtype),
                    batch=lambda n, g: torch.randn(n, 64, generator=g).to(dtype),
                    loss=lambda m, b: m(b).float().square().mean())


def test_flops_are_torchs_own_count_and_bytes_skip_views():
    model, x = nn.Linear(64, 32), torch.randn(8, 64)
    with FlopCounterMode(display=False) as torchs:
        model(x).square().mean().backward()
    counting = Counting()
    with counting:
        model(x).square().mean().backward()
    assert counting.flops == {"float32": torchs.get_total_flops()} and torchs.get_total_flops() > 0
    viewed = Counting()
    t = torch.randn(16, 16)
    with viewed:
        t.view(256)
    assert viewed.bytes == 0  # a view moves nothing
    with viewed:
        t.add(1)
    assert viewed.bytes == 2 * 256 * 4  # one read, one write


def test_a_micro_step_is_counted_on_shape_only_tensors_at_the_batch_asked():
    device = get_device("estimate:A100-80GB")
    small, large = (count_micro_step(linear_workload(), device, b) for b in (8, 16))
    assert large.flops["float32"] == 2 * small.flops["float32"]  # linear in the batch: no memory, no compute
    assert large.bytes > small.bytes


@pytest.mark.parametrize("dtype, gpu, peak", [
    ("float32", "A100-80GB", 19.5e12),
    ("bfloat16", "A100-80GB", 312e12),
    ("float16", "T4-16GB", 65e12),
    ("bfloat16", "T4-16GB", 8.1e12),  # no bf16 tensor cores on a T4: the fp32 rate
])
def test_flops_count_at_the_peak_of_their_precision(dtype, gpu, peak):
    preset = find_preset(gpu)
    assert seconds(OpCounts(flops={dtype: 10**12}, bytes=0), preset) == pytest.approx(1e12 / peak)
    memory_bound = OpCounts(flops={dtype: 1}, bytes=10**12)
    assert seconds(memory_bound, preset) == pytest.approx(1e12 / preset.bandwidth)


def test_a_faster_gpu_takes_less_time_per_sample_and_other_devices_have_no_estimate():
    gpt = load_workload("gpt")
    a100 = seconds_per_sample(gpt, get_device("estimate:A100-80GB"), 16)
    t4 = seconds_per_sample(gpt, get_device("estimate:T4-16GB"), 16)
    assert a100 is not None and t4 is not None and 3 < t4 / a100 < 10  # bandwidth 6.4x, fp32 2.4x
    assert preset_of(get_device("cpu")) is None
    assert seconds_per_sample(gpt, get_device("estimate", memory_budget=16 * 2**30), 16) is None


def test_every_preset_states_its_peaks_and_the_module_lists_their_sources():
    text = Path(__file__).resolve().parents[2].joinpath("autotune/devices/presets.py").read_text()
    table = text.split("For the roofline model")[1]
    for preset in PRESETS:
        assert preset.fp32_flops > 0 and preset.tensor_flops > preset.fp32_flops and preset.bandwidth > 0
        row = next(line for line in table.splitlines() if line.startswith(preset.name + " "))
        numbers = [float(x) for x in row.split()[1:] if re.fullmatch(r"\d+(\.\d+)?", x)][:3]
        assert [n * 1e12 for n in numbers] == pytest.approx(
            [preset.fp32_flops, preset.tensor_flops, preset.bandwidth]), preset.name
