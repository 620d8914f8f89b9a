"""What ``--tune`` pays to time one candidate: autotune's step timer against ``torch.utils.benchmark.Timer``.

    python bench/step_timer.py [--reps 3] [--target 256] [--sizes 8 64 256] [--budget 5] [--hog]

For the built-in mlp on the CPU, one plan per micro-batch size (``--target`` samples a step), each timed
``--reps`` times by: autotune's ``time_plan`` (one warm-up step, then single steps until the interquartile
range is at most 5% of the median, at least 5 and at most 50 steps or ``--budget`` seconds), and
``torch.utils.benchmark.Timer`` over the same optimizer step, ``adaptive_autorange(threshold=0.05,
max_run_time=budget)`` and ``blocked_autorange(min_run_time=0.2)``, at the process's thread count (the
Timer's default is one thread). Each row: real optimizer steps run (warm-up and block-size estimation
included), wall seconds, the median seconds per step it reports, and that median's spread over the reps.
Run it beside a CPU hog (``--hog``) to see each on a noisy machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch
from common import machine
from torch.utils.benchmark import Timer

from autotune.devices import get_device
from autotune.devices.base import own_random_state
from autotune.planning import make_plan
from autotune.training.timing import Timing, _model, _Stepper, time_plan
from autotune.workload import load_workload


def _hog(stop: multiprocessing.synchronize.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--target", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--budget", type=float, default=5.0)
    parser.add_argument("--hog", action="store_true", help="run one busy process beside it")
    args = parser.parse_args()
    print(machine())
    stop = multiprocessing.Event()
    hog = multiprocessing.Process(target=_hog, args=(stop,), daemon=True) if args.hog else None
    if hog is not None:
        hog.start()
    workload, device = load_workload("mlp"), get_device("cpu")
    timing = Timing(budget_s=args.budget)
    print(f"{'micro-batch':>11} {'timer':<28} {'steps':>6} {'wall s':>7} {'median ms/step':>15} {'spread of it':>13}")
    try:
        for size in args.sizes:
            plan = make_plan(args.target, size)
            for name, measure in _timers(workload, device, plan, timing, args.budget).items():
                steps, walls, medians = [], [], []
                for _ in range(args.reps):
                    start = time.perf_counter()
                    count, median = measure()
                    walls.append(time.perf_counter() - start)
                    steps.append(count)
                    medians.append(median)
                spread = (max(medians) - min(medians)) / statistics.median(medians)
                print(f"{size:>11} {name:<28} {statistics.median(steps):>6.0f} {statistics.median(walls):>7.2f} "
                      f"{statistics.median(medians) * 1e3:>15.3f} {spread:>12.1%}")
    finally:
        stop.set()


def _timers(workload, device, plan, timing: Timing, budget: float) -> dict:
    def counted() -> tuple[_Stepper, list[int]]:
        stepper = _Stepper(workload, device, plan, *_model(workload, device), 0)
        calls = [0]
        step = stepper.step

        def counting() -> None:
            calls[0] += 1
            step()
        stepper.step = counting  # type: ignore[method-assign]
        return stepper, calls

    def ours() -> tuple[int, float]:
        samples = time_plan(workload, device, plan, timing=timing)
        return timing.warmup + len(samples.values), samples.median

    def torch_timer(how: str) -> tuple[int, float]:
        with own_random_state(device.torch_device, 0):
            stepper, calls = counted()
            timer = Timer("step()", globals={"step": stepper.step}, num_threads=torch.get_num_threads())
            if how == "adaptive":
                m = timer.adaptive_autorange(threshold=timing.threshold, max_run_time=budget)
            else:
                m = timer.blocked_autorange(min_run_time=0.2)
            return calls[0], m.median

    return {"autotune time_plan": ours,
            "torch adaptive_autorange": lambda: torch_timer("adaptive"),
            "torch blocked_autorange": lambda: torch_timer("blocked")}


if __name__ == "__main__":
    main()
