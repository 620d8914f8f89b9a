"""GPUs by name: ``--device estimate:H100-80GB``, ``autotune devices --presets``."""

from __future__ import annotations

import json

import pytest

from autotune.devices import EstimateDevice, get_device
from autotune.devices.presets import CONTEXT_ALLOWANCE, PRESETS, find_preset
from autotune.errors import DeviceError

MiB = 2**20
GiB = 2**30

# NVML's totals as nvidia-smi prints them (sources in autotune/devices/presets.py) and compute capabilities.
EXPECTED = {
    "H100-80GB": (81559, (9, 0)), "H200-141GB": (143771, (9, 0)), "A100-80GB": (81920, (8, 0)),
    "A100-40GB": (40960, (8, 0)), "A10G-24GB": (23028, (8, 6)), "L4-24GB": (23034, (8, 9)),
    "RTX4090-24GB": (24564, (8, 9)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_hold_nvml_totals_and_capabilities(name):
    preset = find_preset(name)
    assert (preset.total_bytes, preset.capability) == (EXPECTED[name][0] * MiB, EXPECTED[name][1])
    assert preset.allowance_bytes == CONTEXT_ALLOWANCE


def test_names_are_unique_and_found_in_any_case():
    assert len({p.name.lower() for p in PRESETS}) == len(PRESETS)
    assert find_preset("h100_80gb") is find_preset(" H100-80GB ")


def test_an_unknown_gpu_is_one_line_listing_the_presets():
    with pytest.raises(DeviceError, match=r"^unknown GPU 'H800' for device='estimate:GPU': use one of H100-80GB, "
                                          r".*RTX4090-24GB.*\(autotune devices --presets lists them\)") as info:
        get_device("estimate:H800")
    assert "\n" not in str(info.value)


def test_estimate_by_name_takes_the_gpus_memory_and_capability():
    dev = get_device("estimate:H100-80GB")
    assert isinstance(dev, EstimateDevice) and dev.name == "estimate:H100-80GB"
    assert dev.capacity_bytes() == 81559 * MiB - CONTEXT_ALLOWANCE
    assert dev.target.capability == (9, 0) and dev.simulates
    info = dev.describe()
    assert (info.model, info.total_bytes, info.compute_capability, info.budget_bytes) == (
        "NVIDIA H100 80GB HBM3", 81559 * MiB, "9.0", None)
    assert info.capacity_source == "NVML total of the GPU less the CUDA context allowance"
    assert info.summary.startswith("estimate for NVIDIA H100 80GB HBM3 (79.6 GiB as NVML reports it), compute "
                                   "capability 9.0; 640.0 MiB allowed")


def test_memory_budget_overrides_the_presets_memory():
    dev = get_device("estimate:A100-80GB", memory_budget=40 * GiB)
    assert dev.capacity_bytes() == 40 * GiB - CONTEXT_ALLOWANCE
    assert dev.target.capability == (8, 0)
    assert dev.describe().budget_bytes == 40 * GiB and "memory budget of 40.0 GiB" in dev.describe().summary
    with pytest.raises(DeviceError, match="is not more than the 640.0 MiB a CUDA context takes"):
        get_device("estimate:A100-80GB", memory_budget=512 * MiB)


def test_the_api_takes_a_gpu_by_name():
    from autotune import api

    result = api.probe("mlp", device="estimate:T4-16GB", max_batch=64)
    assert result.device.name == "estimate:T4-16GB" and result.max_micro_batch == 64
    assert result.allocated_peak_bytes is not None and result.peak_bytes >= result.allocated_peak_bytes


def test_devices_presets_lists_every_preset(capsys):
    # without importing torch: tests/test_imports.py
    from autotune.cli import main

    assert main(["devices", "--presets"]) == 0
    out = capsys.readouterr().out
    for preset in PRESETS:
        assert preset.name in out and f"{preset.total_bytes // MiB} MiB" in out
    assert main(["devices", "--presets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed] == [p.name for p in PRESETS]
    assert listed[0]["total_bytes"] == PRESETS[0].total_bytes and listed[0]["compute_capability"] == "9.0"
