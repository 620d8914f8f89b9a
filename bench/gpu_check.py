"""GPU check: autotune's estimates, its allocator simulation and its probe against what an NVIDIA GPU does.

Run through ``bench/gpu_check.sh`` (it finds the Python, caps the time, names
the log). The checks, each a table in the final summary:

1. peaks: for the shipped probes at a few micro-batch sizes, one real run of
   the fit rule with the allocator's history recorded
   (``torch.cuda.memory._record_memory_history``, then ``_snapshot()``), and
   (a) that trace replayed through autotune's ``CachingAllocator`` under this
   process's allocator settings (``PYTORCH_CUDA_ALLOC_CONF``, else
   ``PYTORCH_ALLOC_CONF``): its reserved and allocated peaks against
   ``torch.cuda.max_memory_reserved`` / ``max_memory_allocated`` of the
   same run (the simulation alone; expected within 1%); (b) the estimate
   standing in for this GPU (``get_device("cuda:0").estimator()``: meta
   tensors, CUDA's kernel choices, the simulation) against the same real
   peaks (expected within 3%), and its release-and-retry count against the
   real one;
2. probe: ``autotune.probe`` under a ``--memory-budget`` against an exhaustive
   real search (doubling, then bisection, every run a real fit-rule run on the
   GPU), plus the sizes next to the max checked for real (is fits monotone
   there? the caching allocator's segments make the peak step-wise);
3. run: ``autotune run --target-batch N --device cuda:0`` with verification
   (gradient equivalence, memory, counts), through the CLI;
4. assumptions: the memory this process holds outside PyTorch's allocator
   (NVML's figure for the process minus ``memory_reserved``: the context and
   libraries the estimate allows for) and this GPU's NVML total against the
   preset of the same model.

For every peak-check run it also writes two memory snapshots in the format of
``torch.cuda.memory._snapshot()`` beside the log (``snapshots/<probe>-<batch>.predicted.pickle``: the
estimate's trace replayed through the simulation; ``...real.pickle``: the GPU's own), which
``python -m torch.cuda._memory_viz trace_plot FILE -o out.html`` and pytorch.org/memory_viz open, and logs their
reserved peaks side by side.

Without a GPU it prints that, names every check it skipped and why, and exits 0.
``--cpu-selftest`` runs the same code on the CPU device (small budgets) so the
script itself can be exercised on a machine without a GPU; there the replay
check (1a) replays a synthetic snapshot-shaped trace, made by the simulation
from the CUDA stand-in's own trace, and must reproduce its peaks exactly.
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
    return "-" if a is None or not b else f"{100.0 * (a - b) / b:+.2f}%"


def within(a, b, tolerance: float) -> bool:
    return a is not None and b is not None and abs(a - b) <= tolerance * b


class Budget:
    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


REPLAY_TOLERANCE = 0.01  # the simulation replaying a real trace
SELFTEST_GPU = 8 * GiB  # the CUDA stand-in whose trace the self-test replays
ESTIMATE_TOLERANCE = 0.03  # the estimate against the real reserved peak


def recorded_run(device, workload, b: int, cap: int, gpu: bool):
    """A real fit-rule run at ``b``; on a GPU with the allocator's history recorded: (measured trial, snapshot)."""
    from autotune.probing.fitrule import run_trial

    if not gpu:
        return run_trial(device, workload, b, cap, source="real", capacity_guard=False), None
    import torch

    memory = torch.cuda.memory
    memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000,
                                  clear_history=True)
    try:
        measured = run_trial(device, workload, b, cap, source="real", capacity_guard=False)
        snapshot = memory._snapshot()
    finally:
        memory._record_memory_history(enabled=None)
    return measured, snapshot


