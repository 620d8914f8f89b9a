"""``autotune devices`` answers from NVML and /proc, and a bad --probe is refused at once: neither imports the
heavy libraries it does not need."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

HEAVY = ("torch", "numpy", "pandas", "optuna", "matplotlib", "scipy")

_PROBE = f"""
import json, sys
from autotune.cli import main
code = main(sys.argv[1:])
from autotune.devices.nvml import load_nvml
print(json.dumps({{"code": code, "nvml": load_nvml()[0] is not None,
                  "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}), file=sys.stderr)
"""


def _imports(*argv: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return json.loads(out.stderr.strip().splitlines()[-1])


def test_devices_imports_no_heavy_library():
    for argv in (["devices"], ["devices", "--json"]):
        seen = _imports(*argv)
        assert seen["code"] == 0
        # torch is needed only to ask torch.cuda for GPUs that NVML cannot see, with a torch built for GPUs
        needs_torch = not seen["nvml"] and bool(torch.version.cuda or torch.version.hip)
        assert seen["heavy"] == (["torch"] if needs_torch else []), argv


def test_a_probe_that_cannot_be_found_is_refused_before_torch_loads(tmp_path):
    for command in (["plan", "--target-batch", "64"], ["probe"], ["run", "--target-batch", "64"]):
        for probe in (str(tmp_path / "none.py"), "mlp:not-a-name"):
            seen = _imports(*command, "--probe", probe)
            assert seen["code"] == 2 and seen["heavy"] == [], (command, probe)


def test_torch_build_is_read_without_importing_torch():
    from autotune.devices.host import torch_build

    build = torch_build()
    assert build.version == torch.__version__
    expected = f"cuda {torch.version.cuda}" if torch.version.cuda else (
        f"hip {torch.version.hip}" if torch.version.hip else None)
    assert build.gpu == expected


def test_gpus_that_a_cpu_only_torch_cannot_use_are_named_without_importing_torch(monkeypatch):
    from autotune import devices
    from autotune.devices.host import TorchBuild
    from tests.devices.test_cuda import FakeNvml

    monkeypatch.setattr(devices, "torch_build", lambda: TorchBuild(version="2.13.0+cpu", gpu=None))
    out = devices.list_devices(nvml=FakeNvml(count=1))
    assert len(out["gpus"]) == 1 and out["torch"] == "2.13.0+cpu"
    assert out["notes"] == ["torch 2.13.0+cpu is a CPU-only build: it cannot use these GPUs; "
                            "install a CUDA build of torch"]
    monkeypatch.setattr(devices, "torch_build", lambda: TorchBuild(version="2.13.0", gpu="cuda 12.8"))
    assert devices.list_devices(nvml=FakeNvml(count=1))["notes"] == []
