"""What a report says, built once from a Plan, RunResult or ProbeResult (JSON alone is enough).

Sections: summary, peak memory vs micro-batch, where the memory goes,
throughput (when tuned), the run, its batch ramp (when it ramped) and its verification (for a RunResult),
the trials, notes, environment, files.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ..results.plan import Plan
from ..units import format_bytes, format_margin, plural
from ..version import __version__
from . import memory, ramp, runs, tables, timeline
from .blocks import Bullets, Code, Report, Rows, Section, Table, Text
from .subject import Subject, status


def build(result: Any, *, generated: datetime | None = None) -> Report:
    s = Subject.of(result)
    sections = [summary(s)]
    if s.probe is not None:
        sections += [memory.peak_section(s), memory.breakdown_section(s)]
        if s.probe.memory is not None:
            sections.append(timeline.section(s.probe.memory, usable=s.probe.usable_bytes,
                                             capacity=s.probe.capacity_bytes,
                                             title=f"Memory over the fit rule: {s.probe.workload} on "
                                                   f"{s.probe.device.name}, micro-batch {s.probe.memory.batch}"))
    if s.plan is not None and s.plan.tuning is not None and s.plan.tuning.candidates:
        sections.append(memory.throughput_section(s))
    if s.plan is not None:
        sections.append(schedule_section(s.plan))
    if s.run is not None:
        sections.append(runs.run_section(s.run))
        if s.run.batch_schedule:
            sections.append(ramp.ramp_section(s.run))
        if s.run.verification is not None:
            sections.append(runs.verification_section(s.run))
        if s.run.noise_scale is not None:
            sections.append(runs.noise_section(s.run))
    if s.probe is not None:
        sections.append(Section("trials", "Trials", (
            Text("Every run of the fit rule the probe made, in order: estimates with fake tensors, then real runs "
                 "on the device. Also in trials.csv (sizes in bytes there)."),
            Table(tables.trials(s.probe.trials)))))
    notes = [*(s.run.notes if s.run else ()), *(s.plan.notes if s.plan else ()), *(s.probe.notes if s.probe else ())]
    if notes:
        sections.append(Section("notes", "Notes", (Bullets(tuple(dict.fromkeys(notes))),)))
    sections += [runs.environment(s), runs.files(s)]
    stamp = (generated or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M:%S UTC")
    title = f"autotune memory report: {s.name}" + (f" on {s.device.name}" if s.device is not None else "")
    return Report(title=title, verdict=verdict(s), sections=tuple(sections),
                  footer=f"Generated {stamp} by autotune {__version__} from a {s.kind}.")


def verdict(s: Subject) -> Text:
    if s.run is not None and s.plan is not None:
        v = s.run.verification
        word = "not verified" if v is None else ("verification PASSED" if v.passed else "verification FAILED")
        tone = "warn" if v is None else ("ok" if v.passed else "fail")
        return Text(f"Ran {s.plan.arithmetic} for {plural(s.run.steps, 'step')}: {word}; peak "
                    f"{format_bytes(s.run.peak_bytes)} of {format_bytes(s.run.usable_bytes)} usable.", tone)
    if s.plan is not None and s.probe is not None:
        return Text(f"Plan {s.plan.arithmetic}: peak {format_bytes(s.plan.predicted_peak_of(0))} of "
                    f"{format_bytes(s.probe.usable_bytes)} usable, {status(s.probe)}.",
                    "warn" if s.probe.estimated else "ok")
    if s.plan is not None:
        return Text(f"Plan {s.plan.arithmetic} (no probe result in this plan: no memory figures).", "muted")
    assert s.probe is not None
    text = s.probe.summary()
    return Text(text[0].upper() + text[1:] + ".", "warn" if s.probe.estimated else "ok")


def summary(s: Subject) -> Section:
    rows: list[tuple[str, str]] = []
    p, plan, run = s.probe, s.plan, s.run
    if p is not None:
        rows += [
            ("Workload", p.workload + (f" ({tables.options_text(p.options)})" if p.options else "")),
            *([("Model", p.model.report_line())] if p.model is not None else []),
            ("Device", p.device.summary),
            ("Capacity", f"{format_bytes(p.capacity_bytes)} (from {p.device.capacity_source})"),
            ("Margin", format_margin(p.margin)),
            ("Usable memory", f"{format_bytes(p.usable_bytes)} = capacity x (1 - margin)"),
            ("Max micro-batch", str(p.max_micro_batch)),
            ("Max micro-batch found by", f"{status(p)}; limited by "
             + ("memory" if p.limited_by == "memory" else "the host's memory (the batch built on the host)"
                if p.limited_by == "host_memory" else f"the largest size allowed ({p.max_batch})")
             + f"; {plural(p.real_runs, 'real run')}, {p.real_ooms} out of memory"),
        ]
        ranks = tuple(getattr(p, "ranks", ()) or ())
        if len(ranks) > 1:
            rows.append(("Max micro-batch per rank", ", ".join(f"rank {r}: {m}" for r, m in enumerate(ranks))))
        if getattr(p, "data_parallel", False):
            rows.append(("Fit rule", "held DDP's gradient buckets (data-parallel)"))
        rows += [
            ("Peak at max micro-batch", f"{format_bytes(p.peak_bytes)} "
             + ("(estimated)" if p.estimated else f"measured; estimate {format_bytes(p.predicted_peak_bytes)}"
                + ("" if p.estimate_error is None else f", off by {p.estimate_error:+.1%}"))),
        ]
        allocator = p.allocator_line()
        if allocator is not None:
            rows.append(("Caching allocator", allocator[0].upper() + allocator[1:]))
    if plan is not None:
        if p is None:
            rows.append(("Max micro-batch", f"{plan.max_micro_batch} (given; no probe result in this plan)"))
        rows += [
            ("Plan", plan.arithmetic),
            ("Micro-batch", str(plan.micro_batch)),
            ("Accumulation steps", str(plan.accumulation_steps)),
            ("World size", f"{plan.world_size} ({plan.world_size_source})"),
        ]
        if plan.probe is not None and plan.headroom_bytes is not None:
            head = plan.headroom_bytes
            rows += [
                ("Predicted peak", f"{format_bytes(plan.predicted_peak_bytes)} at micro-batch {plan.micro_batch}"),
                ("Headroom", f"{format_bytes(head)} ({head / plan.probe.usable_bytes:.1%} of usable)"),
            ]
    if run is not None:
        ratio = "" if run.memory_ratio is None else f", {run.memory_ratio:.3f} x predicted"
        v = run.verification
        rows += [
            ("Measured peak (run)", f"{format_bytes(run.peak_bytes)}{ratio}"),
            ("Throughput", f"{run.samples_per_s:,.0f} samples/s"
             + ("" if abs(run.items_per_s - run.samples_per_s) < 1e-9 else f", {run.items_per_s:,.0f} items/s")),
            ("Loss", f"{run.losses[0]:.4f} -> {run.losses[-1]:.4f} over {plural(run.steps, 'step')} ({run.precision})"),
            ("Verification", "not run" if v is None else ("PASSED" if v.passed else "FAILED")),
        ]
        if v is not None and v.gradient_relative_error is not None:
            rows.append(("Gradient relative error", tables.relative_error(v.gradient_relative_error)))
    return Section("summary", "Summary", (Rows(tuple(rows), id="summary-table"),))


def schedule_section(plan: Plan) -> Section:
    shown = plan.schedule[:8]
    items = [f"rank {r}: " + ", ".join(map(str, rank[:32])) + (f", ... ({len(rank)} in all)" if len(rank) > 32 else "")
             + f" = {plural(sum(rank), 'sample')}" for r, rank in enumerate(shown)]
    if len(plan.schedule) > len(shown):
        items.append(f"... and {plural(len(plan.schedule) - len(shown), 'more rank')}")
    text = (f"Each optimizer step takes exactly {plural(plan.target_batch, 'sample')}: micro-batch sizes per rank and "
            "micro-step, each loss weighted by its share n_i / N of the effective batch.")
    return Section("schedule", "Schedule", (Text(text), Code(plan.arithmetic), Bullets(tuple(items))))
