"""Two-rank ``autotune run`` under torchrun, N times, beside CPU hogs: how many runs fail at the end.

    python bench/torchrun_teardown.py                            # 20 runs of docs/ranks.md's mlp command
    python bench/torchrun_teardown.py --commands mlp gpt repro   # + the padded GPT probe, the reproducer
    python bench/torchrun_teardown.py --runs 50 --hogs 0         # on a quiet machine

Each run is a two-rank command on gloo (``--standalone``, so that runs never
share a port with anything else on the machine). Busy-looping processes run
beside it the whole time (``--hogs``, default one per CPU), so the ranks'
threads are preempted at random points. A run fails when torchrun exits
non-zero or a rank prints ``terminate called without an active exception``:
a rank that finalized its interpreter while a communication thread still
needed the GIL, and aborted (SIGABRT) after its work was done.

Under load that race is rare for docs/ranks.md's command (about 1 run in 100).
``repro`` (tests/training/ddp_teardown.py) makes it the rule: the GIL handed over every
0.5 s, DDP training, then the rank finalizes right after its last collective;
a process group that leaves gloo's threads alive aborts most of its runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

from common import ROOT, machine

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
COMMANDS = {
    "mlp": ["-m", "autotune", "run", "--target-batch", "255", "--probe", "mlp", "--device", "cpu",
            "--memory-budget", "2.6MB"],
    "gpt": ["-m", "autotune", "run", "--target-batch", "64", "--probe", "gpt", "--device", "cpu",
            "--memory-budget", "16MB", "--steps", "5"],
    "repro": [os.path.join("tests", "training", "ddp_teardown.py"), "0.5"],
}
ABORT = "terminate called"


def _spin(parent: int) -> None:
    n = 0
    while True:
        n += 1
        if n % 2_000_000 == 0 and os.getppid() != parent:  # the bench is gone: stop
            return


def one_run(argv: list[str], timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
    start = time.monotonic()
    try:
        done = subprocess.run([*TORCHRUN, *argv], check=False, capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=ROOT)
        rc, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:
        raw = exc.stderr or b""
        rc, err = -9, raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        err += f"\n(timed out after {timeout:.0f} s)"
    return rc, time.monotonic() - start, err


def tell(err: str) -> str:
    """The line that says why a run failed."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    for key in (ABORT, "error:", "exitcode", "timed out"):
        for ln in lines:
            if key in ln:
                return ln[:160]
    return lines[-1][:160] if lines else "(no output)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="runs per command (default 20)")
    ap.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=["mlp"], metavar="NAME",
                    help="mlp: docs/ranks.md's command (default); gpt: the padded GPT probe; repro: the reproducer")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy-looping processes beside the runs")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    args = ap.parse_args()

    print(machine())
    print(f"# {args.runs} runs per command, {args.hogs} CPU hog process(es) beside them")
    hogs = [multiprocessing.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    rows, failures = [], []
    try:
        for name in args.commands:
            codes: Counter[int] = Counter()
            seconds, aborts = [], 0
            for i in range(args.runs):
                rc, s, err = one_run(COMMANDS[name], args.timeout)
                codes[rc] += 1
                seconds.append(s)
                aborted = ABORT in err
                aborts += aborted
                if rc != 0 or aborted:
                    failures.append((name, i + 1, rc, tell(err)))
                print(f"  {name} run {i + 1}/{args.runs}: exit {rc}, {s:.1f} s{' (abort)' if aborted else ''}",
                      file=sys.stderr, flush=True)
            failed = sum(1 for f in failures if f[0] == name)
            rows.append((name, args.runs, failed, aborts, ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())),
                         statistics.median(seconds), max(seconds)))
    finally:
        for h in hogs:
            h.terminate()
        for h in hogs:
            h.join()

    print()
    print("| command | runs | failures | aborts | exit codes (code: runs) | median s | max s |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, runs, failed, aborts, codes_text, med, worst in rows:
        print(f"| {name} | {runs} | {failed} | {aborts} | {codes_text} | {med:.1f} | {worst:.1f} |")
    for name, i, rc, line in failures:
        print(f"  {name} run {i}: exit {rc}: {line}")
    print()
    for name in rows:
        print(f"{name[0]}: torchrun --standalone --nproc-per-node 2 {' '.join(COMMANDS[name[0]])}")


if __name__ == "__main__":
    main()
