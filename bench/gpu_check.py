"""GPU check: autotune's estimates and probe against what an NVIDIA GPU really does.

Run through ``bench/gpu_check.sh`` (it finds the Python, caps the time, names
the log). Three checks, each a table in the final summary:

1. peaks: for the shipped probes at a few micro-batch sizes, the fake-tensor
   estimate standing in for this GPU (``get_device("cuda:0").estimator()``)
   against the fit rule's measured ``torch.cuda.max_memory_reserved`` (error
   in %), and against the tracker's own count on the GPU (allocator-free);
2. probe: ``autotune.probe`` under a ``--memory-budget`` against an exhaustive
   real search (doubling, then bisection, every run a real fit-rule run on the
   GPU), plus the sizes next to the max checked for real (is fits monotone
   there? the caching allocator's segments make the peak step-wise);
3. run: ``autotune run --target-batch N --device cuda:0`` with verification
   (gradient equivalence, memory, counts), through the CLI.

Without a GPU it prints that, names every check it skipped and why, and exits 0.
``--cpu-selftest`` runs the same code on the CPU device (small budgets) so the
script itself can be exercised on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

MiB = 2**20
GiB = 2**30

# (probe, micro-batch sizes) for the peak check; (probe, budget) for the probe check;
# (probe, fallback target batch, budget) for the planned runs: the target is 2 x the probe's max + 1
# when the probe check ran at that budget (so the plan accumulates, unevenly), else the fallback.
GPU_PEAKS = [("mlp", [64, 1024, 16384]), ("gpt", [8, 64, 256]), ("convnet", [16, 128, 512]),
             ("gpt:build_100m", [2, 8])]
GPU_PROBES = [("mlp", 64 * MiB), ("gpt", 512 * MiB), ("convnet", 256 * MiB)]
GPU_RUNS = [("mlp", 4099, 64 * MiB), ("gpt", 1025, 512 * MiB)]

CPU_PEAKS = [("mlp", [64, 1024]), ("gpt", [4, 16]), ("convnet", [8, 32])]
CPU_PROBES = [("mlp", 4_000_000), ("gpt", 48 * MiB), ("convnet", 16 * MiB)]
CPU_RUNS = [("mlp", 1021, 4_000_000), ("gpt", 129, 48 * MiB)]


class Log:
    """Prints to stdout and appends to the log file."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "w", buffering=1)

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.file.write(text + "\n")

    def detail(self, text: str) -> None:
        """Only in the log file (tracebacks, JSON)."""
        self.file.write(text + "\n")


def load(spec: str):
    from autotune.workload import load_workload

    if spec == "gpt:build_100m":
        from probes import gpt

        return gpt.build_100m()
    return load_workload(spec)


def fmt(n) -> str:
    from autotune.units import format_bytes

    return "-" if n is None else format_bytes(int(n))


def pct(a, b) -> str:
    return "-" if a is None or not b else f"{100.0 * (a - b) / b:+.1f}%"


class Budget:
    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


def check_peaks(log: Log, device, cases, budget: Budget, skipped: list[str]) -> list[list[str]]:
    from autotune.probing.fitrule import run_trial

    rows = []
    est_device = device.estimator()
    cap = device.capacity_bytes()
    for spec, sizes in cases:
        workload = load(spec)
        for b in sizes:
            if budget.left() < 60:
                skipped.append(f"peaks {workload.name} @ {b}: time limit (keeping time for the other checks)")
                continue
            est = run_trial(est_device, workload, b, cap, source="estimate")
            real = run_trial(device, workload, b, cap, source="real")
            if real.oom:
                rows.append([workload.name, str(b), fmt(est.peak_bytes), "OOM", "-", "-", "-", f"{est.seconds:.2f}"])
                log(f"  peaks {workload.name} @ {b}: estimate {fmt(est.peak_bytes)}, real run out of memory")
                continue
            m = real.measurement
            rows.append([workload.name, str(b), fmt(est.peak_bytes), fmt(m.peak_bytes),
                         pct(est.peak_bytes, m.peak_bytes),
                         fmt(m.tracked_peak_bytes), pct(est.peak_bytes, m.tracked_peak_bytes), f"{est.seconds:.2f}"])
            log(f"  peaks {workload.name} @ {b}: estimate {fmt(est.peak_bytes)} ({est.peak_bytes} B), reserved "
                f"{fmt(m.peak_bytes)} ({m.peak_bytes} B), tracked {fmt(m.tracked_peak_bytes)} "
                f"({m.tracked_peak_bytes} B), error vs reserved {pct(est.peak_bytes, m.peak_bytes)}")
    return rows


