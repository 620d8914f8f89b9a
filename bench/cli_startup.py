"""Wall time of the commands that should answer at once: ``autotune --help`` and ``autotune devices``.

    python bench/cli_startup.py [--reps 5]

Each command runs ``--reps`` times in a fresh interpreter; the table gives the
median and the slowest. ``import torch`` is the yardstick: ``devices`` answers
from NVML and /proc and should take a fraction of it (target: under 2 s).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import machine

COMMANDS = {
    "autotune --help": [sys.executable, "-m", "autotune", "--help"],
    "autotune devices": [sys.executable, "-m", "autotune", "devices"],
    "autotune devices --json": [sys.executable, "-m", "autotune", "devices", "--json"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(machine())
    print(f"{'command':<28} {'median s':>9} {'max s':>7}")
    for name, argv in COMMANDS.items():
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times.append(time.perf_counter() - start)
        print(f"{name:<28} {statistics.median(times):>9.2f} {max(times):>7.2f}", flush=True)


if __name__ == "__main__":
    main()
