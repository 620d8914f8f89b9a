"""How long `autotune serve` takes to have a worker ready: at start, and to replace one it stopped.

    python bench/serve_workers.py              # 3 replacements per start method
    python bench/serve_workers.py --repeat 5

A worker is replaced after a job ran past ``--probe-timeout`` or after a probe
killed it; the request that follows waits for the new one. For each start
method (``spawn``: a fresh interpreter imports torch and autotune; ``forkserver``,
what the service uses: a fork of a process that imported them once), a pool of
one worker is started; then the time to the first answered job (the worker's
start, then a plan of mlp answered from the plan store) and, ``--repeat`` times,
the time to answer the same job right after the worker was stopped. Each
worker's resident memory (VmRSS) and proportional share (Pss, shared pages
divided among the processes that map them) are read from /proc once it has
answered.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import machine

import autotune.api
from autotune.serve import worker as workers
from autotune.serve.jobs import Job

JOB = {"kind": "plan", "probe": "mlp", "spec": "mlp", "target_batch": 512, "device": "estimate",
       "memory_budget": "1GiB", "world_size": 1, "parallel": "ddp", "margin": 0.1, "precision": "fp32",
       "multiple_of": 1, "uniform": False}


def memory_mib(pid: int) -> tuple[float, float]:
    """VmRSS and Pss of a process, in MiB."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    pss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
               if line.startswith("Pss:"))
    return rss / 1024, pss / 1024


def measure(method: str, store: str, repeat: int) -> dict[str, float]:
    workers.START_METHOD = method
    pool = workers.Pool(store, 1, timeout_s=600)
    start = time.perf_counter()
    pool.start()
    pool.run(Job(JOB, key="mlp"))
    first = time.perf_counter() - start
    rss, pss = memory_mib(pool.workers[0].process.pid)
    replaced = []
    for _ in range(repeat):
        pool.workers[0].stop()  # as after a timeout or a dead worker
        start = time.perf_counter()
        answer = pool.run(Job(JOB, key="mlp"))
        replaced.append(time.perf_counter() - start)
        assert answer["cached"]
    pool.stop()
    return {"first": first, "replaced": statistics.median(replaced), "rss": rss, "pss": pss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="replacements timed per start method (median shown)")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{Path(tmp) / 'plans.db'}"
        autotune.api.plan(JOB["target_batch"], probe="mlp", device="estimate", memory_budget="1GiB",
                          store=store)  # every job below is answered from the store
        rows = {method: measure(method, store, args.repeat) for method in ("spawn", "forkserver")}
    print(f"{'start method':<12} {'first answer s':>15} {'after a stop s':>15} {'worker RSS MiB':>15} "
          f"{'worker Pss MiB':>15}")
    for method, r in rows.items():
        print(f"{method:<12} {r['first']:>15.2f} {r['replaced']:>15.3f} {r['rss']:>15.0f} {r['pss']:>15.0f}")
    ratio = rows["spawn"]["replaced"] / rows["forkserver"]["replaced"]
    print(f"a replaced worker answers {ratio:.0f}x sooner with forkserver than with spawn")


if __name__ == "__main__":
    main()
