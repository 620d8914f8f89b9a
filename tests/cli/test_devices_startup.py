"""``autotune devices`` answers from NVML and /proc, and a bad --probe is refused at once: neither imports the
heavy libraries it does not need."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
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


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _imports(*argv: str) -> dict:
    """What ``autotune ARGV`` returned and imported, and its standard output."""
    out = _run(_PROBE, *argv)
    return {**json.loads(out.stderr.strip().splitlines()[-1]), "stdout": out.stdout}


def _cuda_driver_loads() -> bool:
    """Whether this machine has the NVIDIA driver: a CUDA build of torch finds GPUs through its libcuda.so.1."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@functools.cache
def _imported_by_torch() -> list[str]:
    """The heavy libraries that importing torch alone brings (a CUDA build of torch imports numpy)."""
    out = _run(f"import json, sys, torch; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    return json.loads(out.stdout)


def test_devices_imports_no_heavy_library():
    for argv in (["devices"], ["devices", "--json"]):
        seen = _imports(*argv)
        assert seen["code"] == 0
        # torch is needed only to ask torch.cuda for GPUs that NVML cannot see, with a torch built for GPUs
        # that could see one: a ROCm build, or a CUDA build where the NVIDIA driver is installed
        needs_torch = not seen["nvml"] and bool(torch.version.hip or (torch.version.cuda and _cuda_driver_loads()))
        assert seen["heavy"] == (_imported_by_torch() if needs_torch else []), argv


@pytest.mark.skipif(not torch.version.cuda, reason=f"torch {torch.__version__} is not a CUDA build: this test "
                    "holds what a CUDA build of torch (pip's default) does on a machine without a GPU")
@pytest.mark.skipif(_cuda_driver_loads(), reason="this machine has the NVIDIA driver (libcuda.so.1 loads): this test "
                    "holds a CUDA build of torch on a machine without one")
def test_a_cuda_build_of_torch_without_a_gpu_lists_devices_without_importing_torch():
    for argv in (["devices"], ["devices", "--json"]):
        seen = _imports(*argv)
        assert (seen["code"], seen["nvml"], seen["heavy"]) == (0, False, []), argv
        assert "the CUDA driver does not load (libcuda.so.1" in seen["stdout"], argv


def test_torch_is_asked_for_gpus_only_where_it_could_see_one(monkeypatch):
    from autotune import devices
    from autotune.devices.host import TorchBuild

    from ..devices.fakes import FakeCuda

    no_driver = "the CUDA driver does not load (libcuda.so.1: cannot open shared object file)"
    monkeypatch.setattr(devices, "cuda_driver_missing", lambda: no_driver)
    monkeypatch.setattr(devices, "torch_build", lambda: TorchBuild(version="2.14.1+cu130", gpu="cuda 13.0"))
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch now raises ImportError
    out = devices.list_devices(nvml=None)
    assert out["gpus"] == [] and out["notes"] == [f"no NVIDIA driver or GPU found (NVML not used; {no_driver}); "
                                                  "CUDA is not available to torch"]
    # where the driver loads, or torch was built for ROCm (no CUDA driver to look for), torch.cuda is asked
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=FakeCuda(count=2)))
    rocm = TorchBuild(version="2.14.1+rocm7.0", gpu="hip 7.0")
    for build, driver in ((rocm, no_driver), (TorchBuild(version="2.14.1+cu130", gpu="cuda 13.0"), "")):
        monkeypatch.setattr(devices, "torch_build", lambda build=build: build)
        monkeypatch.setattr(devices, "cuda_driver_missing", lambda driver=driver: driver)
        out = devices.list_devices(nvml=None)
        assert [g["name"] for g in out["gpus"]] == ["Fake H100"] * 2, build
        assert out["notes"] == ["NVML not used; GPU memory from torch.cuda.mem_get_info instead"]


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

    from ..devices.fakes import FakeNvml

    monkeypatch.setattr(devices, "torch_build", lambda: TorchBuild(version="2.13.0+cpu", gpu=None))
    out = devices.list_devices(nvml=FakeNvml(count=1))
    assert len(out["gpus"]) == 1 and out["torch"] == "2.13.0+cpu"
    assert out["notes"] == ["torch 2.13.0+cpu is a CPU-only build: it cannot use these GPUs; "
                            "install a CUDA build of torch"]
    monkeypatch.setattr(devices, "torch_build", lambda: TorchBuild(version="2.13.0", gpu="cuda 12.8"))
    assert devices.list_devices(nvml=FakeNvml(count=1))["notes"] == []
