"""Throughput tuning with optuna: the fastest exact plan under the memory cap, against a baseline.

Bigger micro-batches are not always faster. For every option combination the
workload offers (e.g. activation checkpointing on/off; the first value of each
option is taken as the workload's own default) the probe finds the largest
micro-batch that fits; the candidates are the plans with 1, 2, 3, ... times the
fewest accumulation steps, so every one keeps the target exact.

The untuned plan (the fewest steps at the probed max, default options) is
measured first: it is the baseline. An optuna study with a brute-force sampler
then measures the other candidates, each once, until ``trials`` candidates have
run or none is left. A measurement times real optimizer steps (k micro-steps and
the optimizer step) the way ``torch.utils.benchmark``'s ``adaptive_autorange``
does: warm-up, then repeated steps until the interquartile range is a small
fraction of the median or the time budget is spent.

Candidates measured one after another see different load on a busy machine, so
they only rank. The fastest then meets the baseline head to head: rounds of one
step of each, interleaved on one model, until their ratio is steady. The median
ratio and its 95% interval decide: the pick is taken only when the whole
interval lies above 1, else the baseline is kept. A candidate whose estimate
does not fit is pruned before it runs; one that runs out of memory is pruned,
not crashed into.

With ``storage`` the study's default name carries a digest of everything that
shapes its candidates (workload, target, world size, multiple-of, uniform,
device, memory budget, margin and the candidates themselves), so a study
resumes only under the same settings; a study named by hand that was made for
other settings is refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from .. import log, options
from ..devices.base import Device
from ..devices.oom import is_oom
from ..errors import BadInput, PlanError
from ..planning.planner import Uniform, check_plan, make_plan
from ..probing.finder import find_max_micro_batch
from ..results.plan import Plan
from ..results.probe import ProbeResult
from ..results.tuning import Candidate, HeadToHead, Tuning
from ..units import plural
from ..workload import Workload
from .study import (
    check_storage,
    default_study_name,
    open_study,
    shown_url,
    study_settings,
)
from .timing import Timing, compare_plans, time_plan

MAX_CANDIDATES = 12


# ---- candidates ---------------------------------------------------------------------------------


def candidate_sizes(target_batch: int, max_micro_batch: int, *, world_size: int, multiple_of: int,
                    uniform: Uniform) -> list[int]:
    """Distinct micro-batch sizes of exact plans, from the largest that fits down (k_min, 2 k_min, ...)."""
    first = make_plan(target_batch, max_micro_batch, world_size=world_size, multiple_of=multiple_of, uniform=uniform)
    per_rank = max(first.per_rank_batch)
    sizes: list[int] = []
    k = first.accumulation_steps
    for _ in range(8 * MAX_CANDIDATES):  # only --uniform skips steps; without it a failure holds for every larger k
        micro = min(max_micro_batch, math.ceil(per_rank / k))
        if len(sizes) == MAX_CANDIDATES or k > per_rank or micro < multiple_of:
            break
        try:
            plan = make_plan(target_batch, micro, world_size=world_size, multiple_of=multiple_of, uniform=uniform)
        except PlanError:
            if not uniform:
                break
            k += 1
            continue
        if plan.micro_batch not in sizes:
            sizes.append(plan.micro_batch)
        k = max(k + 1, plan.accumulation_steps + 1)
    return sizes


# ---- the study --------------------------------------------------------------------------------


def tune(workload: Workload, device: Device, target_batch: int, *, world_size: int = 1, multiple_of: int = 1,
         uniform: Uniform = None, margin: float = options.MARGIN, trials: int = options.TRIALS,
         storage: str | None = None,
         study_name: str | None = None, timing: Timing | None = None, seed: int = 0,
         world_size_source: str = "default",
         probes: dict[str, ProbeResult] | None = None) -> Plan:
    """The fastest exact plan of ``target_batch`` on ``device``, measured against the untuned plan.

    ``trials`` candidates are measured (the baseline first), or all of them when
    there are fewer; a resumed study measures ``trials`` more. ``timing`` says how
    each is timed; ``storage`` is an optuna storage URL (e.g. ``sqlite:///tune.db``).
    """
    if device.estimated:
        raise BadInput("tuning measures real throughput: give a real device (cpu or cuda:N), not estimate")
    trials = options.whole(trials, "trials", text=False)
    check_storage(storage)
    check_plan(target_batch, target_batch, world_size=world_size, multiple_of=multiple_of)
    timing = timing or Timing()
    choices = {_label(c): c for c in workload.choices()}
    probes = dict(probes or {})
    sizes = _probe_choices(workload, device, choices, probes, target_batch, world_size=world_size,
                           multiple_of=multiple_of, uniform=uniform, margin=margin)
    settings = study_settings(workload, device, target_batch, world_size=world_size, multiple_of=multiple_of,
                              uniform=uniform, margin=margin, sizes=sizes)
    base_label = next(iter(choices))
    base_key = (base_label, sizes[base_label][0])

    def measure(label: str, micro: int) -> dict[str, Any]:
        return _measure(workload.configure(**choices[label]), device, probes[label], target_batch, micro,
                        world_size, multiple_of, uniform, timing, seed, label, (label, micro) == base_key)

    study = _run_study(study_name or default_study_name(settings), storage, settings, sizes, base_key, trials, seed,
                       measure)

    def head_to_head(base: dict[str, Any], fastest: dict[str, Any]) -> dict[str, Any]:
        """The fastest candidate against the baseline, interleaved: what decides the pick."""
        plans = [make_plan(target_batch, row["micro_batch"], world_size=world_size, multiple_of=multiple_of,
                           uniform=uniform) for row in (base, fastest)]
        base_wl = workload.configure(**choices[base_label])
        other_wl = base_wl if fastest["options_label"] == base_label else \
            workload.configure(**choices[fastest["options_label"]])
        try:
            ratios = compare_plans(base_wl, device, plans[0], plans[1], other_workload=other_wl, timing=timing,
                                   seed=seed)
        except RuntimeError as exc:  # out of memory is one (torch.OutOfMemoryError too); is_oom tells which
            if not is_oom(exc):
                raise
            del exc
            device.cleanup()
            return {"ratio": None, "uncertainty": None, "rounds": 0,
                    "why": "the head-to-head with the untuned plan ran out of memory"}
        result = {"ratio": ratios.median, "uncertainty": ratios.half_width, "rounds": len(ratios.values), "why": ""}
        steps = plural(fastest["accumulation_steps"], "step")
        log.progress(f"head to head: micro-batch {fastest['micro_batch']} x {steps} "
                     f"runs {ratios.median:.2f}x the untuned plan (±{ratios.half_width:.2f}) over "
                     f"{plural(len(ratios.values), 'round')}")
        return result

    return _pick(study, target_batch, base_key, choices, probes, world_size, multiple_of, uniform,
                 world_size_source, storage, timing, head_to_head)


def _probe_choices(workload: Workload, device: Device, choices: dict[str, dict[str, Any]],
                   probes: dict[str, ProbeResult], target_batch: int, *, world_size: int, multiple_of: int,
                   uniform: Uniform, margin: float) -> dict[str, list[int]]:
    """Each choice of the workload's options probed (into ``probes``, unless it holds that choice already) up to
    its share of the target per rank, and the candidate micro-batch sizes of each (by choice's label)."""
    per_rank = math.ceil(target_batch / world_size)
    sizes: dict[str, list[int]] = {}
    for label, choice in choices.items():
        if label not in probes:
            log.progress(f"probing {workload.name} with {label}")
            probes[label] = find_max_micro_batch(workload.configure(**choice), device, margin=margin,
                                                 max_batch=per_rank, data_parallel=world_size > 1)
        sizes[label] = candidate_sizes(target_batch, probes[label].max_micro_batch, world_size=world_size,
                                       multiple_of=multiple_of, uniform=uniform)
    return sizes


def _run_study(name: str, storage: str | None, settings: dict[str, Any], sizes: dict[str, list[int]],
               base_key: tuple[str, int], trials: int, seed: int,
               measure: Callable[[str, int], dict[str, Any]]) -> Any:
    """Open the study, enqueue the baseline, and measure up to ``trials`` candidates it has not measured."""
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = open_study(optuna, storage, name, settings, seed)
            base_label, base_micro = base_key
            study.enqueue_trial({"options": base_label, f"micro_batch[{base_label}]": base_micro},
                                skip_if_exists=True)
            seen = {_key(t) for t in study.get_trials(deepcopy=False) if t.state.is_finished()}
            left = sum((label, micro) not in seen for label, micro_batches in sizes.items() for micro in micro_batches)
            ran = [0]

            def objective(trial: optuna.Trial) -> float:
                label = trial.suggest_categorical("options", sorted(sizes))
                micro = trial.suggest_categorical(f"micro_batch[{label}]", sizes[label])
                if (label, micro) in seen:  # only after every candidate ran; never timed twice
                    raise optuna.TrialPruned(f"micro-batch {micro} with {label} was measured already")
                seen.add((label, micro))
                row = measure(label, micro)
                trial.set_user_attr("autotune", row)
                ran[0] += row["ran"]
                if row["samples_per_s"] is None:
                    raise optuna.TrialPruned(row["why"])
                return row["samples_per_s"]

            def enough(study: optuna.Study, _trial: optuna.trial.FrozenTrial) -> None:
                if ran[0] >= trials:
                    study.stop()

            if left > 0:
                study.optimize(objective, n_trials=left, callbacks=[enough])
    finally:
        optuna.logging.set_verbosity(level)
    return study


def _key(trial: Any) -> tuple[str, int] | None:
    label = trial.params.get("options")
    return None if label is None else (label, trial.params.get(f"micro_batch[{label}]"))


def _pick(study: Any, target_batch: int, base_key: tuple[str, int], choices: dict[str, dict[str, Any]],
          probes: dict[str, ProbeResult], world_size: int, multiple_of: int, uniform: Uniform,
          world_size_source: str, storage: str | None, timing: Timing,
          head_to_head: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]) -> Plan:
    """The fastest measured candidate if it beats the baseline head to head beyond noise, else the baseline."""
    rows = {(r["options_label"], r["micro_batch"]): dict(r) for t in study.get_trials(deepcopy=False)
            if isinstance(r := t.user_attrs.get("autotune"), dict)}
    measured = [r for r in rows.values() if r.get("samples_per_s") is not None]
    if not measured:
        raise BadInput(f"no tuning candidate fitted and ran: {'; '.join(r['why'] for r in rows.values())}")
    base = rows.get(base_key)
    base = base if base is not None and base.get("samples_per_s") is not None else None
    for row in rows.values():
        row["baseline"] = (row["options_label"], row["micro_batch"]) == base_key
        row["vs_baseline"] = None if base is None or row.get("seconds_per_step") is None else \
            base["seconds_per_step"] / row["seconds_per_step"]
    fastest = max(measured, key=lambda r: r["samples_per_s"])
    versus: dict[str, Any] = {"ratio": None, "uncertainty": None, "rounds": 0, "why": ""}
    if base is not None and fastest is base:
        versus["ratio"] = 1.0
    elif base is not None:
        versus = head_to_head(base, fastest)
        fastest["head_to_head"] = HeadToHead(**versus)
    ratio, uncertainty = versus["ratio"], versus["uncertainty"]
    wins = ratio is not None and uncertainty is not None and ratio - uncertainty > 1
    chosen = fastest if base is None or wins else base
    label = chosen["options_label"]
    plan = make_plan(target_batch, chosen["micro_batch"], world_size=world_size, multiple_of=multiple_of,
                     uniform=uniform, probe=probes[label], world_size_source=world_size_source)
    typed = {key: Candidate.from_row(row) for key, row in rows.items()}
    tuning = Tuning(candidates=tuple(sorted(typed.values(), key=lambda c: (c.options_label, -c.micro_batch))),
                    chosen=typed[(chosen["options_label"], chosen["micro_batch"])],
                    baseline=typed.get(base_key), fastest=typed[(fastest["options_label"], fastest["micro_batch"])],
                    ratio=ratio, uncertainty=uncertainty,
                    kept_baseline=base is not None and fastest is not base and chosen is base,
                    trials=len(study.trials), measured=len(measured), storage=shown_url(storage),
                    study_name=study.study_name, timing=asdict(timing))
    note = _note(chosen, fastest, rows.get(base_key), versus, len(measured), choices)
    return replace(plan, tuning=tuning, notes=plan.notes + (note,))


def _note(chosen: dict[str, Any], fastest: dict[str, Any], base: dict[str, Any] | None, versus: dict[str, Any],
          count: int, choices: dict[str, dict[str, Any]]) -> str:
    def plan_text(row: dict[str, Any]) -> str:
        label = row["options_label"]
        return (f"micro-batch {row['micro_batch']} x {row['accumulation_steps']} steps"
                + (f" with {label}" if choices.get(label) else ""))

    measured = f"{count} candidate{'s' if count != 1 else ''} measured"
    if base is None or base.get("samples_per_s") is None:
        why = base["why"] if base is not None and base.get("why") else "it was not measured"
        return (f"tuned: {plan_text(chosen)} at {chosen['samples_per_s']:,.0f} samples/s, the fastest of {measured}; "
                f"no ratio to the untuned plan ({why})")
    untuned = f"the untuned plan ({plan_text(base)}, {base['samples_per_s']:,.0f} samples/s)"
    if fastest is base:
        return f"tuned: {untuned} is the fastest of {measured}"
    if versus["ratio"] is None:
        return f"tuned: kept {untuned}: {versus['why']}; {measured}"
    ratio = f"{versus['ratio']:.2f}x the baseline (±{versus['uncertainty']:.2f}) head to head"
    if chosen is base:
        noise = ", within noise" if versus["ratio"] + versus["uncertainty"] >= 1 else ""
        return (f"tuned: kept {untuned}: the fastest candidate, {plan_text(fastest)}, ran {ratio}{noise}; "
                f"{measured}")
    return f"tuned: {plan_text(chosen)} runs {ratio} over {untuned}; {measured}"


def _measure(workload: Workload, device: Device, probed: ProbeResult, target_batch: int, micro: int,
             world_size: int, multiple_of: int, uniform: Uniform, timing: Timing, seed: int, label: str,
             baseline: bool) -> dict[str, Any]:
    plan = make_plan(target_batch, micro, world_size=world_size, multiple_of=multiple_of, uniform=uniform)
    row: dict[str, Any] = {"micro_batch": plan.micro_batch, "accumulation_steps": plan.accumulation_steps,
                           "options": dict(workload.chosen), "options_label": label,
                           "predicted_peak_bytes": probed.predicted_peak_at(plan.micro_batch),
                           "fits": True, "samples_per_s": None, "seconds_per_step": None, "spread": None,
                           "timed_steps": 0, "why": "", "ran": False}
    predicted = row["predicted_peak_bytes"]
    if predicted is not None and predicted > probed.usable_bytes:
        row.update(fits=False, why=f"micro-batch {micro} is estimated over the usable memory")
        return row
    row["ran"] = True
    try:
        times = time_plan(workload, device, plan, timing=timing, seed=seed)
    except RuntimeError as exc:  # out of memory is one (torch.OutOfMemoryError too); is_oom tells which
        if not is_oom(exc):
            raise
        del exc
        device.cleanup()
        row.update(fits=False, why=f"micro-batch {micro} ran out of memory")
        return row
    row.update(seconds_per_step=times.median, samples_per_s=target_batch / times.median, spread=times.spread,
               timed_steps=len(times.values))
    log.progress(f"tune {label} micro-batch {plan.micro_batch} x {plural(plan.accumulation_steps, 'step')}"
                 f"{' (the untuned plan)' if baseline else ''}: {row['samples_per_s']:,.0f} samples/s "
                 f"(spread {times.spread:.1%} over {plural(len(times.values), 'step')})")
    return row


def _label(choice: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(choice.items())) if choice else "defaults"