def synthetic_snapshot(events, conf: str) -> dict:
    """A ``torch.cuda.memory._snapshot()``-shaped trace of ``events`` as the simulation allocates them: for the
    self-test of the replay path, which must then reproduce the simulation's peaks exactly."""
    from autotune.devices.allocator import CachingAllocator

    alloc, trace, live = CachingAllocator(None, conf), [], {}
    alloc.on_segment = lambda action, addr, size, stream: trace.append(
        {"action": action, "addr": addr, "size": size, "stream": stream})
    for key, nbytes, stream in events:
        if nbytes < 0:
            if key in live:
                addr, size = live.pop(key)
                alloc.free(addr)
                trace += [{"action": a, "addr": addr, "size": size, "stream": 0}
                          for a in ("free_requested", "free_completed")]
        else:
            addr = alloc.malloc(nbytes, stream)
            if addr:
                live[key] = (addr, nbytes)
                trace.append({"action": "alloc", "addr": addr, "size": nbytes, "stream": stream})
    return {"segments": [], "device_traces": [trace], "peaks": (alloc.max_reserved, alloc.max_allocated)}


def check_peaks(log: Log, device, cases, budget: Budget, skipped: list[str], gpu: bool) -> list[list[str]]:
    from autotune.devices import EstimateDevice
    from autotune.devices.allocconf import conf_from_environment
    from autotune.devices.replay import replay_snapshot
    from autotune.probing.fitrule import run_trial

    rows = []
    # On the CPU (self-test) the "real" peaks are a CUDA stand-in's own simulated trace, so the estimate
    # compared with them is that stand-in: the code path runs, and must agree exactly.
    est_device = device.estimator() if gpu else EstimateDevice.for_gpu(SELFTEST_GPU)
    cap = device.capacity_bytes()
    conf, _ = conf_from_environment()
    total = device.describe().total_bytes if gpu else None
    for spec, sizes in cases:
        workload = load(spec)
        for b in sizes:
            if budget.left() < 60:
                skipped.append(f"peaks {workload.name} @ {b}: time limit (keeping time for the other checks)")
                continue
            est = run_trial(est_device, workload, b, cap, source="estimate")
            predicted = predicted_snapshot(est_device, workload, b)
            real, snapshot = recorded_run(device, workload, b, cap, gpu)
            if real.oom:
                rows.append([workload.name, str(b), "OOM", "-", "-", "-", "-", fmt(est.peak_bytes), "-", "-", "-",
                             f"{est.seconds:.2f}"])
                log(f"  peaks {workload.name} @ {b}: estimate {fmt(est.peak_bytes)}, real run out of memory")
                continue
            m = real.measurement
            if gpu:
                reserved, allocated, retries = m.peak_bytes, m.allocated_peak_bytes, m.alloc_retries
            else:  # self-test: a CUDA stand-in's own trace, as a snapshot the simulation allocated
                snapshot = synthetic_snapshot(_trace_of(workload, b), conf)
                reserved, allocated = snapshot.pop("peaks")
                retries = 0
            sim = replay_snapshot(snapshot, capacity=None, conf=conf, device_total=total)
            write_snapshots(log, workload.name, b, predicted, snapshot)
            replay_ok = within(sim.reserved_peak, reserved, REPLAY_TOLERANCE) and \
                within(sim.allocated_peak, allocated, REPLAY_TOLERANCE)
            estimate_ok = within(est.peak_bytes, reserved, ESTIMATE_TOLERANCE)
            rows.append([workload.name, str(b), fmt(reserved), fmt(allocated),
                         f"{fmt(sim.reserved_peak)} {pct(sim.reserved_peak, reserved)}",
                         f"{fmt(sim.allocated_peak)} {pct(sim.allocated_peak, allocated)}",
                         "yes" if replay_ok else "NO", f"{fmt(est.peak_bytes)} {pct(est.peak_bytes, reserved)}",
                         f"{fmt(est.allocated_bytes)} {pct(est.allocated_bytes, allocated)}",
                         "yes" if estimate_ok else "NO", f"{est.retries} / {retries}",
                         fmt(m.tracked_peak_bytes), str(sim.events), f"{est.seconds:.2f}"])
            log(f"  peaks {workload.name} @ {b}: real reserved {reserved} B, allocated {allocated} B, retries "
                f"{retries}; replay of its trace ({sim.events} events, {sim.seconds:.2f} s) reserved "
                f"{sim.reserved_peak} B ({pct(sim.reserved_peak, reserved)}), allocated {sim.allocated_peak} B "
                f"({pct(sim.allocated_peak, allocated)}); estimate reserved {est.peak_bytes} B "
                f"({pct(est.peak_bytes, reserved)}), allocated {est.allocated_bytes} B, retries "
                f"{est.retries}; tracked live {m.tracked_peak_bytes} B")
            for note in est.measurement.notes:
                log.detail(f"    estimate note: {note}")
    return rows


