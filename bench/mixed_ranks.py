"""Mixed ranks against the smallest-for-all plan: samples per second of two unequal CPU ranks under torchrun.

    python bench/mixed_ranks.py                 # three cases (~2 min on 2 cores)
    python bench/mixed_ranks.py --rounds 9      # more rounds, a steadier median

Two ranks (gloo, one thread each) with unequal memory budgets, as on a job that
mixes a large and a small GPU: each workload is planned both ways from one
process (``--memory-budget A,B``, the CPU split balanced by memory):

- mixed: each rank its own micro-batch (its own probe's max) and micro-steps;
- uniform: ``--uniform-ranks``, every rank at the smaller rank's max micro-batch.

Then one torchrun job trains both plans with autotune's Accumulator under DDP,
without the memory tracker, on the same model and batch: rounds of ``--steps``
optimizer steps of each plan, the order alternating round by round so both see
the same load, with a barrier around each round (the step of the slowest rank
is the step). Each row: the plans (samples and micro-steps per rank), the
median samples per second over the rounds, and the ratio mixed / uniform with
its range over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = (  # workload, budget per rank, target batch
    ("mlp", ("8MiB", "2.5MB"), 512),  # small micro-batches: each micro-step's fixed cost dominates
    ("mlp", ("8MiB", "3MiB"), 1800),
    ("gpt", ("32MB", "8MB"), 96),  # compute grows with the samples: the rank with more of them sets the pace
)


def describe(plan) -> str:
    return " | ".join(f"{sum(row)} in {len(row)}" for row in plan.schedule)


def plan_both(workload: str, budgets: tuple[str, ...], target: int, folder: Path) -> tuple[Path, Path, str, str]:
    from autotune import api
    from autotune.serial import dumps

    mixed = api.plan(target, probe=workload, device="cpu", memory_budget=",".join(budgets))
    uniform = api.plan(target, probe=workload, device="cpu", memory_budget=",".join(budgets), uniform_ranks=True)
    paths = folder / f"{workload}-mixed.json", folder / f"{workload}-uniform.json"
    for path, plan in zip(paths, (mixed, uniform)):
        path.write_text(dumps(plan.to_dict()))
    return paths[0], paths[1], describe(mixed), describe(uniform)


def launch(workload: str, plans: tuple[Path, Path], rounds: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, "--worker", workload, str(plans[0]), str(plans[1]), str(rounds), str(steps)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise SystemExit(f"the torchrun job failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker(workload_name: str, paths: list[str], rounds: int, steps: int) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from autotune import Accumulator, load_plan
    from autotune.training import NoiseScale, distributed
    from autotune.training.distributed import rank_offsets
    from autotune.workload import load_workload

    wl = load_workload(workload_name)
    with distributed.process_group(600):
        import torch.distributed as dist

        rank = dist.get_rank()
        plans = [load_plan(p) for p in paths]
        torch.manual_seed(0)
        model = DistributedDataParallel(wl.make_model())
        opt = wl.optimizer(model.parameters())
        batch = wl.make_batch(plans[0].target_batch, torch.Generator().manual_seed(0))
        steppers = []
        for plan in plans:
            acc = Accumulator(model, opt, plan, loss=wl.loss, items=wl.items, parts=[NoiseScale(measure=False)])
            mine = wl.share(batch, rank_offsets(plan.per_rank_batch)[rank], plan.per_rank_batch[rank])
            steppers.append((acc, mine))
        for acc, mine in steppers:  # warm-up: both plans, twice
            acc.step(mine)
            acc.step(mine)
        rates: list[list[float]] = [[], []]
        for r in range(rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                acc, mine = steppers[which]
                dist.barrier()
                begin = time.perf_counter()
                for _ in range(steps):
                    acc.step(mine)
                dist.barrier()
                rates[which].append(plans[which].target_batch * steps / (time.perf_counter() - begin))
        if rank == 0:
            print(json.dumps({"mixed": rates[0], "uniform": rates[1]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each plan")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per round")
    parser.add_argument("--worker", nargs=5, metavar=("WORKLOAD", "MIXED", "UNIFORM", "ROUNDS", "STEPS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, mixed, uniform, rounds, steps = args.worker
        worker(name, [mixed, uniform], int(rounds), int(steps))
        return
    from common import machine

    print(machine())
    print(f"# 2 CPU ranks under torchrun (gloo, 1 thread each); {args.rounds} rounds of {args.steps} steps per plan")
    print(f"{'workload':>8} {'budgets':>11} {'target':>6}  {'mixed: samples in micro-steps':>30}  "
          f"{'uniform ranks':>22}  {'mixed/s':>8} {'uniform/s':>9} {'ratio (range)':>18}")
    with tempfile.TemporaryDirectory(prefix="mixed-bench-") as tmp:
        for workload, budgets, target in CASES:
            mixed, uniform, shown_mixed, shown_uniform = plan_both(workload, budgets, target, Path(tmp))
            rates = launch(workload, (mixed, uniform), args.rounds, args.steps)
            ratios = [a / b for a, b in zip(rates["mixed"], rates["uniform"])]
            print(f"{workload:>8} {','.join(budgets):>11} {target:>6}  {shown_mixed:>30}  {shown_uniform:>22}  "
                  f"{statistics.median(rates['mixed']):>8.0f} {statistics.median(rates['uniform']):>9.0f} "
                  f"{statistics.median(ratios):>7.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
