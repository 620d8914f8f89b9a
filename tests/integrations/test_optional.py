"""The frameworks stay optional: autotune, its API and autotune.integrations import none of them."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_importing_autotune_imports_no_framework():
    code = ("import sys, autotune, autotune.api, autotune.integrations, autotune.integrations.common\n"
            "autotune.Accumulator, autotune.Workload\n"
            "loaded = sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') "
            "if m in sys.modules)\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