def predicted_snapshot(est_device, workload, b: int) -> dict:
    """The estimate's trace of the fit rule at ``b`` as ``torch.cuda.memory._snapshot()`` would have it."""
    from autotune.probing import timeline

    return timeline.analyse(timeline.record(workload, est_device, b, runner=est_device)).snapshot


def write_snapshots(log: Log, name: str, b: int, predicted: dict, real: dict) -> None:
    """Both snapshots beside the log, and their reserved peaks."""
    from autotune.devices import snapshot as snap

    folder = os.path.join(os.path.dirname(os.path.abspath(log.path)), "snapshots")
    os.makedirs(folder, exist_ok=True)
    for kind, data in (("predicted", predicted), ("real", real)):
        snap.write(data, os.path.join(folder, f"{name}-{b}.{kind}.pickle"))
    (p, _), (r, _) = snap.peaks(predicted), snap.peaks(real)
    log(f"    snapshots: {folder}/{name}-{b}.{{predicted,real}}.pickle, reserved peaks {p} B predicted, {r} B real "
        f"({pct(p, r)})")


def _trace_of(workload, b: int):
    """A CUDA stand-in's allocation trace of the fit rule at ``b`` (self-test only)."""
    from unittest import mock

    from autotune.devices import EstimateDevice
    from autotune.devices import estimate as estimate_mod
    from autotune.probing.fitrule import fit_rule_work

    made = []
    real_tracker = estimate_mod.LiveStorageTracker

    def keep(**kwargs):
        made.append(real_tracker(**kwargs))
        return made[-1]

    with mock.patch.object(estimate_mod, "LiveStorageTracker", keep):
        EstimateDevice.for_gpu(SELFTEST_GPU).measure(fit_rule_work(workload, b))
    return list(made[-1].trace or [])


