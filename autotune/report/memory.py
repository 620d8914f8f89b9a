"""The memory sections: peak vs micro-batch, where the memory goes, throughput when tuned."""

from __future__ import annotations

from ..results.tuning import Tuning
from ..units import plural
from . import plots, tables
from .blocks import Image, Section, Table, Text
from .subject import Subject

PEAK_PLOT = "peak_vs_batch.png"
BREAKDOWN_PLOT = "memory_breakdown.png"
THROUGHPUT_PLOT = "throughput_vs_batch.png"


def peak_section(s: Subject) -> Section:
    p = s.probe
    assert p is not None
    real = [(t.batch, t.peak_bytes, t.fits) for t in p.trials if t.source == "real"]
    png = plots.peak_vs_batch(curve=p.curve, real=real, capacity=p.capacity_bytes, usable=p.usable_bytes,
                              margin=p.margin, chosen=s.chosen, max_micro_batch=p.max_micro_batch,
                              run_peak=s.run.peak_bytes if s.run is not None else None,
                              title=f"Peak memory vs micro-batch: {p.workload} on {p.device.name}"
                                    + (" (estimated)" if p.estimated else ""))
    text = ("The line is the peak the estimate predicts at each micro-batch (fake tensors, no device memory); "
            "the markers are real runs on the device. A micro-batch fits while its peak stays at or below the "
            "usable line.")
    return Section("peak", "Peak memory vs micro-batch",
                   (Text(text), Image(PEAK_PLOT, "Peak memory vs micro-batch", png)))


def breakdown_bars(s: Subject) -> list[tuple[str, dict[str, int]]]:
    """The breakdown measured at the max micro-batch and, when the plan's micro-batch is smaller, the
    one derived for it: the same parameters, gradients and optimizer state; the rest of its predicted
    peak is activations and temporaries."""
    p = s.probe
    assert p is not None
    parts = {k: int(v) for k, v in p.breakdown.items()}
    if p.peak_bytes > sum(parts.values()):
        parts["other"] = p.peak_bytes - sum(parts.values())
    how = "estimated" if p.estimated else "measured"
    bars = [(f"max: {p.max_micro_batch} ({how})", parts)]
    peak = s.plan.predicted_peak_bytes if s.plan is not None else None
    if s.chosen != p.max_micro_batch and peak is not None and parts:
        fixed = {k: v for k, v in parts.items() if k not in ("activations", "other")}
        derived = {**fixed, "activations": max(0, peak - sum(fixed.values()))}
        bars.insert(0, (f"plan: {s.chosen} (predicted)", derived))
    return bars


def breakdown_section(s: Subject) -> Section:
    p = s.probe
    assert p is not None
    if not p.breakdown:
        return Section("memory", "Where the memory goes", (Text("No breakdown was recorded.", "muted"),))
    bars = breakdown_bars(s)
    png = plots.memory_breakdown(bars, usable=p.usable_bytes, capacity=p.capacity_bytes)
    text = ("Live memory at the peak of the fit rule, by what it holds. Parameters, gradients and optimizer "
            "state do not depend on the micro-batch; activations and temporaries grow with it.")
    if len(bars) > 1:
        text += (f" The bar for micro-batch {s.chosen} keeps those and attributes the rest of its predicted peak "
                 "to activations and temporaries.")
    return Section("memory", "Where the memory goes", (
        Text(text), Image(BREAKDOWN_PLOT, "Where the memory goes at the peak", png), Table(tables.breakdown(bars))))


def throughput_section(s: Subject) -> Section:
    assert s.plan is not None and s.plan.tuning is not None
    tuning = s.plan.tuning
    points = [(c.micro_batch, c.samples_per_s, c.fits, tuning.is_chosen(c), c.options_label)
              for c in tuning.candidates]
    png = plots.throughput(points)
    timing = tuning.timing
    extra = [plural(tuning.trials, "trial") if tuning.trials else "",
             (f"each timed until its interquartile range is within {timing['threshold']:.0%} of the median "
              f"or {timing['budget_s']:g} s are spent" if timing.get("threshold") and timing.get("budget_s") else ""),
             f"study {tuning.study_name}" if tuning.study_name else "",
             f"storage {tuning.storage}" if tuning.storage else ""]
    text = ("Real throughput of exact candidate plans under the memory cap (every one keeps the target batch); "
            "the fastest that fits is chosen.")
    if tuning.baseline is not None:
        text = ("Real throughput of exact candidate plans under the memory cap (every one keeps the target batch), "
                "measured one after another against the untuned plan (the baseline); the fastest then runs head "
                "to head with the baseline, interleaved, and is chosen only when the whole 95% interval of that "
                "ratio lies above 1." + _verdict(tuning))
    if any(extra):
        text += " (" + ", ".join(e for e in extra if e) + ")"
    return Section("throughput", "Throughput vs micro-batch", (
        Text(text), Image(THROUGHPUT_PLOT, "Throughput vs micro-batch", png), Table(tables.tuning(tuning))))


def _verdict(tuning: Tuning) -> str:
    """One sentence: how the fastest candidate did head to head with the baseline, and what was kept."""
    fastest, ratio, uncertainty = tuning.fastest, tuning.ratio, tuning.uncertainty
    if fastest is None:
        return ""
    if fastest.baseline:
        return " The untuned plan was the fastest."
    size = f"micro-batch {fastest.micro_batch} x {plural(fastest.accumulation_steps, 'step')}"
    if ratio is None or uncertainty is None:
        return f" The fastest, {size}, was not compared with the untuned plan, which did not run."
    versus = f"{ratio:.2f}x the baseline (±{tables.number(uncertainty, '.2f')})"
    if tuning.kept_baseline:
        return f" The fastest, {size}, ran {versus} head to head, so the untuned plan is kept."
    return f" Chosen: {size}, {versus} head to head."
