"""A reader that stops early (``autotune plan ... | head -1``) ends autotune quietly, as it ends Unix tools."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PIPE_CLOSED_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a tool that a closed pipe stopped
MLP = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB", "--quiet"]


def _env(buffered: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


def _closed_reader(argv: list[str], *, buffered: bool) -> tuple[int, str]:
    """Run autotune with its stdout a pipe whose read end is already closed: (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "autotune", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(buffered))
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=120), err


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_devices_into_a_closed_pipe_ends_quietly(buffered):
    code, err = _closed_reader(["devices"], buffered=buffered)
    assert err == "" and code == PIPE_CLOSED_EXIT


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_plan_into_a_closed_pipe_ends_quietly(fmt):
    code, err = _closed_reader(["plan", "--target-batch", "1021", *MLP, "--format", fmt], buffered=True)
    assert err == "" and code == PIPE_CLOSED_EXIT


@pytest.mark.slow
def test_a_closed_pipe_still_reports_real_errors_first(tmp_path):
    code, err = _closed_reader(["plan", "--target-batch", "64", "--probe", str(tmp_path / "none.py")], buffered=True)
    assert code == 2 and "does not exist" in err and "BrokenPipe" not in err
