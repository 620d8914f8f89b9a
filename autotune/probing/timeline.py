"""The fit rule at one micro-batch, allocation by allocation: a snapshot in torch's format and where the peak is.

:func:`record` runs the fit rule once with a
:class:`~autotune.devices.recorder.Recorder` (on the estimate that stands in
for the device, or on the CPU itself); :func:`analyse` replays the recording
through the caching-allocator simulation as the estimate does (so its
reserved peak is the result's, to the byte), writes it down as a
``torch.cuda.memory._snapshot()`` (:mod:`autotune.devices.snapshot`), and
attributes what is live at the peak: parameters, gradients, optimizer state,
activations by the module family that made them (``blocks.*.attn``), the
cuBLAS workspaces and kernel scratch, the allocator's rounding and cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..devices.base import Device
from ..devices.recorder import Made, Recorder, Recording, record_with
from ..devices.snapshot import OutOfMemoryAt, Simulation, build
from ..results.probe import Trial
from ..results.request import FitRule
from ..results.timeline import OutOfMemory, PeakPart
from ..workload import Workload
from .fitrule import run_trial
from .fsdp import Sharding

SAMPLES = 600  # points of the stacked timeline
OUTSIDE = "(outside any module: the batch, the loss)"
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


@dataclass
class Recorded:
    """A recorded run of the fit rule and how to replay it as the device's allocator would."""

    measured: Trial
    recording: Recording
    simulation: Simulation | None
    device: Any  # the device it ran on (an estimate, or the CPU)


def runner_for(device: Device, sharding: Any = None) -> Any:
    """Where a recorded run goes: the CPU itself (its tracker is exact), else the estimate standing in for the
    device (FSDP's too, on the same engine as the probe)."""
    if not device.estimated and device.torch_device.type == "cpu":
        return device
    return device.estimator()


def simulation_of(runner: Any) -> Simulation | None:
    """The allocator the estimate replays its trace through (None: the CPU, or no caching allocator)."""
    if not getattr(runner, "simulates", False):
        return None
    return Simulation(conf=runner.allocator, capacity=runner.capacity_bytes(), device_total=runner.device_total)


def record(workload: Workload, device: Device, batch: int, *, frames: bool = True, rule: FitRule | None = None,
           runner: Any = None) -> Recorded:
    """The fit rule at ``batch`` (``rule``: DDP's buckets or this rank's FSDP sharding), recorded (``frames``:
    with each allocation's Python frames)."""
    rule = rule or FitRule()
    sharding = Sharding.of(rule)
    runner = runner if runner is not None else runner_for(device, sharding)
    measured, recording = record_with(Recorder(frames=frames), lambda: run_trial(
        runner, workload, batch, 1 << 62, source="estimate" if runner.estimated else "real", capacity_guard=False,
        data_parallel=rule.buckets, sharding=sharding))
    return Recorded(measured, recording, simulation_of(runner), runner)


def family(path: str) -> str:
    """A module path with its list indices as ``*``: every layer of a stack is one family (``blocks.*.attn``);
    the layers of a model that is itself a list (``nn.Sequential``) are ``layers *``."""
    found = _INDEX.sub("*", path)
    return f"layers {found}" if found.startswith("*") else found


@dataclass
class Walk:
    """What :func:`analyse` found: the snapshot, the peak, what is live there, the timeline."""

    snapshot: dict[str, Any]
    reserved_peak: int
    allocated_peak: int
    peak_event: int
    peak_phase: str
    events: int
    live_at_peak: dict[int, int]  # key -> block size
    requested: dict[int, int]  # key -> requested bytes (of every allocation)
    parts: list[PeakPart]
    series: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    out_of_memory: OutOfMemory | None = None  # where the GPU's capacity runs out (the replay then has no limit)
    live_at_oom: dict[int, int] = field(default_factory=dict)  # key -> block size there, the request's included


def kind_of(recording: Recording, made: Made | None) -> str:
    """parameters, gradients, optimizer_state, activations, or workspace (memory no tensor holds)."""
    if made is None:
        return "activations"
    if made.label is not None:
        return "workspace"
    return recording.categories.get(made.serial, "activations")


