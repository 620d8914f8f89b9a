"""Throughput tuning with optuna: the fastest exact plan under the memory cap.

Bigger micro-batches are not always faster. For every option combination the
workload offers (e.g. activation checkpointing on/off) the probe finds the
largest micro-batch that fits; the candidates are the plans with 1, 2, 3, ...
times the fewest accumulation steps, so every one keeps the target exact. An
optuna study times real optimizer steps (k micro-steps + the optimizer step)
of the candidates it picks and keeps the fastest. A candidate whose estimate
does not fit is pruned before it runs; one that runs out of memory anyway is
pruned, not crashed into.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..devices.base import Device
from ..devices.oom import is_oom
from ..errors import BadInput
from ..planning.planner import make_plan
from ..probing.finder import probe
from ..results.plan import Plan
from ..results.probe import ProbeResult
from ..units import plural
from ..workload import Workload
from .accumulate import Accumulator

Progress = Callable[[str], None]
MAX_CANDIDATES = 12


def candidate_sizes(target_batch: int, max_micro_batch: int, *, world_size: int, multiple_of: int,
                    uniform: bool | None) -> list[int]:
    """Distinct micro-batch sizes of exact plans, from the largest that fits down (k_min, 2 k_min, ...)."""
    first = make_plan(target_batch, max_micro_batch, world_size=world_size, multiple_of=multiple_of, uniform=uniform)
    per_rank = max(first.per_rank_batch)
    sizes: list[int] = []
    k = first.accumulation_steps
    while len(sizes) < MAX_CANDIDATES and k <= per_rank:
        try:
            plan = make_plan(target_batch, min(max_micro_batch, math.ceil(per_rank / k)), world_size=world_size,
                             multiple_of=multiple_of, uniform=uniform)
        except BadInput:
            k += 1
            continue
        if plan.micro_batch not in sizes:
            sizes.append(plan.micro_batch)
        k = max(k + 1, plan.accumulation_steps + 1)
    return sizes


def time_plan(workload: Workload, device: Device, plan: Plan, *, steps: int = 2, seed: int = 0) -> float:
    """Median seconds of one real optimizer step by ``plan`` (after one warm-up step)."""
    target = device.torch_device
    sync = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)
    with torch.random.fork_rng(devices=[target.index or 0] if target.type == "cuda" else []):
        torch.manual_seed(seed)
        model = workload.model().to(target)
        model.train()
        opt = workload.optimizer(model.parameters())
        acc = Accumulator(model, opt, plan.schedule[0], loss=workload.loss, items=workload.items)
        gen = torch.Generator().manual_seed(seed)
        times = []
        for i in range(steps + 1):
            batch = workload.batch(sum(plan.schedule[0]), gen)
            sync()
            start = time.perf_counter()
            acc.step(batch)
            sync()
            if i:  # the first step warms up kernels and allocates optimizer state
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def tune(workload: Workload, device: Device, target_batch: int, *, world_size: int = 1, multiple_of: int = 1,
         uniform: bool | None = None, margin: float = 0.1, trials: int = 12, storage: str | None = None,
         study_name: str | None = None, steps: int = 2, seed: int = 0, world_size_source: str = "default",
         progress: Progress | None = None, probes: dict[str, ProbeResult] | None = None) -> Plan:
    """The fastest exact plan of ``target_batch``, measured on ``device`` by an optuna study."""
    import optuna

    if device.estimated:
        raise BadInput("--tune measures real throughput: give a real device (cpu or cuda:N), not estimate")
    if trials < 1:
        raise BadInput(f"--trials {trials} must be at least 1")
    per_rank = math.ceil(target_batch / world_size)
    choices = {_label(c): c for c in workload.choices()}
    probes = dict(probes or {})
    sizes: dict[str, list[int]] = {}
    for label, choice in choices.items():
        if label not in probes:
            if progress:
                progress(f"probing {workload.name} with {label}")
            probes[label] = probe(workload.configure(**choice), device, margin=margin, max_batch=per_rank,
                                  data_parallel=world_size > 1)
        sizes[label] = candidate_sizes(target_batch, probes[label].max_micro_batch, world_size=world_size,
                                       multiple_of=multiple_of, uniform=uniform)
    measured: dict[tuple[str, int], dict[str, Any]] = {}

    def objective(trial: optuna.Trial) -> float:
        label = trial.suggest_categorical("options", sorted(choices))
        micro = trial.suggest_categorical(f"micro_batch[{label}]", sizes[label])
        key = (label, micro)
        if key not in measured:
            measured[key] = _measure(workload.configure(**choices[label]), device, probes[label], target_batch,
                                     micro, world_size, multiple_of, uniform, steps, seed, label, progress)
        row = measured[key]
        if row["samples_per_s"] is None:
            raise optuna.TrialPruned(row["why"])
        return row["samples_per_s"]

    sampler = optuna.samplers.TPESampler(seed=seed)
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(direction="maximize", sampler=sampler, storage=storage, load_if_exists=True,
                                    study_name=study_name or f"autotune-{workload.name}-{target_batch}")
        study.optimize(objective, n_trials=trials)
    finally:
        optuna.logging.set_verbosity(level)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        raise BadInput(f"no tuning trial fitted and ran: {'; '.join(r['why'] for r in measured.values())}")
    best = max(done, key=lambda t: t.value)
    label = best.params["options"]
    micro = best.params[f"micro_batch[{label}]"]
    candidates = sorted(measured.values(), key=lambda r: (r["options_label"], -r["micro_batch"]))
    chosen = measured.get((label, micro)) or {"micro_batch": micro, "options": choices[label],
                                              "samples_per_s": best.value}
    tuning = {"candidates": candidates, "chosen": chosen, "trials": len(study.trials), "storage": storage,
              "study_name": study.study_name, "steps_per_trial": steps}
    plan = make_plan(target_batch, micro, world_size=world_size, multiple_of=multiple_of, uniform=uniform,
                     probe=probes[label], world_size_source=world_size_source)
    note = (f"tuned: {best.value:,.0f} samples/s with micro-batch {micro}"
            f"{' and ' + label if choices[label] else ''}, "
            f"the fastest of {plural(len(measured), 'candidate')} measured")
    return replace(plan, tuning=tuning, notes=plan.notes + (note,))


def _measure(workload: Workload, device: Device, probed: ProbeResult, target_batch: int, micro: int,
             world_size: int, multiple_of: int, uniform: bool | None, steps: int, seed: int, label: str,
             progress: Progress | None) -> dict[str, Any]:
    plan = make_plan(target_batch, micro, world_size=world_size, multiple_of=multiple_of, uniform=uniform)
    row: dict[str, Any] = {"micro_batch": plan.micro_batch, "accumulation_steps": plan.accumulation_steps,
                           "options": dict(workload.chosen), "options_label": label,
                           "predicted_peak_bytes": probed.predicted_peak_at(plan.micro_batch),
                           "fits": True, "samples_per_s": None, "seconds_per_step": None, "why": ""}
    predicted = row["predicted_peak_bytes"]
    if predicted is not None and predicted > probed.usable_bytes:
        row.update(fits=False, why=f"micro-batch {micro} is estimated over the usable memory")
        return row
    try:
        seconds = time_plan(workload, device, plan, steps=steps, seed=seed)
    except Exception as exc:
        if not is_oom(exc):
            raise
        del exc
        device.cleanup()
        row.update(fits=False, why=f"micro-batch {micro} ran out of memory")
        return row
    row.update(seconds_per_step=seconds, samples_per_s=target_batch / seconds)
    if progress:
        progress(f"tune {label} micro-batch {plan.micro_batch} x {plural(plan.accumulation_steps, 'step')}: "
                 f"{row['samples_per_s']:,.0f} samples/s")
    return row


def _label(choice: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(choice.items())) if choice else "defaults"
