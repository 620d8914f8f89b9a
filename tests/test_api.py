"""The public API: every exported name resolves, and submodules never shadow it."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import autotune


def test_every_exported_name_resolves():
    for name in autotune.__all__:
        assert getattr(autotune, name) is not None, name


def test_submodules_do_not_shadow_exported_functions():
    for info in pkgutil.walk_packages(autotune.__path__, "autotune."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    for name in ("probe", "plan", "run", "make_plan", "load_workload", "get_device", "write_report"):
        assert callable(getattr(autotune, name)) and not isinstance(getattr(autotune, name), type(autotune)), name


def test_import_is_light():
    code = "import autotune, sys; assert 'torch' not in sys.modules; print(len(autotune.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
