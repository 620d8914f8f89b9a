"""What carrying the batch's values costs an estimate: the same evaluations with and without them.

    python bench/estimate_values.py               # gpt, gpt-100m, convnet, gpt-1b (~3 min on 2 cores)
    python bench/estimate_values.py --threads 1   # one torch thread: no OpenMP spinning on a busy machine

For each built-in model, CPU seconds (``time.process_time``, median of
``--repeat``, each on a fresh estimator standing in for an H100) of one
fit-rule evaluation at micro-batch 4 and at a large one, and of a whole
estimate-only probe, three ways, interleaved so that each sees the same
machine:

- ``values``: as autotune runs (the batch built for real up to the batch limit,
  ops on known values computed on the host);
- ``shape-only batch``: the batch built shape-only (the limit set to 0): the
  kernel that carries values runs, but has nothing to carry;
- ``no values``: that kernel replaced by the meta engine's own, the batch
  shape-only: the estimate as it ran before values.

``values`` minus ``shape-only batch`` is what building the batch for real and
computing on its values costs; ``shape-only batch`` minus ``no values`` is the
kernel's own cost per op.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from unittest import mock

import torch
from common import machine

from autotune.devices import EstimateDevice
from autotune.devices import estimate as estimate_mod
from autotune.devices.presets import find_preset
from autotune.devices.values import KnownValues
from autotune.probes import convnet, gpt
from autotune.probing.finder import find_max_micro_batch
from autotune.probing.fitrule import run_trial

MODELS = [("gpt", gpt.build, 4096), ("gpt-100m", gpt.build_100m, 64), ("convnet", convnet.build, 1024),
          ("gpt-1b", gpt.build_1b, 16)]


class Passthrough(KnownValues):
    """The kernel that carries no values: every op straight to the meta engine."""

    def __call__(self, func, args, kwargs):
        return self.inner(func, args, kwargs)


@contextlib.contextmanager
def way(name: str):
    with contextlib.ExitStack() as stack:
        if name != "values":
            stack.enter_context(mock.patch.object(estimate_mod, "BATCH_LIMIT", 0))
        if name == "no values":
            stack.enter_context(mock.patch.object(estimate_mod, "KnownValues", Passthrough))
        yield


WAYS = ("values", "shape-only batch", "no values")


def estimator() -> EstimateDevice:
    return EstimateDevice.for_preset(find_preset("H100-80GB"))


def evaluate(workload, batch: int) -> None:
    run_trial(estimator(), workload, batch, 2**62, source="estimate")


def cpu_seconds(fn) -> float:
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--only", nargs="+", choices=[n for n, _, _ in MODELS])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_trial(estimator(), gpt.build(), 2, 2**62, source="estimate")  # warm-up: one-off import costs
    print(machine())
    print(f"# CPU seconds, median of {args.repeat}, interleaved; an H100 stood in for (estimate:H100-80GB)")
    print(f"{'model':10s} {'measure':22s} " + " ".join(f"{w:>17s}" for w in WAYS))
    for name, build, large in MODELS:
        if args.only and name not in args.only:
            continue
        print(f"  {name} ...", file=sys.stderr, flush=True)
        workload = build()
        measures = {"eval @4": lambda w=workload: evaluate(w, 4),
                    f"eval @{large}": lambda w=workload, b=large: evaluate(w, b),
                    "estimate-only probe": lambda w=workload: find_max_micro_batch(w, estimator())}
        for label, fn in measures.items():
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for i in range(args.repeat):
                for w in (WAYS if i % 2 == 0 else WAYS[::-1]):
                    with way(w):
                        times[w].append(cpu_seconds(fn))
            print(f"{name:10s} {label:22s} " + " ".join(f"{statistics.median(times[w]):17.3f}" for w in WAYS),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
