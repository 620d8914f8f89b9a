"""What every benchmark prints first: when, on what, at which commit (so regressions are visible)."""

from __future__ import annotations

import datetime
import os
import subprocess

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "autotune", "probes"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "unknown") + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"# {now}; {cpu_model()} x {os.cpu_count()} CPUs; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; autotune at {commit()}")
