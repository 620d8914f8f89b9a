"""Does growing the batch with the measured noise scale pay? Samples and optimizer steps to reach a loss, and the
loss after a fixed number of samples, for a fixed target batch, a fixed smallest batch, and autotune's ramp
(with each learning-rate rule), over seeds.

    python bench/batch_ramp.py                  # about 1.5 minutes on 2 cores
    python bench/batch_ramp.py --seeds 5 --only regression

Two tasks that train to a loss, on the CPU, through autotune's own path for a plain loop (an
``autotune.Accumulator`` over a plan, ``autotune.RampConfig`` for the ramp, its sampler for the loader); the
memory limit is given (micro-batches of at most ``M``), no probe and no tracker:

- ``regression``: y = x.w* + noise, x ~ N(0, S^2) with S^2 = diag(1, 1/2, ..., 1/64), from a model far away
  (every weight 3 off), SGD with the rate tuned for the target batch; the loss is the population loss
  0.5 (|S (w - w*)|^2 + noise^2), exactly.
- ``digits``: scikit-learn's handwritten digits (1797 8x8 images, shipped with the package), an MLP
  64-128-10 with AdamW at the rate tuned for the target batch; the loss is the cross-entropy over the
  whole training split (1437 images), after every step.

Every run of a task gets the same budget of samples. ``fixed target`` trains at the target batch with the
user's rate; ``fixed smallest`` at the ramp's start (M + 1) with the rate scaled by a rule that needs no
measurement; ``ramp`` starts there and grows with the measured noise scale, each phase an exact plan, the rate
scaled by the rule named. Figures are means over the seeds with their standard deviation; "-" where a run did
not reach the loss within the budget (the count says how many did).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import machine
from torch import nn

import autotune
from autotune.planning.planner import make_plan
from autotune.planning.ramp import lr_scale
from autotune.training.noise import NoiseScale
from autotune.training.sampler import PlanSampler

M = 32          # the memory limit: micro-batches of at most 32 samples
TARGET = 512    # the target effective batch the user tuned the rate for


@dataclass(frozen=True)
class Task:
    name: str
    budget: int                      # samples per run
    goal: float                      # the loss every configuration is timed to
    make: Callable[..., tuple]       # (seed, lr) -> (model, optimizer, loss fn, evaluate(), dataset or None, batch)
    rates: tuple[float, ...]         # the grid --tune-lr tries at the target batch (the default rate is its best)


# -- the tasks -------------------------------------------------------------------------------------------


def regression(seed: int, lr: float = 1.8):
    d, noise = 64, 1.0
    scales = torch.arange(1, d + 1, dtype=torch.float32).rsqrt()  # feature variances 1 .. 1/64
    g = torch.Generator().manual_seed(1000 + seed)
    w_star = torch.randn(d, generator=g)
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + 3.0).unsqueeze(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def loss(m: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return 0.5 * (m(x).squeeze(-1) - y).pow(2).mean()

    def evaluate() -> float:
        with torch.no_grad():
            return 0.5 * (float(((model.weight[0] - w_star) * scales).pow(2).sum()) + noise ** 2)

    def batch(n: int, gen: torch.Generator):
        x = torch.randn(n, d, generator=gen) * scales
        return x, x @ w_star + noise * torch.randn(n, generator=gen)

    return model, optimizer, loss, evaluate, None, batch


def digits(seed: int, lr: float = 0.03):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(7))  # one split for every seed
    train = order[:1437]
    xs, ys = x[train], y[train]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def loss(m: nn.Module, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    def evaluate() -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(xs), ys))

    return model, optimizer, loss, evaluate, torch.utils.data.TensorDataset(xs, ys), None


TASKS = {
    "regression": Task("regression", budget=40_000, goal=0.6, make=regression, rates=(0.5, 1.0, 1.5, 1.8, 2.0)),
    "digits": Task("digits", budget=60_000, goal=0.05, make=digits, rates=(1e-3, 3e-3, 1e-2, 3e-2, 1e-1)),
}

# (label, ramp?, batch of a fixed run or None, learning-rate rule)
CONFIGS = [
    ("fixed target", False, TARGET, "none"),
    ("fixed smallest", False, M + 1, "none"),
    ("fixed smallest", False, M + 1, "linear"),
    ("fixed smallest", False, M + 1, "sqrt"),
    ("ramp", True, None, "noise"),
    ("ramp", True, None, "linear"),
    ("ramp", True, None, "sqrt"),
    ("ramp", True, None, "none"),
]


# -- one run ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    losses: list[float]          # after every step
    samples: list[int]           # samples seen after every step
    final_batch: int
    phases: int
    seconds: float


def run(task: Task, seed: int, ramp: bool, batch: int | None, rule: str, lr: float | None = None) -> Run:
    model, optimizer, loss, evaluate, dataset, make_batch = task.make(seed) if lr is None else task.make(seed, lr)
    plan = make_plan(TARGET, M)
    if ramp:
        step = autotune.Accumulator(model, optimizer, plan, loss=loss, parts=[autotune.RampConfig(lr_scaling=rule)])
        size = lambda: step.ramp.effective_batch  # noqa: E731
    else:
        assert batch is not None
        fixed = make_plan(batch, M) if batch != TARGET else plan
        step = autotune.Accumulator(model, optimizer, fixed, loss=loss, parts=[NoiseScale(measure=False)])
        scale = lr_scale(rule, batch=batch, target=TARGET, noise_scale=None)
        for group in optimizer.param_groups:
            group["lr"] *= scale
        size = lambda: batch  # noqa: E731
    losses, samples, seen = [], [], 0
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    epoch = 0
    while seen < task.budget:
        if dataset is None:
            batches = iter(lambda: make_batch(size(), gen), None)
        else:
            sampler = step.ramp.sampler(len(dataset), seed=seed) if ramp else PlanSampler(len(dataset), fixed,
                                                                                          seed=seed)
            sampler.set_epoch(epoch)
            batches = iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler))
            epoch += 1
        for b in batches:
            step(b)
            seen += len(b[1])
            losses.append(evaluate())
            samples.append(seen)
            if seen >= task.budget:
                break
    final = step.ramp.effective_batch if ramp else batch
    return Run(losses, samples, final, len(step.ramp.phases) if ramp else 1, time.perf_counter() - start)


def to_goal(r: Run, goal: float) -> tuple[int, int] | None:
    """(samples, optimizer steps) when the loss first reached ``goal``."""
    for i, value in enumerate(r.losses):
        if value <= goal:
            return r.samples[i], i + 1
    return None


# -- the table -------------------------------------------------------------------------------------------


def fmt(values: list[float], digits: int = 0) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    if digits:
        return f"{mean:.{digits}f} ± {spread:.{digits}f}"
    return f"{mean:,.0f} ± {spread:,.0f}"


def tune_lr(names: list[str], seeds: int) -> None:
    """The rate tuned for the target batch: the grid's rate that reaches the goal in the fewest samples."""
    print(f"# the fixed target batch ({TARGET}) at each rate of the grid; {seeds} seeds")
    for name in names:
        task = TASKS[name]
        print(f"\n## {name}: loss goal {task.goal}, budget {task.budget:,} samples")
        print(f"{'rate':>8} {'samples to goal':>18} {'n':>3} {'final loss':>17}")
        for lr in task.rates:
            runs = [run(task, seed, False, TARGET, "none", lr) for seed in range(seeds)]
            reached = [g for g in (to_goal(r, task.goal) for r in runs) if g is not None]
            final = [r.losses[-1] for r in runs]
            shown = fmt(final, 4) if all(map(math.isfinite, final)) else "diverged"
            print(f"{lr:>8g} {fmt([s for s, _ in reached]):>18} {len(reached):>3} {shown:>17}", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--tune-lr", action="store_true",
                        help="only the fixed target batch at each rate of the task's grid: the default is the best")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine())
    if args.tune_lr:
        return tune_lr(args.only, args.seeds)
    print(f"# batch ramp: target batch {TARGET}, micro-batches of at most {M} (the memory limit), so the ramp and "
          f"the fixed smallest batch start at {M + 1}; {args.seeds} seeds; mean ± standard deviation")
    print("# samples / steps to goal: samples seen and optimizer steps taken when the loss first reached the goal "
          "(n = runs that did); final loss: after the budget of samples; final batch: where the ramp ended")
    for name in args.only:
        task = TASKS[name]
        print(f"\n## {name}: loss goal {task.goal}, budget {task.budget:,} samples per run")
        header = (f"{'configuration':<16} {'lr rule':<7} {'samples to goal':>18} {'steps to goal':>15} {'n':>3} "
                  f"{'final loss':>17} {'final batch':>13} {'phases':>7} {'s/run':>6}")
        print(header)
        print("-" * len(header))
        for label, ramp, batch, rule in CONFIGS:
            runs = [run(task, seed, ramp, batch, rule) for seed in range(args.seeds)]
            reached = [g for g in (to_goal(r, task.goal) for r in runs) if g is not None]
            digits = 4 if name == "digits" else 3
            print(f"{label:<16} {rule:<7} {fmt([s for s, _ in reached]):>18} {fmt([n for _, n in reached]):>15} "
                  f"{len(reached):>3} {fmt([r.losses[-1] for r in runs], digits):>17} "
                  f"{fmt([r.final_batch for r in runs]):>13} {statistics.fmean(r.phases for r in runs):>7.1f} "
                  f"{statistics.fmean(r.seconds for r in runs):>6.1f}", flush=True)
    print("\nthe learning rate is the one tuned for the target batch, times the rule's factor (fixed smallest: "
          "linear or sqrt of its batch over the target; ramp: per phase, see autotune.planning.ramp.lr_scale)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
