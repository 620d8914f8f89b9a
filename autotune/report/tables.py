"""The report's tables as pandas DataFrames of display strings (sizes in KiB/MiB/GiB)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from ..results.probe import TRIAL_COLUMNS, Trial
from ..results.run import Check
from ..results.tuning import Candidate, Tuning
from ..units import format_bytes
from .plots import LABELS


def yes_no(value: Any) -> str:
    return "yes" if bool(value) else "no"


def number(value: Any, fmt: str = ",.0f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, fmt)


def relative_error(value: float | None) -> str:
    return number(value, ".2e")


def trials_frame(trials: Sequence[Trial]) -> pd.DataFrame:
    """The probe's trials as data (trials.csv): one row per fit-rule run, sizes in bytes."""
    return pd.DataFrame([t.to_dict() for t in trials], columns=list(TRIAL_COLUMNS))


def trials(items: Sequence[Trial]) -> pd.DataFrame:
    """One row per fit-rule run of the probe, in the order they ran; where a caching allocator decided,
    its reserved peak, allocated peak and release-and-retries."""
    allocator = any(getattr(t, "allocated_bytes", None) is not None for t in items)
    rows = [{
        "#": str(i),
        "micro-batch": str(t.batch),
        "source": t.source,
        "peak": "OOM" if t.oom else format_bytes(t.peak_bytes),
        "allocated": "" if t.allocated_bytes is None else format_bytes(t.allocated_bytes),
        "retries": "" if t.retries is None else str(t.retries),
        "fits": yes_no(t.fits),
        "OOM": yes_no(t.oom),
        "seconds": number(t.seconds, ".2f"),
        "why not": t.why or "",
    } for i, t in enumerate(items, start=1)]
    columns = ["#", "micro-batch", "source", "peak", "fits", "OOM", "seconds", "why not"]
    if allocator:
        columns[3:4] = ["reserved peak", "allocated", "retries"]
        for row in rows:
            row["reserved peak"] = row["peak"]
    return pd.DataFrame(rows, columns=columns)


def breakdown(bars: Sequence[tuple[str, dict[str, int]]]) -> pd.DataFrame:
    """One row per part of memory, one column per bar: bytes and share of that bar's total."""
    keys = list(dict.fromkeys(k for _, parts in bars for k in parts))
    rows = []
    for key in keys + ["total"]:
        row = {"part": LABELS.get(key, key)}
        for label, parts in bars:
            total = sum(parts.values())
            value = total if key == "total" else parts.get(key, 0)
            share = f" ({value / total:.0%})" if total and key != "total" else ""
            row[label] = format_bytes(value) + share
        rows.append(row)
    return pd.DataFrame(rows, columns=["part"] + [label for label, _ in bars])


def options_text(options: Any) -> str:
    if not options:
        return ""
    if isinstance(options, dict):
        return ", ".join(f"{k}={v}" for k, v in options.items())
    return str(options)


def versus(candidate: Candidate) -> str:
    """``baseline`` for the untuned plan, else its throughput over the baseline's as measured one
    after the other (``1.18x``), and head to head where that ran (``; 1.05x ±0.03 head to head``)."""
    if candidate.baseline:
        return "baseline"
    text = "" if candidate.vs_baseline is None else f"{candidate.vs_baseline:.2f}x"
    duel = candidate.head_to_head
    if duel is not None and duel.ratio is not None:
        text += f"; {duel.ratio:.2f}x ±{number(duel.uncertainty, '.2f')} head to head"
    return text


def tuning(record: Tuning) -> pd.DataFrame:
    """The throughput tuner's candidates: what each measured, which one was chosen, why one did not run."""
    rows = [{
        "micro-batch": number(c.micro_batch, "d"),
        "accumulation steps": number(c.accumulation_steps, "d"),
        "options": c.options_label or options_text(c.options) or "defaults",
        "predicted peak": format_bytes(c.predicted_peak_bytes),
        "samples/s": number(c.samples_per_s, ",.1f"),
        "s/step": number(c.seconds_per_step, ".4f"),
        "vs baseline": versus(c),
        "fits": yes_no(c.fits),
        "chosen": "yes" if record.is_chosen(c) else "",
        "why not": c.why,
    } for c in record.candidates]
    return pd.DataFrame(rows, columns=["micro-batch", "accumulation steps", "options", "predicted peak", "samples/s",
                                       "s/step", "vs baseline", "fits", "chosen", "why not"])


def steps(losses: Sequence[float], seconds: Sequence[float]) -> pd.DataFrame:
    rows = [{"step": str(i), "loss": number(loss, ".4f"), "seconds": number(sec, ".3f")}
            for i, (loss, sec) in enumerate(zip(losses, seconds), start=1)]
    return pd.DataFrame(rows, columns=["step", "loss", "seconds"])


def check_value(name: str, value: Any) -> str:
    """A verification check's value or limit as a person reads it."""
    if value is None:
        return "n/a"
    if "memory" in name and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format_bytes(value)
    if "gradient" in name and isinstance(value, float):
        return relative_error(value)
    return str(value)


def checks(items: Sequence[Check]) -> pd.DataFrame:
    rows = [{
        "check": c.name,
        "verdict": "ok" if c.passed else "FAIL",
        "value": check_value(c.name, c.value),
        "limit": check_value(c.name, c.limit),
        "message": c.message,
    } for c in items]
    return pd.DataFrame(rows, columns=["check", "verdict", "value", "limit", "message"])
