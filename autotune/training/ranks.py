"""Ranks that differ: each rank's share of a mixed plan, its speed, and what the ranks tell each other.

A rank's speed is its time per sample at its max micro-batch:

- a GPU of this job (``cuda:N``, under torchrun or named in a device list) is
  timed: a few forward and backward passes at that micro-batch (one untimed),
  the median over the micro-batch;
- a GPU by name (``estimate:NAME``) gets the roofline estimate of
  :mod:`autotune.devices.roofline`;
- anything else is not timed: a CPU's memory budget emulates a device's memory,
  not its speed, and CPU ranks of one host share its cores; ``estimate`` with a
  budget names no GPU. A plan with any rank of unknown speed balances by memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import log
from ..compat import tree_map
from ..devices import roofline
from ..devices.base import Device, own_random_state
from ..results.device import DeviceInfo
from ..results.probe import ProbeResult
from ..results.ranks import RankShare
from ..units import plural
from ..workload import Workload
from .timing import Samples, Timing, repeat_until_stable

#: How a rank's micro-steps are timed: one untimed, then 3 to 5 timed ones, at most 2 s of them.
TIMING = Timing(warmup=1, min_steps=3, max_steps=5, threshold=0.05, budget_s=2.0)


def rank_key(info: DeviceInfo) -> tuple[Any, ...]:
    """What makes two ranks' devices differ for a plan: their kind, GPU model and usable capacity."""
    return info.kind, info.model, info.capacity_bytes


def measured_seconds_per_sample(workload: Workload, device: Device, batch: int, *, timing: Timing = TIMING,
                                seed: int = 0) -> float:
    """Median seconds of one forward and backward of ``workload`` at micro-batch ``batch`` on ``device``, per
    sample (see the module docstring)."""
    with own_random_state(device.torch_device, seed):
        try:
            return _timed(workload, device.torch_device, batch, timing, seed).median / batch
        finally:
            device.cleanup()  # the model and batch went with _timed's frame


def _timed(workload: Workload, target: torch.device, batch: int, timing: Timing, seed: int) -> Samples:
    sync = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)
    model = workload.make_model().to(target)
    model.train()
    data = tree_map(lambda t: t.to(target) if isinstance(t, torch.Tensor) else t,
                    workload.make_batch(batch, torch.Generator().manual_seed(seed)))

    def step() -> None:
        workload.loss(model, data).backward()
        sync()

    return repeat_until_stable(step, timing)


def speed(workload: Workload, device: Device, batch: int) -> tuple[float | None, str | None]:
    """(seconds per sample at ``batch``, how it is known: "measured" or "roofline"), or (None, None) where
    nothing is known of the device's speed (see the module docstring)."""
    if not device.estimated and device.torch_device.type == "cuda":
        seconds = measured_seconds_per_sample(workload, device, batch)
        log.progress(f"timed micro-steps of {batch} on {device.describe().name}: "
                     f"{seconds * 1e3:.4g} ms per sample")
        return seconds, "measured"
    estimated = roofline.seconds_per_sample(workload, device, batch)
    if estimated is None:
        return None, None
    log.progress(f"roofline estimate at micro-batch {batch} on {device.describe().name}: "
                 f"{estimated * 1e3:.4g} ms per sample")
    return estimated, "roofline"


def share_of(result: ProbeResult, seconds: float | None, timed_by: str | None) -> RankShare:
    """A rank's part of a mixed plan, from its probe (its peak at its micro-batch is filled in by the planner)."""
    return RankShare(device=result.device.name, max_micro_batch=result.max_micro_batch,
                     usable_bytes=result.usable_bytes, budget_bytes=result.device.budget_bytes,
                     seconds_per_sample=seconds, timed_by=timed_by, fingerprint=result.fingerprint)


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` outside a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def ranks_note(devices: Sequence[str], source: str) -> str:
    """How a plan came to know its ranks: measured on each (torchrun), or probed here for a device list."""
    if source == "process group":
        return f"measured on all {plural(len(devices), 'rank')}, each probing its own device"
    shown = ", ".join(devices[:8]) + (", ..." if len(devices) > 8 else "")
    return f"planned for {plural(len(devices), 'rank')} ({shown}), each device probed here"
