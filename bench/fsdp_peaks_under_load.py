"""The FSDP fit rule on two gloo ranks under torchrun, beside CPU hogs: how many measured peaks are off.

    python bench/fsdp_peaks_under_load.py                          # 10 jobs x 5 measurements, 4 hogs
    python bench/fsdp_peaks_under_load.py --jobs 4 --per-job 10 --hogs 2

Each job is a two-rank torchrun (``--standalone``, one intra-op thread per
rank) of this script in worker mode: every rank measures the gpt workload's
FSDP fit rule at micro-batch 6 on the real process group, ``--per-job``
times. Busy-looping processes run beside the jobs the whole time, so the
ranks' threads (gloo's among them) are preempted at random points. A
measurement is off when a rank's peak differs from the one-process estimate
of that rank (a fake process group, computed here first): the tracker counts
live tensor storage exactly, so the two are equal unless a buffer lived longer
in one run than in another. Before FSDP's collectives on gloo ran on copies
(autotune/probing/fsdpcomm.py), an all-gather output that gloo's worker thread
released late was still alive at the peak in about one measurement in ten
here (one gpt block's unsharded parameters, 199,936 bytes, on one rank).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

from common import ROOT, machine

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
BATCH = 6


def _spin(parent: int) -> None:
    n = 0
    while True:
        n += 1
        if n % 2_000_000 == 0 and os.getppid() != parent:  # the bench is gone: stop
            return


def worker(times: int) -> None:
    """One rank of a job: ``times`` measurements; rank 0 prints every rank's peaks, one list per measurement."""
    from autotune.devices import get_device
    from autotune.probing.fitrule import fit_rule_work
    from autotune.probing.fsdp import Sharding
    from autotune.training import distributed
    from autotune.workload import load_workload

    with distributed.process_group(120):
        rank, world = distributed.rank(), distributed.world_size()
        gpt, cpu = load_workload("gpt"), get_device("cpu")
        rule = Sharding(world, rank, real_group=True)
        peaks = [cpu.measure(fit_rule_work(gpt, BATCH, sharding=rule), enforce_capacity=False)[1].peak_bytes
                 for _ in range(times)]
        every = [distributed.gather_ints(p) for p in peaks]
        if rank == 0:
            print(json.dumps(every), flush=True)
    sys.stdout.flush()
    os._exit(0)  # as ``autotune run`` ends a rank: no finalization beside gloo's threads


def estimates() -> list[int]:
    """Each rank's peak by the one-process estimate (a fake process group)."""
    from autotune.devices import get_device
    from autotune.probing.fitrule import fit_rule_work
    from autotune.probing.fsdp import Sharding, fake_engine
    from autotune.workload import load_workload

    estimate = fake_engine(get_device("cpu").estimator())
    gpt = load_workload("gpt")
    return [estimate.measure(fit_rule_work(gpt, BATCH, sharding=Sharding(2, r)))[1].peak_bytes for r in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10, help="torchrun jobs (default 10)")
    ap.add_argument("--per-job", type=int, default=5, help="measurements per job (default 5)")
    ap.add_argument("--hogs", type=int, default=4, help="busy-looping processes beside the jobs (default 4)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a job counts as hung")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return

    print(machine())
    expected = estimates()
    print(f"# {args.jobs} jobs x {args.per_job} measurements, {args.hogs} CPU hog process(es); "
          f"estimated peaks per rank {expected}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
    hogs = [multiprocessing.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    measured, off, failed, seconds = 0, [], 0, []
    try:
        for job in range(args.jobs):
            start = time.monotonic()
            try:
                done = subprocess.run([*TORCHRUN, os.path.abspath(__file__), "--worker", str(args.per_job)],
                                      check=False, capture_output=True, text=True, timeout=args.timeout, env=env,
                                      cwd=ROOT)
                lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
            except subprocess.TimeoutExpired:
                lines = []
            seconds.append(time.monotonic() - start)
            if not lines:
                failed += 1
                print(f"  job {job + 1}/{args.jobs}: failed ({seconds[-1]:.0f} s)", file=sys.stderr, flush=True)
                continue
            runs = json.loads(lines[-1])
            measured += len(runs)
            wrong = [peaks for peaks in runs if peaks != expected]
            off += wrong
            print(f"  job {job + 1}/{args.jobs}: {len(wrong)} of {len(runs)} off {wrong} ({seconds[-1]:.0f} s)",
                  file=sys.stderr, flush=True)
    finally:
        for h in hogs:
            h.terminate()
        for h in hogs:
            h.join()

    print()
    print("| measurements | off | jobs failed | seconds per job (median) |")
    print("|---:|---:|---:|---:|")
    print(f"| {measured} | {len(off)} | {failed} | {sorted(seconds)[len(seconds) // 2]:.0f} |")
    for peaks in off:
        print(f"  off: {peaks} (by {[p - e for p, e in zip(peaks, expected)]} bytes)")


if __name__ == "__main__":
    main()
