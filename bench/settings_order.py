"""The settings search's predicted order of samples/s against the measured one, on the CPU.

    python bench/settings_order.py              # the top 3 settings, each timed as --tune times plans
    python bench/settings_order.py --budget 18MiB --target 48 --rounds 3

The model and scenario are tests/probing/test_settings.py's (6 repeated MLP blocks; by default a 21 MiB budget
and a target batch of 24): without checkpointing 14 samples fit a micro-step (so 2 of 12), checkpointing every
2nd block or every block fits all 24 in one, at the cost of recomputing 3 or 6 blocks' forwards. The search ranks the
settings by its stated time model (autotune/planning/settings_search.py), and each of the top settings is
then trained for real (``time_plan``: warm-up, then timed optimizer steps; checkpointing as the runner applies
it), in rounds that alternate the order, so that a slow moment of a shared machine does not fall on one
setting alone. The table prints both orders and says whether they agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.probing.test_settings: the model and its budget

from common import machine  # noqa: E402

from autotune.devices import get_device  # noqa: E402
from autotune.planning.planner import make_plan  # noqa: E402
from autotune.probing.settings import apply  # noqa: E402
from autotune.training.timing import Timing, time_plan  # noqa: E402
from autotune.units import parse_size  # noqa: E402
from tests.probing.test_settings import BUDGET, TARGET, searched, stack  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=3, help="settings timed, best predicted first (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds, alternating the order (default 5)")
    parser.add_argument("--budget", default=BUDGET, help=f"the CPU memory budget (default {BUDGET})")
    parser.add_argument("--target", type=int, default=TARGET,
                        help=f"the target batch (default {TARGET})")
    args = parser.parse_args()
    print(machine())
    plan = searched(args.budget, args.target, confirm=False)
    rows = [r for r in plan.settings if r.fits][:args.top]
    dev = get_device("cpu", memory_budget=parse_size(args.budget))
    timing = Timing(warmup=2, min_steps=8, max_steps=30, budget_s=10.0)
    speeds: dict[int, list[float]] = {i: [] for i in range(len(rows))}
    for round_ in range(args.rounds):
        for i in (range(len(rows)) if round_ % 2 == 0 else reversed(range(len(rows)))):
            row = rows[i]
            made = make_plan(args.target, row.max_micro_batch, world_size=1)
            times = time_plan(apply(stack(), row.setting, spec=None, cuda=False, real=True), dev, made, timing=timing)
            speeds[i].append(args.target / times.median)
    print(f"\ntarget batch {args.target}, budget {args.budget}; samples/s measured: the median of {args.rounds} "
          "rounds\n")
    print("| predicted # | setting | micro-batch x steps | predicted samples/s | measured samples/s | measured # |")
    print("|---|---|---|---|---|---|")
    measured = [statistics.median(speeds[i]) for i in range(len(rows))]
    place = {i: n + 1 for n, i in enumerate(sorted(range(len(rows)), key=lambda i: -measured[i]))}
    for i, row in enumerate(rows):
        print(f"| {i + 1} | {row.setting.label} | {row.micro_batch} x {row.accumulation_steps} | "
              f"{row.samples_per_second:.4g} | {measured[i]:.4g} | {place[i]} |")
    same = all(place[i] == i + 1 for i in range(len(rows)))
    print(f"\nthe measured order is {'the predicted one' if same else 'NOT the predicted one'}")


if __name__ == "__main__":
    main()