def exhaustive(device, workload, usable: int, limit: int) -> tuple[int, int, dict[int, bool]]:
    """Largest size that fits by doubling then bisection, every run real; (max, runs, verdicts)."""
    from autotune.probing.finder import exhaustive_max

    peaks: dict[int, int | None] = {}
    found = exhaustive_max(workload, device, usable, limit, peaks=peaks)
    return found, len(peaks), {b: p is not None and p <= usable for b, p in peaks.items()}


def check_probes(log: Log, make_device, cases, budget: Budget, skipped: list[str],
                 found: dict[tuple[str, int], int]) -> list[list[str]]:
    from autotune.probing.finder import probe
    from autotune.probing.fitrule import run_trial

    rows = []
    limit = 65536
    for spec, memory in cases:
        if budget.left() < 45:
            skipped.append(f"probe {spec} @ {fmt(memory)}: time limit")
            continue
        workload = load(spec)
        device = make_device(memory)
        start = time.perf_counter()
        result = probe(workload, device, max_batch=limit)
        seconds = time.perf_counter() - start
        trials = "\n".join(map(str, result.trials))
        log.detail(f"probe {workload.name} @ {fmt(memory)} trials:\n{trials}\nnotes: {result.notes}")
        true, runs, seen = exhaustive(device, workload, result.usable_bytes, limit)
        # Next to the max: does every smaller size fit and every larger one not? (monotone there)
        around = {}
        for b in range(max(1, true - 2), true + 3):
            if b not in seen:
                seen[b] = run_trial(device, workload, b, result.usable_bytes, source="real",
                                    capacity_guard=False).fits
            around[b] = seen[b]
        monotone = all(around[b] == (b <= true) for b in around)
        found[(spec, memory)] = result.max_micro_batch
        rows.append([workload.name, fmt(memory), str(result.max_micro_batch), str(true),
                     "yes" if result.max_micro_batch == true else "NO", str(result.real_runs), str(result.real_ooms),
                     f"{seconds:.1f}", str(runs), "yes" if monotone else "NO " + str(around),
                     f"{result.estimate_error:+.2%}" if result.estimate_error is not None else "-"])
        log(f"  probe {workload.name} @ {fmt(memory)}: autotune {result.max_micro_batch} ({result.real_runs} real "
            f"runs, {result.real_ooms} OOMs, {seconds:.1f} s), exhaustive {true} ({runs} real runs); "
            f"around the max {around}; notes: {'; '.join(result.notes) or '-'}")
    return rows


def check_runs(log: Log, device_name: str, cases, budget: Budget, skipped: list[str],
               found: dict[tuple[str, int], int]) -> list[list[str]]:
    rows = []
    for spec, fallback, memory in cases:
        target = 2 * found[(spec, memory)] + 1 if (spec, memory) in found else fallback
        if budget.left() < 30:
            skipped.append(f"run {spec} --target-batch {target}: time limit")
            continue
        cmd = [sys.executable, "-m", "autotune", "run", "--target-batch", str(target), "--probe", spec,
               "--device", device_name, "--memory-budget", str(memory), "--steps", "5", "--json", "--quiet"]
        log(f"  $ {' '.join(cmd[1:])}")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(20, budget.left() - 15))
        except subprocess.TimeoutExpired:
            rows.append([spec, str(target), fmt(memory), "timeout", "-", "-", "-", "-", "-"])
            skipped.append(f"run {spec} --target-batch {target}: did not finish within the time limit")
            continue
        log.detail(done.stdout)
        log.detail(done.stderr)
        try:
            result = json.loads(done.stdout)
        except json.JSONDecodeError:
            rows.append([spec, str(target), fmt(memory), f"exit {done.returncode}", "-", "-", "-", "-", "-"])
            log(f"    no JSON result; stderr: {done.stderr.strip()[-500:]}")
            continue
        ver = result.get("verification") or {}
        plan = result.get("plan", {})
        schedule = plan.get("schedule", [[]])[0]
        sizes = f"{len(schedule)} x {max(schedule)}" if schedule else "-"
        if schedule and min(schedule) != max(schedule):
            sizes = f"{len(schedule)} x {min(schedule)}..{max(schedule)}"
        err = ver.get("gradient_relative_error")
        failed = [c["name"] for c in ver.get("checks", []) if not c.get("passed")]
        rows.append([spec, str(target), fmt(memory), f"exit {done.returncode}", sizes,
                     "-" if err is None else f"{err:.1e}",
                     f"{fmt(result.get('peak_bytes'))} / {fmt(result.get('usable_bytes'))}",
                     f"{result.get('samples_per_s', 0):.0f}", "PASSED" if ver.get("passed") else f"FAILED {failed}"])
        log(f"    exit {done.returncode}: schedule {sizes}, gradient rel. error {err}, peak "
            f"{fmt(result.get('peak_bytes'))} of usable {fmt(result.get('usable_bytes'))}, "
            f"{'PASSED' if ver.get('passed') else 'FAILED ' + str(failed)}")
    return rows


