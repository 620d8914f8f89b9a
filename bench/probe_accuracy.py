"""The probe's answer against an exhaustive real search, and what finding it cost.

    python bench/probe_accuracy.py                      # built-in probes and tests/realistic.py's setups
    python bench/probe_accuracy.py --only lstm moe mlp  # some of them (names as in the table)
    python bench/probe_accuracy.py --only moe --budgets 1.5e6 2e6 3e6  # at other budgets

For each workload and CPU memory budget (the CPU device, capacity emulated: a
real run past it raises the device's out-of-memory error; usable = budget x 0.9):

- autotune: ``autotune.probe`` with its defaults; counted from its trials
  table: real runs, misses (real runs that did not fit: out of memory, or a
  peak over the usable memory), out-of-memory errors, estimate evaluations; the
  probe's wall and CPU seconds (CPU: this process's, all threads);
- true max: exhaustive real search under the fit rule (double from 1 until a
  size does not fit, then bisect; every step a real run with the capacity not
  enforced; fits = peak <= usable), the same limit as the probe's.

Workloads: the built-in ``mlp`` (three budgets), ``gpt`` and ``convnet``, and
every case of ``tests/realistic.py`` (padded Hugging Face models, peft LoRA,
packed GRU, CTC, in-batch negatives, LSTM, mixture-of-experts routing) at its
own budget, then two that no estimate can size (``tests/workloads.py``):
routing with no bound (``repeat_interleave`` of counts the router computes)
and a length read from values that depend on parameters. A case whose optional
package is missing (transformers, peft) is listed as skipped.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.realistic, tests.helpers

from common import machine  # noqa: E402

from autotune.devices import get_device  # noqa: E402
from autotune.options import MARGIN, MAX_BATCH, usable_bytes  # noqa: E402
from autotune.probing.finder import find_max_micro_batch  # noqa: E402
from autotune.probing.fitrule import run_trial  # noqa: E402
from autotune.units import format_bytes  # noqa: E402
from autotune.workload import Workload, load_workload  # noqa: E402
from tests.helpers import exhaustive_max  # noqa: E402  (the ground truth, real runs alone)

MiB = 2**20
BUILT_IN = [("mlp", 2_400_000), ("mlp", 4_000_000), ("mlp", 9_000_000), ("gpt", 64 * MiB), ("convnet", 24 * MiB)]
#: tests/workloads.py builders no estimate can size: (name, builder, budget)
UNESTIMABLE = [("unbounded-routing", "unbounded_routing", 2 * MiB), ("gated-length", "gated_length", 8_000_000)]


@dataclass
class Row:
    workload: str
    budget: int
    category: str
    answer: int | None = None
    true_max: int | None = None
    real_runs: int = 0
    misses: int = 0
    ooms: int = 0
    estimates: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    runs: str = ""
    skipped: str = ""


def cases() -> list[tuple[str, int, str, Callable[[], Workload] | None, str]]:
    """(name, budget, category, builder or None, why skipped)."""
    from tests import realistic

    out: list[tuple[str, int, str, Callable[[], Workload] | None, str]] = [
        (name, budget, "built-in", (lambda n=name: load_workload(n)), "") for name, budget in BUILT_IN]
    for name, (build, budget, category) in realistic.CASES.items():
        why = ""
        if name.startswith("peft") and not realistic.has_peft():
            why = "peft is not installed"
        elif name.startswith(("hf-", "peft")):
            try:
                import transformers  # noqa: F401
            except ImportError:
                why = "transformers is not installed"
        out.append((name, budget, str(category), None if why else build, why))
    from tests import workloads

    out += [(name, budget, "5", getattr(workloads, builder), "") for name, builder, budget in UNESTIMABLE]
    return out


def measure(name: str, budget: int, category: str, build: Callable[[], Workload]) -> Row:
    row = Row(name, budget, category)
    workload = build()
    device = get_device("cpu", memory_budget=budget)
    wall, cpu = time.perf_counter(), time.process_time()
    result = find_max_micro_batch(workload, device, margin=MARGIN)
    row.wall, row.cpu = time.perf_counter() - wall, time.process_time() - cpu
    real = [t for t in result.trials if t.source == "real"]
    row.answer, row.real_runs = result.max_micro_batch, len(real)
    row.misses, row.ooms = sum(not t.fits for t in real), sum(t.oom for t in real)
    row.estimates = len(result.trials) - len(real)
    row.runs = " ".join(f"{t.batch}{'' if t.fits else '!' if t.oom else '>'}" for t in real)
    row.true_max = exhaustive_max(workload, get_device("cpu"), usable_bytes(budget, MARGIN), MAX_BATCH)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", help="workloads to run (default: all)")
    parser.add_argument("--budgets", nargs="+", type=float, metavar="BYTES",
                        help="probe each workload at these CPU budgets instead of its own (with --only)")
    args = parser.parse_args(argv)
    started = machine()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    warm = load_workload("mlp")  # untimed: the first estimate and real run in a process pay one-off costs
    run_trial(get_device("cpu").estimator(), warm, 2, 2**40, source="estimate")
    run_trial(get_device("cpu"), warm, 2, 2**40, source="real")
    rows = []
    for name, budget, category, build, why in cases():
        if args.only and name not in args.only:
            continue
        if build is None:
            rows.append(Row(name, budget, category, skipped=why))
            continue
        for each in [int(b) for b in args.budgets] if args.budgets else [budget]:
            print(f"  {name} @ {format_bytes(each)} ...", file=sys.stderr, flush=True)
            rows.append(measure(name, each, category, build))
            gc.collect()
    print(started)
    print(f"# probe vs exhaustive real search on the CPU device, usable = budget x (1 - {MARGIN}); "
          f"max_batch {MAX_BATCH}")
    print("# misses: real runs that did not fit (OOM or peak over usable); runs: the real runs in order,")
    print("#   '!' out of memory, '>' peak over the usable memory")
    header = (f"{'workload':<19} {'cat':>8} {'budget':>10} {'answer':>6} {'true':>5} {'ok':>2} {'real':>4} "
              f"{'miss':>4} {'OOM':>3} {'est':>3} {'wall s':>6} {'cpu s':>6}  runs")
    print(header)
    print("-" * len(header))
    for r in rows:
        if r.skipped:
            print(f"{r.workload:<19} {r.category:>8} {format_bytes(r.budget):>10}  skipped: {r.skipped}")
            continue
        ok = "=" if r.answer == r.true_max else "<" if (r.answer or 0) < (r.true_max or 0) else ">"
        print(f"{r.workload:<19} {r.category:>8} {format_bytes(r.budget):>10} {r.answer:>6} {r.true_max:>5} "
              f"{ok:>2} {r.real_runs:>4} {r.misses:>4} {r.ooms:>3} {r.estimates:>3} {r.wall:>6.1f} {r.cpu:>6.1f}  "
              f"{r.runs}")
    done = [r for r in rows if not r.skipped]
    print(f"# {sum(r.answer == r.true_max for r in done)}/{len(done)} exact; {sum(r.real_runs for r in done)} real "
          f"runs, {sum(r.misses for r in done)} misses, {sum(r.ooms for r in done)} OOMs in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