def exhaustive(device, workload, usable: int, limit: int) -> tuple[int, int, dict[int, bool]]:
    """Largest size that fits by doubling then bisection, every run real; (max, runs, verdicts)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.helpers
    from tests.helpers import exhaustive_max

    peaks: dict[int, int | None] = {}
    found = exhaustive_max(workload, device, usable, limit, peaks=peaks)
    return found, len(peaks), {b: p is not None and p <= usable for b, p in peaks.items()}


def check_probes(log: Log, make_device, cases, budget: Budget, skipped: list[str],
                 found: dict[tuple[str, int], int]) -> list[list[str]]:
    from autotune.probing.finder import find_max_micro_batch
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
        result = find_max_micro_batch(workload, device, max_batch=limit)
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


def check_assumptions(log: Log, device, gpu: bool) -> list[list[str]]:
    """What the estimate assumes that only a GPU shows: the memory outside PyTorch's allocator (context,
    libraries, driver), and this GPU's NVML total against the preset of the same model."""
    from autotune.devices.presets import CONTEXT_ALLOWANCE, PRESETS

    if not gpu:
        return [["allowance", "n/a on the CPU", fmt(CONTEXT_ALLOWANCE), "-"]]
    import torch

    rows = []
    info = device.describe()
    nvml = getattr(device, "nvml", None)
    if nvml is not None:
        now = nvml.info(device._nvml_index(), own_pid=os.getpid())
        own = now.used_bytes - now.other_process_bytes
        outside = own - int(torch.cuda.memory_reserved(device.index))
        rows.append(["allowance (NVML used by this process - memory_reserved)", fmt(outside),
                     fmt(CONTEXT_ALLOWANCE), pct(CONTEXT_ALLOWANCE, outside)])
        log(f"  outside PyTorch's allocator: NVML used {now.used_bytes} B, other processes "
            f"{now.other_process_bytes} B, reserved {torch.cuda.memory_reserved(device.index)} B: {outside} B "
            f"(the estimate allows {CONTEXT_ALLOWANCE} B)")
    model, total = info.model or "", info.total_bytes
    matches = [p for p in PRESETS if p.model.lower() in model.lower() or model.lower() in p.model.lower()]
    for p in matches:
        rows.append([f"NVML total of {model} vs preset {p.name}", fmt(total), fmt(p.total_bytes),
                     pct(p.total_bytes, total)])
        rows.append([f"compute capability vs preset {p.name}", info.compute_capability or "-", p.sm,
                     "same" if info.compute_capability == p.sm else "DIFFERS"])
    if not matches:
        rows.append([f"no preset for {model!r}", fmt(total), "-", "-"])
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
        log("SELF-TEST ON THE CPU: the 'GPU' figures below are the CPU device's (tracker-counted), not a GPU's; "
            "in check 1 the 'real' peaks are a CUDA stand-in's simulated trace, replayed as a snapshot")
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
            log("  1. peaks: (a) a recorded allocator trace replayed through the simulation vs the real "
                "max_memory_reserved/allocated; (b) the estimate vs the same")
            log("  2. probe: max micro-batch vs an exhaustive real search")
            log("  3. run: a planned run with verification on cuda:0")
            log("  4. assumptions: memory outside PyTorch's allocator; NVML total vs the GPU presets")
            log(f"full log: {args.log}")
            return 0
        device_name, peaks, probes, runs = "cuda:0", GPU_PEAKS, GPU_PROBES, GPU_RUNS
        device = get_device("cuda:0")
        log(f"device: {device.describe().summary}")

    sections = {}
    found: dict[tuple[str, int], int] = {}
    gpu = not args.cpu_selftest
    for name, fn in (("peaks", lambda: check_peaks(log, device, peaks, budget, skipped, gpu)),
                     ("probe", lambda: check_probes(log, lambda m: get_device(device_name, memory_budget=m), probes,
                                                    budget, skipped, found)),
                     ("run", lambda: check_runs(log, device_name, runs, budget, skipped, found)),
                     ("assumptions", lambda: check_assumptions(log, device, gpu))):
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
    table(log, f"1. peaks of one fit-rule run: real (max_memory_reserved / max_memory_allocated), (a) its recorded "
          f"trace replayed through the simulation (within {REPLAY_TOLERANCE:.0%}?), (b) the estimate (reserved within "
          f"{ESTIMATE_TOLERANCE:.0%}?); + means higher than real",
          ["probe", "batch", "reserved", "allocated", "replay reserved", "replay allocated", "replay ok",
           "estimate reserved", "estimate allocated", "estimate ok", "retries est/real", "tracked live", "events",
           "est. s"], sections.get("peaks", []))
    table(log, "2. probe vs exhaustive real search (under --memory-budget)",
          ["probe", "budget", "autotune", "exhaustive", "equal", "real runs", "OOMs", "s", "search runs",
           "monotone near max", "est. error"], sections.get("probe", []))
    table(log, "3. planned runs with verification (autotune run ... --steps 5)",
          ["probe", "target", "budget", "cli", "schedule", "grad rel err", "peak / usable", "samples/s", "verified"],
          sections.get("run", []))
    table(log, "4. assumptions the estimate makes that only a GPU shows",
          ["what", "measured here", "assumed", "assumed vs measured"], sections.get("assumptions", []))
    log("skipped: " + ("nothing" if not skipped else ""))
    for s in skipped:
        log(f"  - {s}")
    log(f"full log: {args.log}")
    bad = any(r[4] == "NO" for r in sections.get("probe", [])) or any(
        not r[-1].startswith("PASSED") for r in sections.get("run", [])) or any(
        "NO" in (r[6], r[9]) for r in sections.get("peaks", []) if len(r) > 9)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
