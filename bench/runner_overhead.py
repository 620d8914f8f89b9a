"""What autotune's Accumulator costs over a hand-written accumulation loop, and over one full batch;
and what measuring the gradient noise scale (on by default) costs the Accumulator.

    python bench/runner_overhead.py             # about a minute on 2 cores
    python bench/runner_overhead.py --reps 100

Same model (three copies of one initialisation), same data, same schedule; the
loss of micro-batch i weighted n_i / N in both loops; no tracker anywhere. The
three steps run interleaved (A B C, then B C A, ...) so machine noise hits all
of them alike; figures are medians. Targets: throughput of the Accumulator (noise
scale off) >= 0.97 x the hand loop's, and with the noise scale on >= 0.97 x off.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from common import machine
from torch.utils._pytree import tree_map

from autotune.training.accumulate import Accumulator, split_batch
from autotune.training.noise import NoiseScale
from autotune.workload import load_workload

TARGET = 0.97

# (workload, effective batch, schedule): uniform and uneven (sizes differ by 1) schedules.
CASES = [
    ("mlp", [8, 8, 8, 8]),  # tiny micro-batches: the fixed cost per step shows
    ("mlp", [256, 256, 256, 256]),
    ("mlp", [256, 255, 255, 255]),
    ("gpt", [16, 16, 16, 16]),
    ("gpt", [16, 15, 15, 15]),
    ("gpt-wide", [4, 4, 4, 4]),  # wider layers: the noise scale's fixed cost per gradient matters less
]
REPS = {"mlp": 150, "gpt": 30, "gpt-wide": 10}


def load(name: str):
    if name != "gpt-wide":
        return load_workload(name)
    from autotune.probes import gpt

    return gpt._workload("gpt-wide", gpt.Config(vocab=4096, seq_len=128, d_model=256, heads=4, layers=4, min_len=64))


def hand_step(model, opt, batch, sizes, loss_fn, count) -> float:
    """The accumulation loop a careful person writes by hand."""
    micros, start = [], 0
    for n in sizes:
        micros.append(tree_map(lambda t, s=start, n=n: t[s:s + n], batch))
        start += n
    counts = [count(m) for m in micros]
    total = sum(counts)
    running = torch.zeros(())
    for micro, n in zip(micros, counts):
        loss = loss_fn(model, micro) * (n / total)
        loss.backward()
        running += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(running)


def full_step(model, opt, batch, loss_fn) -> float:
    """One batch of all N samples: no accumulation."""
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure(name: str, sizes: list[int], reps: int, warmup: int = 3) -> dict:
    workload = load(name)
    torch.manual_seed(0)
    base = workload.model()
    models = {k: copy.deepcopy(base) for k in ("autotune", "every4", "quiet", "hand", "full")}
    opts = {k: workload.optimizer(m.parameters()) for k, m in models.items()}
    acc = Accumulator(models["autotune"], opts["autotune"], sizes, loss=workload.loss, items=workload.items)
    quiet = Accumulator(models["quiet"], opts["quiet"], sizes, loss=workload.loss, items=workload.items,
                        parts=[NoiseScale(measure=False)])
    every4 = Accumulator(models["every4"], opts["every4"], sizes, loss=workload.loss, items=workload.items,
                         parts=[NoiseScale(every=4)])
    count = workload.count_items
    n = sum(sizes)
    generator = torch.Generator().manual_seed(1)
    steps = {
        "autotune": lambda b: acc(b),
        "quiet": lambda b: quiet(b),
        "every4": lambda b: every4(b),
        "hand": lambda b: hand_step(models["hand"], opts["hand"], b, sizes, workload.loss, count),
        "full": lambda b: full_step(models["full"], opts["full"], b, workload.loss),
    }
    order = list(steps)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(warmup + reps):
        batch = workload.batch(n, generator)
        for k in order:
            start = time.perf_counter()
            steps[k](batch)
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[k].append(elapsed)
        order = order[1:] + order[:1]  # rotate: A B C, B C A, C A B, ...
    med = {k: statistics.median(v) for k, v in times.items()}
    # Paired: hand / autotune within each repetition (run back to back), then the median.
    med["paired"] = statistics.median(h / a for h, a in zip(times["hand"], times["quiet"]))
    med["noise"] = statistics.median(q / a for q, a in zip(times["quiet"], times["autotune"]))
    med["noise4"] = statistics.median(q / a for q, a in zip(times["quiet"], times["every4"]))
    # Sanity: the same schedule split the same way (the Accumulator's split vs the hand loop's).
    assert [len(m[0]) if isinstance(m, tuple) else len(next(iter(m.values()))) for m in
            split_batch(workload.batch(n, generator), sizes)] == sizes
    return {"name": name, "sizes": sizes, "n": n, "reps": reps, **med,
            "q": {k: statistics.quantiles(v, n=4) for k, v in times.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions per case")
    args = parser.parse_args(argv)
    started = machine()
    rows = [measure(name, sizes, args.reps or REPS[name]) for name, sizes in CASES]

    print(started)
    print(f"# runner overhead: torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}; medians of interleaved repetitions, no tracker")
    print("# autotune = autotune.Accumulator with the noise scale measured (the default); quiet = the same with")
    print("#   NoiseScale(measure=False); hand = a hand-written loop with the same schedule and n_i/N weights;")
    print("#   full = one forward/backward of all N samples (it fits here)")
    print("# 'paired' = median of per-repetition time(hand) / time(quiet) (run back to back): target >= 0.97;")
    print("# 'noise' = median of per-repetition time(quiet) / time(autotune): the noise scale's cost, goal >= 0.97;")
    print("#   'noise/4' the same measuring every 4th step (GradientNoiseScale(..., every=4))")
    header = (f"{'workload':<8} {'schedule':<16} {'reps':>4} {'autotune ms':>11} {'quiet ms':>8} {'hand ms':>9} "
              f"{'full ms':>9} {'paired':>6} {'noise':>6} {'noise/4':>7} {'time quiet/full':>15} {'hand/full':>9}  "
              "targets")
    print(header)
    print("-" * len(header))
    verdicts = []
    for r in rows:
        ok, noise_ok = r["paired"] >= TARGET, r["noise"] >= TARGET
        verdicts.append(ok and noise_ok)
        print(f"{r['name']:<8} {'+'.join(map(str, r['sizes'])):<16} {r['reps']:>4} {1e3 * r['autotune']:>11.2f} "
              f"{1e3 * r['quiet']:>8.2f} {1e3 * r['hand']:>9.2f} {1e3 * r['full']:>9.2f} {r['paired']:>6.3f} "
              f"{r['noise']:>6.3f} {r['noise4']:>7.3f} {r['quiet'] / r['full']:>15.3f} {r['hand'] / r['full']:>9.3f}  "
              f"{'runner holds' if ok else 'runner MISSED'}, {'noise holds' if noise_ok else 'noise MISSED'}")
    print()
    print("interquartile ranges (ms), autotune | quiet | hand | full:")
    for r in rows:
        q = r["q"]
        print(f"  {r['name']:<4} {'+'.join(map(str, r['sizes'])):<16} "
              + " | ".join(f"{1e3 * q[k][0]:.2f}-{1e3 * q[k][2]:.2f}" for k in ("autotune", "quiet", "hand", "full")))
    print()
    print(f"targets (throughput >= {TARGET} x the hand loop, noise scale >= {TARGET} x without): "
          f"{'holds in every case' if all(verdicts) else 'MISSED in ' + str(verdicts.count(False)) + ' case(s)'}")
    print("time auto/full > 1 is the price of accumulating at all (k smaller kernels instead of one), "
          "not of autotune: compare the hand loop's hand/full the same way")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
