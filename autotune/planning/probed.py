"""The plan of a target batch from a probe result, as ``autotune.plan`` makes it: the planner's plan,
with the probe's own first note when the store answered it and what was measured or assumed of the
ranks. No torch here: ``autotune serve`` plans a stored answer in its own process with it."""

from __future__ import annotations

from dataclasses import replace

from ..results.plan import Plan
from ..results.probe import ProbeResult
from .planner import Uniform, make_plan


def plan_probed(target_batch: int, result: ProbeResult, *, world_size: int, world_size_source: str,
                multiple_of: int = 1, uniform: Uniform = None) -> Plan:
    """Plan ``target_batch`` over ``world_size`` ranks from ``result`` (``world_size_source``: where the
    world size came from, as :func:`~autotune.planning.planner.world_size_from` says)."""
    planned = make_plan(target_batch, result.max_micro_batch, world_size=world_size, multiple_of=multiple_of,
                        uniform=uniform, probe=result, world_size_source=world_size_source)
    stored = tuple(n for n in result.notes[:1] if result.from_store)
    return replace(planned, notes=stored + planned.notes + measured_or_assumed(result, world_size, world_size_source))


def measured_or_assumed(result: ProbeResult, world: int, source: str) -> tuple[str, ...]:
    """What a plan for several ranks knows of them: measured on every rank, or assumed like this one."""
    if world == 1:
        return ()
    if source == "process group":
        return (f"measured on all {world} ranks (max micro-batch per rank: {', '.join(map(str, result.ranks))})",)
    where = {"flag": "the world size given", "WORLD_SIZE": "$WORLD_SIZE"}.get(source, source)
    return (f"assumed: {world} ranks ({where}), each with a device like this one; measured: the probe on "
            f"{result.device.name} here only",)
