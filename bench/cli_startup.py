"""Wall and CPU time of the commands: those that should answer at once (``autotune --help``, ``autotune
devices``), and those that train or estimate, as the command and as ``main(argv)`` called in a fresh
interpreter.

    python bench/cli_startup.py [--reps 5]

Each command runs ``--reps`` times in a fresh interpreter, the commands taking
turns; the table gives the median and the slowest wall time and the median CPU
time (user + system). ``import torch`` is the yardstick: ``devices`` answers
from NVML and /proc and should take a fraction of it (target: under 2 s). The
command run as ``autotune`` freezes what its imports made (``gc.freeze()``);
called as ``main(argv)`` it leaves the interpreter's collector as it was, so
the pair shows what the freeze saves.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

from common import machine

AS_FUNCTION = [sys.executable, "-c", "import sys; from autotune.cli import main; sys.exit(main(sys.argv[1:]))"]
RUN = ["run", "--target-batch", "255", "--probe", "mlp", "--device", "cpu", "--memory-budget", "2.6MB", "--steps", "3",
       "--quiet"]
PLAN = ["plan", "--target-batch", "1024", "--device", "estimate", "--memory-budget", "80GiB", "--quiet"]
COMMANDS = {
    "autotune --help": [sys.executable, "-m", "autotune", "--help"],
    "autotune devices": [sys.executable, "-m", "autotune", "devices"],
    "autotune devices --json": [sys.executable, "-m", "autotune", "devices", "--json"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "autotune run (mlp, 3 steps)": [sys.executable, "-m", "autotune", *RUN],
    "  run as main(argv)": [*AS_FUNCTION, *RUN],
    "autotune plan (gpt, estimate)": [sys.executable, "-m", "autotune", *PLAN],
    "  plan as main(argv)": [*AS_FUNCTION, *PLAN],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(machine())
    walls: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpus: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for rep in range(args.reps):
        print(f"round {rep + 1} of {args.reps}", file=sys.stderr, flush=True)
        for name, argv in COMMANDS.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            walls[name].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    print(f"{'command':<30} {'median s':>9} {'max s':>7} {'CPU s':>7}")
    for name in COMMANDS:
        print(f"{name:<30} {statistics.median(walls[name]):>9.2f} {max(walls[name]):>7.2f} "
              f"{statistics.median(cpus[name]):>7.2f}")

if __name__ == "__main__":
    main()
