"""An estimate run that fails prints autotune's one-line error, not torch's FakeTensorMode log with a traceback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

FAKE_LOGGER = "torch._subclasses.fake_tensor"

SHAPE_BUG = """
    import torch
    from autotune import Workload

    def build():
        return Workload(name="shape-bug", model=lambda: torch.nn.Linear(4, 2),
                        batch=lambda n, g: torch.randn(n, 5, generator=g), loss=lambda m, b: m(b).pow(2).mean())
"""


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["meta", "fake"])
def test_a_failing_estimate_prints_one_line(tmp_path, engine):
    probe = tmp_path / "shape_bug.py"
    probe.write_text(textwrap.dedent(SHAPE_BUG))
    done = subprocess.run([sys.executable, "-m", "autotune", "probe", "--probe", str(probe), "--device", "estimate",
                           "--memory-budget", "1GiB", "--quiet"], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "AUTOTUNE_ESTIMATE_ENGINE": engine})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and done.stdout == ""
    expected = "autotune probe: error: cannot estimate workload 'shape-bug'"
    assert len(lines) == 1 and lines[0].startswith(expected), done.stderr
    assert "must have same reduction dim" in lines[0]


def test_torch_logging_is_back_as_it_was_after_an_estimate(tmp_path):
    from autotune.devices import EstimateDevice
    from autotune.errors import EstimateUnavailable
    from autotune.probing.finder import find_max_micro_batch
    from autotune.workload import load_workload

    path = tmp_path / "shape_bug.py"
    path.write_text(textwrap.dedent(SHAPE_BUG))
    logger = logging.getLogger(FAKE_LOGGER)
    before = (logger.disabled, list(logger.filters), logger.level)
    with pytest.raises(EstimateUnavailable):
        find_max_micro_batch(load_workload(str(path)), EstimateDevice.for_gpu(2**30))
    assert (logger.disabled, list(logger.filters), logger.level) == before


def test_fake_tensor_logs_outside_autotune_are_left_alone(caplog):
    with caplog.at_level(logging.ERROR, logger=FAKE_LOGGER), pytest.raises(RuntimeError), FakeTensorMode():
        torch.empty(2, 5) @ torch.empty(4, 2)
    assert any("failed while attempting to run meta" in r.getMessage() for r in caplog.records)