def table(log: Log, title: str, header: list[str], rows: list[list[str]]) -> None:
    log(title)
    if not rows:
        log("  (nothing ran)")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    log("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)))
    log("  " + "  ".join("-" * w for w in widths))
    for r in rows:
        log("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))


def environment(log: Log) -> None:
    import torch

    import autotune

    log(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    log(f"host: {platform.node()}, {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    log(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), autotune {autotune.__version__}")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,memory.used",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            log(f"nvidia-smi: {out.stdout.strip() or out.stderr.strip()}")
        except Exception as exc:  # a hung driver is worth saying, not dying for
            log(f"nvidia-smi failed: {exc}")
    else:
        log("nvidia-smi: not found on PATH")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check.log"))
    parser.add_argument("--time-limit", type=float, default=270.0, help="seconds for all checks together")
    parser.add_argument("--cpu-selftest", action="store_true",
                        help="run the checks on the CPU device (small budgets): exercises this script without a GPU")
    args = parser.parse_args(argv)
    log = Log(args.log)
    budget = Budget(args.time_limit)
    skipped: list[str] = []
    try:
        import torch
    except Exception as exc:
        log(f"cannot import torch: {exc}: install torch and the project (pip install -e .)")
        return 1
    environment(log)
    from autotune.devices import get_device

    if args.cpu_selftest:
        log("SELF-TEST ON THE CPU: the 'GPU' figures below are the CPU device's (tracker-counted), not a GPU's")
        device_name, peaks, probes, runs = "cpu", CPU_PEAKS, CPU_PROBES, CPU_RUNS
        device = get_device("cpu")
    else:
        why = None
        if not torch.cuda.is_available():
            why = (f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
                   f"{torch.version.cuda or 'none: a CPU-only torch'})")
        elif torch.cuda.device_count() < 1:
            why = "torch sees no CUDA device"
        if why is not None:
            log(f"no GPU found: {why}")
            log("skipped, all of them need an NVIDIA GPU with a working driver:")
            log("  1. peaks: estimated vs measured max_memory_reserved")
            log("  2. probe: max micro-batch vs an exhaustive real search")
            log("  3. run: a planned run with verification on cuda:0")
            log(f"full log: {args.log}")
            return 0
        device_name, peaks, probes, runs = "cuda:0", GPU_PEAKS, GPU_PROBES, GPU_RUNS
        device = get_device("cuda:0")
        log(f"device: {device.describe().summary}")

    sections = {}
    found: dict[tuple[str, int], int] = {}
    for name, fn in (("peaks", lambda: check_peaks(log, device, peaks, budget, skipped)),
                     ("probe", lambda: check_probes(log, lambda m: get_device(device_name, memory_budget=m), probes,
                                                    budget, skipped, found)),
                     ("run", lambda: check_runs(log, device_name, runs, budget, skipped, found))):
        log(f"== {name} ({budget.left():.0f} s left)")
        try:
            sections[name] = fn()
        except Exception as exc:
            log(f"  {name} check failed: {type(exc).__name__}: {exc} (traceback in the log)")
            log.detail(traceback.format_exc())
            skipped.append(f"{name}: stopped by {type(exc).__name__}: {exc}")
            sections[name] = []

    log()
    log(f"==== summary ({device_name}; {time.monotonic() - budget.start:.0f} s)")
    table(log, "1. estimated peak vs measured (error = estimate vs measured; + means the estimate is higher)",
          ["probe", "batch", "estimated", "max reserved", "error", "tracked", "error", "est. s"],
          sections.get("peaks", []))
    table(log, "2. probe vs exhaustive real search (under --memory-budget)",
          ["probe", "budget", "autotune", "exhaustive", "equal", "real runs", "OOMs", "s", "search runs",
           "monotone near max", "est. error"], sections.get("probe", []))
    table(log, "3. planned runs with verification (autotune run ... --steps 5)",
          ["probe", "target", "budget", "cli", "schedule", "grad rel err", "peak / usable", "samples/s", "verified"],
          sections.get("run", []))
    log("skipped: " + ("nothing" if not skipped else ""))
    for s in skipped:
        log(f"  - {s}")
    log(f"full log: {args.log}")
    bad = any(r[4] == "NO" for r in sections.get("probe", [])) or any(
        not r[-1].startswith("PASSED") for r in sections.get("run", []))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
