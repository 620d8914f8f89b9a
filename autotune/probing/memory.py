"""``--memory-snapshot``: the fit rule at the chosen micro-batch as a snapshot in torch's format, where its peak
comes from, what would lower it most, and allocator settings compared; on a real GPU the real snapshot beside.

:func:`explain` returns the :class:`~autotune.results.timeline.MemoryTimeline`
a ProbeResult carries (``memory``) and writes the snapshot files. It costs one
recorded run of the estimate at that size, one more for the activation
checkpointing figure, and, when another allocator setting may fit a larger
micro-batch, the recorded runs that search it. Only asked for, never by default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import log
from ..devices import snapshot as snap
from ..devices.history import RecordingDevice
from ..results.probe import ProbeResult
from ..results.request import FitRule
from ..results.timeline import AllocatorOption, MemoryTimeline, RealTimeline
from ..workload import Workload
from .advice import Settings, advise, compare, user_variable
from .fitrule import run_trial
from .fsdp import Sharding
from .lowering import Levers, lowering
from .timeline import Recorded, analyse, record

POINTS = 400  # points of each series of the real-vs-predicted comparison


def real_path(path: str | os.PathLike[str]) -> Path:
    """Where the real GPU's snapshot goes beside the predicted one: ``name.real.pickle``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.real{p.suffix or '.pickle'}")


def explain(result: ProbeResult, workload: Workload, device: Any, *, batch: int | None = None,
            path: str | os.PathLike[str] | None = None, rule: FitRule | None = None) -> MemoryTimeline:
    """The memory timeline of the fit rule at ``batch`` (default: the max micro-batch); the predicted snapshot
    written to ``path`` when given (and, on a real GPU recorded by a :class:`RecordingDevice`, the real one to
    :func:`real_path`)."""
    rule = rule or FitRule()
    batch = batch or result.max_micro_batch
    base = device.device if isinstance(device, RecordingDevice) else device
    log.progress(f"recording the fit rule at micro-batch {batch} for a memory timeline ...")
    recorded = record(workload, base, batch, rule=rule)
    walk = analyse(recorded)
    if path is not None:
        snap.write(walk.snapshot, path, what=f"--memory-snapshot {path}")
    options, advice = _allocator(recorded, result, workload, batch, rule)
    levers = Levers(fits=(result.max_micro_batch, result.peak_bytes), allocator=_least(options, result))
    sentence, saved = lowering(recorded, walk, workload, batch, rule=rule, levers=levers)
    real = _real(device, result, workload, batch, walk.snapshot, path, rule) \
        if isinstance(device, RecordingDevice) else None
    context = getattr(recorded.device, "allowance", 0) if recorded.simulation is not None else 0
    parts = tuple(walk.parts)
    if context:
        from ..results.timeline import PeakPart

        parts += (PeakPart(kind="context", name="CUDA context and libraries (allowance)", bytes=context),)
    return MemoryTimeline(batch=batch, simulated=recorded.simulation is not None,
                          reserved_peak_bytes=walk.reserved_peak, allocated_peak_bytes=walk.allocated_peak,
                          peak_event=walk.peak_event, peak_phase=walk.peak_phase, events=walk.events, parts=parts,
                          phases=tuple(recorded.recording.phases), series=tuple(walk.series), lowering=sentence,
                          lowering_bytes=saved, options=tuple(options), advice=tuple(advice),
                          snapshot_file=str(path) if path is not None else None, real=real,
                          out_of_memory=walk.out_of_memory)


def _allocator(recorded: Recorded, result: ProbeResult, workload: Workload, batch: int,
               rule: FitRule) -> tuple[list[Any], list[str]]:
    """The user's allocator settings and the candidates compared at ``batch`` (a GPU stand-in only)."""
    runner = recorded.device
    if recorded.simulation is None:
        return [], []
    traces = {batch: recorded.recording.trace}

    def trace_at(b: int) -> list[tuple[int, int, int]]:
        if b not in traces:
            traces[b] = record(workload, runner, b, frames=False, runner=runner, rule=rule).recording.trace
        return traces[b]

    settings = Settings(user_conf=runner.alloc_conf, capacity=runner.capacity_bytes(),
                        device_total=runner.device_total, usable=result.usable_bytes, trace_at=trace_at)
    options = compare(settings, batch, result.max_micro_batch, result.max_batch)
    return options, advise(options, batch, user_variable(result.device), result.max_batch)


def _least(options: list[AllocatorOption], result: ProbeResult) -> tuple[str, int] | None:
    """The setting (``VARIABLE=conf``) that reserves least at the timeline's micro-batch without running out of
    memory, where that is less than the user's settings reserve (or they run out)."""
    if not options:
        return None
    user = options[0]
    better = [o for o in options[1:] if not o.out_of_memory and (user.out_of_memory or
                                                                  o.reserved_bytes < user.reserved_bytes)]
    if not better:
        return None
    best = min(better, key=lambda o: o.reserved_bytes)
    return f"{user_variable(result.device)}={best.conf}", best.reserved_bytes


def _real(device: RecordingDevice, result: ProbeResult, workload: Workload, batch: int,
          predicted: dict[str, Any], path: str | os.PathLike[str] | None, rule: FitRule) -> RealTimeline | None:
    """The real GPU's snapshot at ``batch``: the confirm run's when it ran at that size, else one more real run."""
    found = device.snapshot_of(result.trials, batch)
    if found is None:
        log.progress(f"real run at micro-batch {batch} to record the GPU allocator's history ...")
        before = len(device.snapshots)
        run_trial(device, workload, batch, result.usable_bytes, source="real", capacity_guard=True,
                  data_parallel=rule.buckets, sharding=Sharding.of(rule))
        found = device.snapshots[-1] if len(device.snapshots) > before else None
    if found is None:
        return None
    where = None
    if path is not None:
        where = real_path(path)
        snap.write(found, where, what=f"--memory-snapshot {where}")
    return compare_real(found, predicted, snapshot_file=str(where) if where is not None else None)


def compare_real(real: dict[str, Any], predicted: dict[str, Any], *, snapshot_file: str | None = None
                 ) -> RealTimeline:
    """The real and the predicted snapshots' timelines by allocation number, and their reserved peaks."""
    real_reserved, real_requested = snap.peaks(real)
    predicted_reserved, _ = snap.peaks(predicted)
    return RealTimeline(reserved_peak_bytes=real_reserved, requested_peak_bytes=real_requested,
                        predicted_reserved_peak_bytes=predicted_reserved, real=tuple(_thin(snap.series(real))),
                        predicted=tuple(_thin(snap.series(predicted))), snapshot_file=snapshot_file)


def _thin(points: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """At most about ``POINTS`` points, keeping the highest reserved one."""
    if len(points) <= POINTS:
        return points
    step = len(points) / POINTS
    kept = {points[int(i * step)] for i in range(POINTS)}
    kept |= {max(points, key=lambda p: p[1]), points[-1]}
    return sorted(kept)