def analyse(recorded: Recorded) -> Walk:
    """Replay the recording as the device's allocator would, and walk it: peak, parts, timeline."""
    rec = recorded.recording
    kinds: dict[int, str] = {}
    blocks: dict[int, int] = {}
    requested: dict[int, int] = {}
    sums = dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations", "workspace"), 0)
    state: dict[str, Any] = {"best": -1, "held": -1, "index": 0, "live": {}, "allocated": 0}
    points: list[tuple[int, int, int, int, int, int, int]] = []
    n = len(rec.trace)
    every = max(1, n // SAMPLES)

    def step(i: int, key: int, block: int, reserved: int, allocated: int) -> None:
        if block >= 0:
            kind = kinds[key] = kind_of(rec, rec.made.get(key))
            blocks[key] = block
            requested[key] = rec.trace[i][1]
            sums[kind] += block
        elif key in blocks:
            sums[kinds[key]] -= blocks.pop(key)
        state["allocated"] = max(state["allocated"], allocated)
        # the moment that limits the micro-batch: the most allocated while the reserved peak is held (reached
        # at a small segment's cudaMalloc, the reserved peak may hold little but cache then)
        peak = reserved > state["best"] or (reserved == state["best"] and allocated > state["held"])
        if peak:
            state["best"], state["held"], state["index"], state["live"] = reserved, allocated, i, dict(blocks)
        if peak or i % every == 0 or i == n - 1:
            tensors = sum(sums.values())
            points.append((i, sums["parameters"], sums["gradients"], sums["optimizer_state"], sums["activations"],
                           sums["workspace"], reserved - tensors))

    failed: list[OutOfMemoryAt] = []
    snapshot = build(rec, recorded.simulation, on_step=step, on_oom=failed.append)
    index, live = state["index"], state["live"]
    parts = _parts(rec, live, requested, state["best"])
    walk = Walk(snapshot=snapshot, reserved_peak=max(state["best"], 0), allocated_peak=state["allocated"],
                peak_event=index, peak_phase=phase_at(rec, index), events=n, live_at_peak=live, requested=requested,
                parts=parts, series=_thin(points))
    if failed:
        at = failed[0]
        key = rec.trace[at.index][0]
        kind, name = holder(rec, rec.made.get(key))
        walk.out_of_memory = OutOfMemory(
            event=at.index, phase=phase_at(rec, at.index), request=PeakPart(kind=kind, name=name, bytes=at.requested),
            allocated_bytes=sum(at.live.values()), reserved_bytes=at.reserved, segment_bytes=at.segment,
            capacity_bytes=at.capacity,
            parts=tuple(_parts(rec, at.live, requested, at.reserved)))
        walk.live_at_oom = {**at.live, key: at.requested}
    return walk


def phase_at(rec: Recording, index: int) -> str:
    """The fit rule's phase at trace event ``index``."""
    return next((name for start, name in reversed(rec.phases) if start <= index), "setup")


def holder(rec: Recording, made: Made | None) -> tuple[str, str]:
    """An allocation's kind and holder: a module family for activations, the workspace's name, or ``""``."""
    kind = kind_of(rec, made)
    if kind == "workspace":
        return kind, made.label if made is not None and made.label else "workspace"
    if kind == "activations":
        path = rec.module_of(made) if made is not None else ""
        return kind, family(path) if path else OUTSIDE
    return kind, ""


def _parts(rec: Recording, live: dict[int, int], requested: dict[int, int], reserved: int) -> list[PeakPart]:
    """What is live (at the peak), by kind and holder; with the allocator's rounding and cache they sum to
    ``reserved`` (the reserved peak)."""
    totals: dict[tuple[str, str], int] = {}
    rounding = 0
    for key, block in live.items():
        kind, name = holder(rec, rec.made.get(key))
        need = requested.get(key, block)
        totals[kind, name] = totals.get((kind, name), 0) + need
        rounding += block - need
    parts = [PeakPart(kind=k, name=n, bytes=b) for (k, n), b in totals.items()]
    if rounding:
        parts.append(PeakPart(kind="rounding", name="blocks larger than requested", bytes=rounding))
    cache = reserved - sum(live.values())
    if cache:
        parts.append(PeakPart(kind="cache", name="cached free blocks", bytes=cache))
    return sorted(parts, key=lambda p: -p.bytes)


def _thin(points: list[tuple[int, int, int, int, int, int, int]]) -> list[tuple[int, int, int, int, int, int, int]]:
    """At most about ``SAMPLES`` points, the peak's kept."""
    if len(points) <= 2 * SAMPLES:
        return points
    top = max(points, key=lambda p: sum(p[1:]))
    step = len(points) / SAMPLES
    kept = {points[int(i * step)] for i in range(SAMPLES)} | {top, points[-1]}
    return sorted(kept)


def activations_by_family(rec: Recording, live: dict[int, int], requested: dict[int, int]) -> dict[str, int]:
    """Activation bytes live at the peak under every repeated module family and its ancestors' families
    (``blocks.*`` holds ``blocks.*.attn``'s too)."""
    out: dict[str, int] = {}
    for key in live:
        made = rec.made.get(key)
        if made is None or kind_of(rec, made) != "activations":
            continue
        path = rec.module_of(made)
        if not path:
            continue
        parts = path.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = family(".".join(parts[:depth]))
            out[prefix] = out.get(prefix, 0) + requested.get(key, live[key])
    return out


OnRecord = Callable[[Recorded], None]
