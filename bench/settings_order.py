"""The settings search's predicted order of samples/s against the measured one, on the CPU.

    python bench/settings_order.py              # the top 3 settings, each timed as --tune times plans
    python bench/settings_order.py --budget 18MiB --target 48 --rounds 2

The model and scenario are tests/probing/test_settings.py's (6 repeated MLP blocks; by default a 21 MiB budget
and a target batch of 24): without checkpointing 14 samples fit a micro-step (so 2 of 12), checkpointing every
2nd block or every block fits all 24 in one, at the cost of recomputing 3 or 6 blocks' forwards. The search ranks the
settings by its stated time model (autotune/planning/settings_search.py), and each of the top settings is
then trained for real as ``--tune`` times plans, checkpointing as the runner applies it: each alone
(``time_plan``: warm-up, then timed optimizer steps, in rounds that alternate the order), and each pair head
to head (``compare_plans``, what ``--tune`` decides by: a few steps of each in turn, their ratio per round, so
that a slow moment of a shared machine falls on both). The measured order is the head-to-head's; the table
prints both orders and says whether they agree, and each fitting setting's peak in a real run of the fit rule.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from itertools import combinations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.probing.test_settings: the model and its budget

from common import machine  # noqa: E402

from autotune.devices import get_device  # noqa: E402
from autotune.devices.base import Device  # noqa: E402
from autotune.planning.planner import make_plan  # noqa: E402
from autotune.probing.fitrule import run_trial  # noqa: E402
from autotune.probing.settings import apply  # noqa: E402
from autotune.results.plan import Plan  # noqa: E402
from autotune.results.search import SettingRow  # noqa: E402
from autotune.training.timing import Samples, Timing, compare_plans, time_plan  # noqa: E402
from autotune.units import format_bytes, parse_size  # noqa: E402
from autotune.workload import Workload  # noqa: E402
from tests.probing.test_settings import BUDGET, TARGET, searched, stack  # noqa: E402


def plans(rows: list[SettingRow], target: int) -> list[tuple[Workload, Plan]]:
    """Each row's workload as the runner trains it (checkpointing with the random state kept) and its plan."""
    return [(apply(stack(), r.setting, spec=None, cuda=False, real=True), make_plan(target, r.max_micro_batch,
                                                                                   world_size=1)) for r in rows]


def timed(runs: list[tuple[Workload, Plan]], dev: Device, target: int, rounds: int) -> list[float]:
    """Samples/s of each run: the median over ``rounds`` of ``time_plan``'s median, the order alternating."""
    timing = Timing(warmup=2, min_steps=8, max_steps=30, budget_s=10.0)
    speeds: dict[int, list[float]] = {i: [] for i in range(len(runs))}
    for round_ in range(rounds):
        for i in (range(len(runs)) if round_ % 2 == 0 else reversed(range(len(runs)))):
            speeds[i].append(target / time_plan(runs[i][0], dev, runs[i][1], timing=timing).median)
    return [statistics.median(speeds[i]) for i in range(len(runs))]


def head_to_head(runs: list[tuple[Workload, Plan]], dev: Device) -> dict[tuple[int, int], Samples]:
    """For each pair ``i < j``: the throughput of ``j`` over ``i``'s, per round of a few steps of each, interleaved
    (``compare_plans``, as ``--tune`` decides its pick), so both see the same load on a busy machine."""
    timing = Timing(warmup=1, min_steps=8, max_steps=30, budget_s=15.0)
    return {(i, j): compare_plans(runs[i][0], dev, runs[i][1], runs[j][1], other_workload=runs[j][0], timing=timing)
            for i, j in combinations(range(len(runs)), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=3, help="settings timed, best predicted first (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, alternating the order (default 3)")
    parser.add_argument("--budget", default=BUDGET, help=f"the CPU memory budget (default {BUDGET})")
    parser.add_argument("--target", type=int, default=TARGET, help=f"the target batch (default {TARGET})")
    args = parser.parse_args()
    print(machine())
    plan = searched(args.budget, args.target, confirm=False)
    rows = [r for r in plan.settings if r.fits][:args.top]
    dev = get_device("cpu", memory_budget=parse_size(args.budget))
    runs = plans(rows, args.target)
    measured, pairs = timed(runs, dev, args.target, args.rounds), head_to_head(runs, dev)
    wins = {i: sum(1 for (a, b), r in pairs.items() if (a == i and r.median < 1) or (b == i and r.median > 1))
            for i in range(len(rows))}
    place = {i: n + 1 for n, i in enumerate(sorted(range(len(rows)), key=lambda i: -wins[i]))}
    assert plan.probe is not None
    usable, fitting = plan.probe.usable_bytes, [r for r in plan.settings if r.fits]
    real = {id(r): run_trial(dev, apply(stack(), r.setting, spec=None, cuda=False, real=True), r.micro_batch, usable,
                             source="real") for r in fitting}
    print(f"\ntarget batch {args.target}, budget {args.budget}; samples/s: the median of {args.rounds} rounds of "
          "time_plan; measured #: by the head-to-head ratios below\n")
    print("| predicted # | setting | micro-batch x steps | predicted samples/s | measured samples/s | measured # | "
          "real peak (fit rule) |")
    print("|---|---|---|---|---|---|---|")
    for i, row in enumerate(rows):
        trial = real[id(row)]
        peak = format_bytes(trial.peak_bytes) if trial.fits and trial.peak_bytes else f"out of memory: {trial.why}"
        print(f"| {i + 1} | {row.setting.label} | {row.micro_batch} x {row.accumulation_steps} | "
              f"{row.samples_per_second:.4g} | {measured[i]:.4g} | {place[i]} | {peak} |")
    print("\n| pair | predicted ratio | measured ratio (95% interval) | rounds |\n|---|---|---|---|")
    for (i, j), r in pairs.items():
        print(f"| #{j + 1} / #{i + 1} | {rows[j].samples_per_second / rows[i].samples_per_second:.3f} | "
              f"{r.median:.3f} ± {r.half_width:.3f} | {len(r.values)} |")
    same = len(set(wins.values())) == len(rows) and all(place[i] == i + 1 for i in range(len(rows)))
    print(f"\nthe measured order is {'the predicted one' if same else 'NOT the predicted one'}; "
          f"{sum(t.fits for t in real.values())} of the {len(fitting)} settings predicted to fit ran the fit rule "
          f"for real within the usable {format_bytes(usable)}")


if __name__ == "__main__":
    main()
