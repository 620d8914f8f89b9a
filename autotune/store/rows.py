"""What the store writes for a probe result and a plan, which of two answers it keeps, and the estimate's
accuracy over measurements. Pure functions of the results; no database, no torch here."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..version import __version__
from .schema import Entry, Observation

if TYPE_CHECKING:
    from ..results.device import DeviceInfo
    from ..results.plan import Plan
    from ..results.probe import ProbeResult


def device_label(info: DeviceInfo) -> str:
    """A device as the store groups measurements: the GPU model, the CPU, or what the estimate stands for."""
    if info.kind == "cuda":
        return info.model or info.name
    if info.kind == "cpu":
        return f"cpu ({info.model})" if info.model else "cpu"
    return info.summary.split("; ")[0]


def entry_row(result: ProbeResult, parts: dict[str, Any]) -> dict[str, Any]:
    """The ``autotune_entries`` row of a new probe result (its fingerprint aside), never served yet."""
    return {
        "workload": result.workload, "device": device_label(result.device), "device_kind": result.device.kind,
        "estimated": result.estimated, "max_micro_batch": result.max_micro_batch, "max_batch": result.max_batch,
        "limited_by": result.limited_by, "created_at": time.time(), "hits": 0, "last_hit_at": None,
        "invalidated_at": None, "invalid_reason": None, "components": json.dumps(parts, sort_keys=True),
        "probe": json.dumps(result.to_dict(), sort_keys=True), "autotune_version": __version__,
    }


def plan_key(plan: Plan) -> str:
    """Which plans of an entry one ``autotune_plans`` row keeps: one per target batch, world size,
    ``multiple_of`` and uniformity, the latest."""
    return f"{plan.target_batch}/{plan.world_size}/{plan.multiple_of}/{plan.uniform}"


def plan_row(plan: Plan) -> tuple[str, dict[str, Any]]:
    """The key (:func:`plan_key`) and the rest of a plan's ``autotune_plans`` row (its fingerprint aside)."""
    return (plan_key(plan), {"target_batch": plan.target_batch, "world_size": plan.world_size,
                             "created_at": time.time(), "plan": json.dumps(plan.to_dict(), sort_keys=True)})


def keeps(old: Entry, new: ProbeResult) -> bool:
    """Is the stored ``old`` kept instead of ``new``: served, readable, and answering every limit ``new`` answers?"""
    if not old.valid or old.damage is not None:
        return False
    if old.limited_by == "memory":
        return new.limited_by != "memory"
    return new.limited_by == "max_batch" and new.max_batch <= old.max_batch


def accuracy(observations: Sequence[Observation]) -> list[dict[str, Any]]:
    """Per device label: measurements, OOMs, and the estimate's error over those with an estimate
    (signed mean, mean of the absolute, the worst, and the same for the allocated peak)."""
    groups: dict[str, list[Observation]] = {}
    for o in observations:
        groups.setdefault(o.device, []).append(o)
    out = []
    for device, rows in sorted(groups.items()):
        errors = [e for o in rows if (e := o.error) is not None]
        alloc = [(o.peak_allocated_bytes - o.estimated_peak_bytes) / o.estimated_peak_bytes for o in rows
                 if o.peak_allocated_bytes is not None and o.estimated_peak_bytes and not o.oom]
        out.append({
            "device": device, "kind": rows[0].device_kind, "measurements": len(rows),
            "ooms": sum(o.oom for o in rows), "compared": len(errors),
            "mean_error": statistics.fmean(errors) if errors else None,
            "mean_abs_error": statistics.fmean(abs(e) for e in errors) if errors else None,
            "worst_error": max(errors, key=abs) if errors else None,
            "allocated_mean_error": statistics.fmean(alloc) if alloc else None,
            "ooms_estimated_to_fit": sum(o.oom and o.estimated_peak_bytes is not None for o in rows),
        })
    return out
