"""The run, its verification, the environment and the folder's files."""

from __future__ import annotations

from collections.abc import Sequence

from ..results.noise import describe
from ..results.run import Check, RunResult
from ..units import format_bytes, plural
from ..version import __version__
from . import plots, tables
from .blocks import Block, Bullets, Code, Image, Rows, Section, Table, Text
from .memory import BREAKDOWN_PLOT, PEAK_PLOT, THROUGHPUT_PLOT
from .subject import Subject, status
from .timeline import files as timeline_files

BN_ADVICE = ("accumulated gradients cannot equal the full-batch gradient; replace BatchNorm with GroupNorm or "
             "LayerNorm, freeze it (eval mode and fixed statistics), or accumulate fewer micro-batches")


def run_section(run: RunResult) -> Section:
    rows = [
        ("Steps", f"{plural(run.steps, 'optimizer step')} of {plural(run.plan.target_batch, 'sample')} "
                  f"({run.precision})"),
        ("Throughput", f"{run.samples_per_s:,.0f} samples/s, {run.items_per_s:,.0f} items/s"),
        ("Peak memory", f"{format_bytes(run.peak_bytes)} of {format_bytes(run.usable_bytes)} usable"),
        ("Predicted peak", format_bytes(run.predicted_peak_bytes)),
    ]
    if run.skipped_steps:
        rows.append(("Skipped steps", f"{run.skipped_steps} (GradScaler found inf/nan gradients)"))
    return Section("run", "Training run", (Rows(tuple(rows)), Table(tables.steps(run.losses, run.step_seconds))))


NOISE_PLOT = "noise_scale.png"


def noise_section(run: RunResult) -> Section:
    """The gradient noise scale the run's micro-steps measured, over the steps, and what it means."""
    est = run.noise_scale
    assert est is not None
    word = describe(est)
    text = ("The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018) predicts the critical batch: "
            "well below it a larger batch buys almost proportionally fewer optimizer steps, well above it extra "
            f"samples buy almost nothing. Measured from the run's micro-steps ({plural(est.steps, 'step')}"
            f"{', ' + plural(est.skipped, 'step') + ' without an estimate' if est.skipped else ''}).")
    blocks: list[Block] = [Text(text), Text(word[0].upper() + word[1:], "muted" if est.b_simple is None else None)]
    history = [(h.step + 1, h.b_simple, h.low, h.high) for h in est.history]
    if any(b is not None for _, b, _, _ in history) and est.items_per_step:
        png = plots.noise_scale(history, batch=est.items_per_step, unit=est.unit)
        blocks.append(Image(NOISE_PLOT, "Gradient noise scale over the run", png))
    return Section("noise", "Gradient noise scale", tuple(blocks))


def warnings(checks: Sequence[Check]) -> list[str]:
    """BatchNorm and dropout findings of the gradient check, as sentences."""
    out = []
    for check in checks:
        details = check.details
        layers = details.get("running_statistics")
        if layers:
            out.append(f"BatchNorm: {plural(len(layers), 'layer')} normalise each micro-batch with its own statistics "
                       f"({', '.join(map(str, layers))}): {BN_ADVICE}.")
        if details.get("dropout"):
            out.append(f"Dropout: {details['dropout']}.")
    return out


def verification_section(run: RunResult) -> Section:
    v = run.verification
    assert v is not None
    checks = v.checks
    failed = [c.name for c in v.failed]
    head = (Text(f"Verification PASSED: all {plural(len(checks), 'check')} hold.", "ok") if v.passed
            else Text(f"Verification FAILED: {', '.join(failed) or 'see the checks'}.", "fail"))
    rows = []
    grad = v.check("gradient_equivalence")
    if v.gradient_relative_error is not None or grad is not None:
        limit = "" if grad is None or grad.limit is None else f" (limit {grad.limit:g})"
        rows.append(("Gradient relative error", tables.relative_error(v.gradient_relative_error) + limit))
        if grad is not None and grad.details.get("reference"):
            rows.append(("Compared with", str(grad.details["reference"])))
    ratio = "" if run.memory_ratio is None else f" (ratio {run.memory_ratio:.3f})"
    rows.append(("Measured vs predicted peak",
                 f"{format_bytes(run.peak_bytes)} measured vs {format_bytes(run.predicted_peak_bytes)} predicted"
                 f"{ratio}; usable {format_bytes(run.usable_bytes)}"))
    blocks: list[Block] = [head, Rows(tuple(rows), id="verification-table")]
    found = warnings(checks)
    if found:
        blocks.append(Bullets(tuple(found), tone="warn"))
    blocks.append(Table(tables.checks(checks)))
    return Section("verification", "Verification", tuple(blocks))


_SHOWN = ("name", "model", "kind", "torch", "driver", "allocator_conf", "measured_by", "capacity_source",
          "summary", "estimated", "capacity_bytes")


def environment(s: Subject) -> Section:
    if s.device is None:
        return Section("environment", "Environment", (Rows((
            ("Device", "none recorded (a plan made without a probe)"),
            ("Report made by", f"autotune {__version__}")), id="environment-table"),))
    device = s.device
    conf = device.allocator_conf
    rows = [
        ("torch", device.torch),
        ("Device", f"{device.name} ({device.kind})"),
        ("Device model", device.model or "unknown"),
        ("Driver", device.driver or ("n/a (not a CUDA device)" if device.kind != "cuda" else "unknown")),
        ("Allocator settings", "n/a (not a CUDA device)" if conf is None else (conf or "(not set)")),
        ("Memory measured by", device.measured_by),
        ("Capacity from", device.capacity_source),
        ("Result", status(s.probe) if s.probe is not None else "no probe result"),
    ]
    for key, value in device.to_dict().items():
        if key in _SHOWN or value is None or value == "" or isinstance(value, (dict, list)) and not value:
            continue
        if key.endswith("_bytes") and isinstance(value, (int, float)) and not isinstance(value, bool):
            key, value = key.removesuffix("_bytes"), format_bytes(value)
        rows.append((key.replace("_", " "), str(value)))
    rows.append(("Report made by", f"autotune {__version__}"))
    return Section("environment", "Environment", (Rows(tuple(rows), id="environment-table"),))


def files(s: Subject) -> Section:
    names = [("report.html", "this report, self-contained (plots embedded)"),
             ("report.md", "the same report in Markdown, plots as the PNG files beside it")]
    if s.probe is not None:
        names += [(PEAK_PLOT, "peak memory vs micro-batch"),
                  (BREAKDOWN_PLOT, "where the memory goes"),
                  ("trials.csv", "the probe's trials (sizes in bytes)")]
        names += list(timeline_files(s.probe.memory))
    if s.plan is not None and s.plan.tuning is not None and s.plan.tuning.candidates:
        names.append((THROUGHPUT_PLOT, "throughput vs micro-batch"))
    if s.run is not None and s.run.noise_scale is not None and any(h.b_simple is not None
                                                                    for h in s.run.noise_scale.history):
        names.append((NOISE_PLOT, "the gradient noise scale over the run"))
    if s.run is not None and s.run.batch_schedule:
        names.append(("batch_ramp.png", "the loss, effective batch and noise scale over the batch ramp"))
    names.append((s.json_name, f"the full {s.kind} as JSON (schema in reports/README.md)"))
    return Section("files", "Files", (
        Bullets(tuple(f"{name}: {what}" for name, what in names)),
        Text("Regenerate this report from its JSON:"),
        Code(f"autotune report {s.json_name} --out NEW_FOLDER")))
