"""What reading and writing results costs: import time of autotune's result types against pydantic's, and
seconds to write and read a large RunResult with autotune's own reader and with pydantic over the same classes.

    python bench/result_io.py [--reps 7] [--trials 10000] [--steps 10000]

Times are CPU seconds of this process (``time.process_time``: on a shared machine, wall time
mostly measures the neighbours). Import times are measured in a fresh interpreter each time (the statement
alone, timed inside the interpreter, so its start-up does not count), the cases taking turns; the table
gives the median and the fastest. ``TypeAdapter(RunResult)`` is built after autotune.results and pydantic
are imported: what building pydantic's validator and serializer for the whole RunResult tree adds.

The large RunResult is built without torch: a probe of ``--trials`` trials, a plan over it, a run of
``--steps`` steps with a noise-scale history of as many steps; then the largest plan the planner makes
(1,000,000 micro-batches). "write" is ``to_dict`` and :func:`autotune.serial.dumps`; "read" is
``json.loads`` and ``from_dict``. Beside them: pydantic's ``TypeAdapter`` over the same dataclasses,
``dump_json`` and ``validate_json`` (lax: what it would take to read the file with pydantic, without
autotune's one-line errors, null-as-NaN floats, derived fields or envelope).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from common import machine

SETUP_RESULTS = "import autotune.results, pydantic; from pydantic import TypeAdapter"
IMPORTS = {
    "import autotune.serial": ("", "import autotune.serial"),
    "import autotune.results": ("", "import autotune.results"),
    "import autotune.planning (the planner)": ("", "import autotune.planning"),
    "import pydantic": ("", "import pydantic"),
    "from pydantic import BaseModel": ("", "from pydantic import BaseModel"),
    "from pydantic import TypeAdapter": ("", "from pydantic import TypeAdapter"),
    "import pydantic.dataclasses": ("", "import pydantic.dataclasses"),
    "  + TypeAdapter(RunResult) built": (SETUP_RESULTS, "TypeAdapter(autotune.results.RunResult)"),
}
TIMED = """
import time, sys
{setup}
start = time.process_time()
{statement}
print(time.process_time() - start)
heavy = [m for m in ("torch", "numpy", "pandas") if m in sys.modules]
assert not heavy, heavy
"""


def import_times(reps: int) -> None:
    times: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(reps):
        for name, (setup, statement) in IMPORTS.items():
            code = TIMED.format(setup=setup, statement=statement)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            times[name].append(float(out) * 1e3)
    print(f"{'import (fresh interpreter, no torch/numpy/pandas)':<50} {'median CPU ms':>14} {'min':>6}")
    for name, values in times.items():
        print(f"{name:<50} {statistics.median(values):>14.1f} {min(values):>6.1f}")


def big_run(trials: int, steps: int) -> Any:
    """A RunResult of ``steps`` steps whose plan's probe ran ``trials`` trials (no torch)."""
    from autotune.planning import make_plan
    from autotune.results import Check, DeviceInfo, ProbeResult, RunResult, Trial, Verification
    from autotune.results.noise import NoiseScaleEstimate, NoiseStep

    device = DeviceInfo(name="cpu", kind="cpu", estimated=False, capacity_bytes=3_000_000,
                        capacity_source="memory budget", measured_by="live tensor-storage bytes", summary="cpu",
                        torch="2.13.0", budget_bytes=3_000_000)
    rows = tuple(Trial(batch=1 + i, source="estimate" if i % 3 else "real", peak_bytes=1000 + i, fits=True,
                       seconds=0.01 * i) for i in range(trials))
    probe = ProbeResult(workload="mlp", device=device, estimated=False, max_micro_batch=307, max_batch=65536,
                        capacity_bytes=3_000_000, usable_bytes=2_700_000, margin=0.1, peak_bytes=2_600_000,
                        predicted_peak_bytes=2_500_000, breakdown={"parameters": 1000}, limited_by="memory",
                        curve=tuple((b, 1000 + b) for b in range(1, 200)), trials=rows)
    plan = make_plan(1021, 307, probe=probe)
    history = tuple(NoiseStep(step=i, items=1021, micro_batches=4, grad_sq=1.0 + i, trace_cov=2.0, b_simple=2.0,
                              low=1.0, high=3.0) for i in range(steps))
    noise = NoiseScaleEstimate(b_simple=2.0, low=1.0, high=3.0, grad_sq=1.0, trace_cov=2.0, steps=steps, skipped=0,
                               items_per_step=1021.0, history=history)
    checks = (Check(name="memory", passed=True, value=2_600_000, limit=2_700_000, message="ok"),)
    return RunResult(plan=plan, workload="mlp", device=device, precision="fp32",
                     losses=tuple(1.0 / (i + 1) for i in range(steps)), step_seconds=(0.01,) * steps,
                     samples_per_s=1e5, items_per_s=1e5, peak_bytes=2_600_000, usable_bytes=2_700_000,
                     predicted_peak_bytes=2_500_000, verification=Verification(passed=True, checks=checks),
                     noise_scale=noise)


def best(fn: Callable[[], Any], reps: int) -> float:
    """Median CPU seconds of ``fn()``."""
    values = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        values.append(time.process_time() - start)
    return statistics.median(values)


def read_write(reps: int, trials: int, steps: int) -> None:
    from pydantic import TypeAdapter

    from autotune.planning import make_plan
    from autotune.results import Plan, RunResult
    from autotune.serial import dumps

    cases = {f"RunResult, {trials:,} trials, {steps:,} steps": (RunResult, big_run(trials, steps)),
             "RunResult, 10 trials, 20 steps": (RunResult, big_run(10, 20)),
             "Plan, 1,000,000 micro-batches": (Plan, make_plan(1_000_000, 1, world_size=1000))}
    print(f"\n{'result (median CPU s)':<40} {'MB':>5} {'write':>7} {'read':>7} {'pydantic write':>15} {'read':>7}")
    for name, (cls, result) in cases.items():
        text = dumps(result.to_dict())
        adapter = TypeAdapter(cls)
        raw = adapter.dump_json(result)
        assert cls.from_dict(json.loads(text)) == result
        write = best(lambda r=result: dumps(r.to_dict()), reps)
        read = best(lambda c=cls, t=text: c.from_dict(json.loads(t)), reps)
        p_write = best(lambda a=adapter, r=result: a.dump_json(r), reps)
        p_read = best(lambda a=adapter, t=raw: a.validate_json(t), reps)
        print(f"{name:<40} {len(text) / 1e6:>5.1f} {write:>7.3f} {read:>7.3f} {p_write:>15.3f} {p_read:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    print(machine())
    import_times(args.reps)
    read_write(max(3, args.reps // 2), args.trials, args.steps)


if __name__ == "__main__":
    main()
