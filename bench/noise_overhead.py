"""What measuring the gradient noise scale costs a training step: a hand-written accumulation loop with and
without GradientNoiseScale's hooks.

    python bench/noise_overhead.py             # a few minutes on 2 cores
    python bench/noise_overhead.py --threads 1 --reps 300

Same workloads, schedules and hand loop as bench/runner_overhead.py; two copies of one initialisation, the
same data, run interleaved (A B C D, then B C D A, ...) so machine noise hits all alike; figures are medians of
wall time and of the process's CPU time (steadier on a shared machine: it does not count waiting). The
measured loop makes the calls the Accumulator makes: begin_step, one micro_step around each backward,
end_step (one norm of the accumulated gradient). Target: throughput with the measurement >= 0.97 x without.
A second plain loop ('A/A') shows how far two identical loops differ here: the resolution of the figures.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from common import machine
from runner_overhead import CASES, REPS, hand_step
from torch.utils._pytree import tree_map

from autotune.training.noise import GradientNoiseScale
from autotune.workload import load_workload

TARGET = 0.97
EVERY = 4  # the third loop measures every 4th step only


def noisy_step(model, opt, batch, sizes, loss_fn, count, noise: GradientNoiseScale) -> float:
    """hand_step with the noise scale measured."""
    micros, start = [], 0
    for n in sizes:
        micros.append(tree_map(lambda t, s=start, n=n: t[s:s + n], batch))
        start += n
    counts = [count(m) for m in micros]
    total = sum(counts)
    running = torch.zeros(())
    noise.begin_step(total)
    for micro, n in zip(micros, counts):
        loss = loss_fn(model, micro) * (n / total)
        with noise.micro_step(n, n / total):
            loss.backward()
        running += loss.detach()
    noise.end_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(running)


def measure(name: str, sizes: list[int], reps: int, warmup: int = 3) -> dict:
    workload = load_workload(name)
    torch.manual_seed(0)
    base = workload.model()
    models = {k: copy.deepcopy(base) for k in ("plain", "again", "noise", "every")}
    opts = {k: workload.optimizer(m.parameters()) for k, m in models.items()}
    noise = GradientNoiseScale(models["noise"].parameters())
    sampled = GradientNoiseScale(models["every"].parameters(), every=EVERY)
    count = workload.count_items
    generator = torch.Generator().manual_seed(1)
    steps = {
        "plain": lambda b: hand_step(models["plain"], opts["plain"], b, sizes, workload.loss, count),
        "again": lambda b: hand_step(models["again"], opts["again"], b, sizes, workload.loss, count),
        "noise": lambda b: noisy_step(models["noise"], opts["noise"], b, sizes, workload.loss, count, noise),
        "every": lambda b: noisy_step(models["every"], opts["every"], b, sizes, workload.loss, count, sampled),
    }
    order = list(steps)
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(warmup + reps):
        batch = workload.batch(sum(sizes), generator)
        for k in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[k](batch)
            if rep >= warmup:
                wall[k].append(time.perf_counter() - start)
                cpu[k].append(time.process_time() - start_cpu)
        order = order[1:] + order[:1]  # rotate: A B C, B C A, C A B, ...
    return {"name": name, "sizes": sizes, "reps": reps, "params": len(noise.params),
            "wall": {k: statistics.median(v) for k, v in wall.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()},
            "paired": statistics.median(p / n for p, n in zip(wall["plain"], wall["noise"])),
            "paired_cpu": statistics.median(p / n for p, n in zip(cpu["plain"], cpu["noise"])),
            "paired_every": statistics.median(p / n for p, n in zip(cpu["plain"], cpu["every"])),
            "paired_again": statistics.median(p / n for p, n in zip(cpu["plain"], cpu["again"])),
            "b_simple": noise.b_simple, "steps": noise.steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions per case")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = machine()
    rows = [measure(name, sizes, args.reps or REPS[name]) for name, sizes in CASES]

    print(started)
    print(f"# noise scale overhead: torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}; medians of interleaved repetitions; wall ms and CPU ms per step")
    print("# plain = bench/runner_overhead.py's hand loop; noise = the same loop measuring the noise scale every")
    print(f"#   step; every {EVERY} = measuring every {EVERY}th step (GradientNoiseScale(every={EVERY}))")
    print("# ratio = time(plain) / time(noise), the throughput kept: target >= 0.97. 'paired' is the median of")
    print("#   per-repetition ratios (the steps ran back to back); the verdict uses the CPU-time one of 'noise';")
    print("#   A/A = plain vs a second plain loop: how far from 1.000 identical loops land on this machine now")
    header = (f"{'workload':<8} {'schedule':<16} {'params':>6} {'reps':>4} {'plain ms':>9} {'noise ms':>9} "
              f"{'paired':>6} {'plain cpu':>9} {'noise cpu':>9} {'paired':>6} {f'every {EVERY}':>8} {'A/A':>6} "
              f"{'B_simple':>9}  target")
    print(header)
    print("-" * len(header))
    verdicts = []
    for r in rows:
        ok = r["paired_cpu"] >= TARGET
        verdicts.append(ok)
        b = f"{r['b_simple']:.3g}" if r["b_simple"] is not None else "-"
        w, c = r["wall"], r["cpu"]
        print(f"{r['name']:<8} {'+'.join(map(str, r['sizes'])):<16} {r['params']:>6} {r['reps']:>4} "
              f"{1e3 * w['plain']:>9.2f} {1e3 * w['noise']:>9.2f} {r['paired']:>6.3f} "
              f"{1e3 * c['plain']:>9.2f} {1e3 * c['noise']:>9.2f} {r['paired_cpu']:>6.3f} {r['paired_every']:>8.3f} {r['paired_again']:>6.3f} "
              f"{b:>9}  {'holds' if ok else 'MISSED'}")
    print()
    print(f"target (throughput >= {TARGET} x without): "
          f"{'holds in every case' if all(verdicts) else 'MISSED in ' + str(verdicts.count(False)) + ' case(s)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
