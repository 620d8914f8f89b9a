"""Accumulator under DDP when ranks hold batches of other sizes than the plan's: exact, in step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_ranks_with_uneven_batches_run_the_same_micro_steps_and_the_exact_gradient():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HERE / "ddp_uneven_worker.py")], capture_output=True, text=True, timeout=180,
                          env=env, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = json.loads(done.stdout)
    assert [r["micro_steps"] for r in reports] == [3, 3]  # the most any rank needs
    assert [r["samples"] for r in reports] == [37, 5] and {r["total_items"] for r in reports} == {42}
    assert max(r["error"] for r in reports) < 1e-6
