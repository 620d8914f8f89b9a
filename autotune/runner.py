"""The runner: train a workload by a plan, measure it, and verify it.

Verification before training: one effective batch's accumulated gradient
against a one-pass reference over the same samples. During training: peak
memory over the whole run (the device's own measure) and, for every step, the
samples and items fed to the loss. The run fails (exit code 1 in the CLI) when
any check does not hold.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from .accumulate import Accumulator
from .devices.base import Device, Session
from .probe import usable_bytes
from .runresult import RunResult
from .verify import Check, count_check, gradient_check, memory_check
from .workload import Workload

Progress = Callable[[str], None]


def run_plan(plan, workload: Workload, device: Device, *, steps: int = 20, verify: bool = True,
             precision: str = "fp32", max_norm: float | None = None, seed: int = 0, rank: int = 0,
             progress: Progress | None = None, accumulator_cls=Accumulator) -> RunResult:
    """Train ``workload`` for ``steps`` optimizer steps by ``plan`` on ``device``."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    sizes = list(plan.schedule[rank])
    per_rank = sum(sizes)
    usable = plan.probe.usable_bytes if plan.probe is not None else usable_bytes(device.capacity_bytes(), 0.1)
    checks: list[Check] = []
    torch.manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        host_model = workload.model()
        data = torch.Generator().manual_seed(seed)
        if verify:
            if progress:
                progress(f"verifying gradient equivalence on one effective batch of {per_rank} samples ...")
            first = workload.batch(per_rank, torch.Generator().manual_seed(seed))
            checks.append(_gradient(host_model, sizes, first, workload, device, max_norm, precision, accumulator_cls))
            if progress:
                progress(checks[-1].message)

        consumed: list[tuple[int, int]] = []
        expected_items: list[int] = []
        losses: list[float] = []
        seconds: list[float] = []
        skipped = [0]

        def work(session: Session) -> None:
            model = session.model(lambda: copy.deepcopy(host_model))
            model.train()
            opt = session.optimizer(workload.optimizer, model)
            acc = accumulator_cls(model, opt, sizes, loss=workload.loss, items=workload.items, move=session.move,
                                  max_norm=max_norm, precision=precision)
            for step in range(steps):
                with session.tracker.paused():
                    batch = workload.batch(per_rank, data)
                    expected_items.append(workload.count_items(batch))
                start = time.perf_counter()
                out = acc.step(batch)
                seconds.append(time.perf_counter() - start)
                del batch
                losses.append(out.loss)
                consumed.append((out.samples, out.items))
                skipped[0] += int(out.skipped)
                if progress:
                    progress(f"step {step + 1}/{steps}: loss {out.loss:.4f} ({seconds[-1]:.2f} s)")

        _, measured = device.measure(work)

    predicted = plan.predicted_peak_bytes
    checks.append(memory_check(measured.peak_bytes, usable, predicted))
    checks.append(count_check(consumed, per_rank, expected_items))
    timed = seconds[1:] if len(seconds) > 1 else seconds
    per_step = sum(timed) / len(timed)
    world = plan.world_size
    verification = None
    if verify:
        grad = next((c for c in checks if c.name == "gradient_equivalence"), None)
        verification = {"passed": all(c.passed for c in checks),
                        "gradient_relative_error": grad.value if grad else None,
                        "checks": [c.to_dict() for c in checks]}
    notes = []
    if measured.tracked_peak_bytes and device.describe().get("kind") == "cpu":
        notes.append("timed with the memory tracker active (it sees every op); throughput without it is higher")
    return RunResult(
        plan=plan, workload=workload.name, device=device.describe(), precision=precision,
        losses=tuple(losses), step_seconds=tuple(seconds),
        samples_per_s=per_rank * world / per_step,
        items_per_s=(sum(n for _, n in consumed) / len(consumed)) * world / per_step,
        peak_bytes=measured.peak_bytes, usable_bytes=usable, predicted_peak_bytes=predicted,
        skipped_steps=skipped[0], verification=verification, notes=tuple(notes),
    )


def _gradient(host_model, sizes, batch: Any, workload: Workload, device: Device, max_norm, precision,
              accumulator_cls) -> Check:
    """The gradient check on a device copy of the initial model."""
    model = copy.deepcopy(host_model).to(device.torch_device)
    try:
        return gradient_check(model, sizes, batch, loss=workload.loss, items=workload.items, max_norm=max_norm,
                              precision=precision, accumulator_cls=accumulator_cls)
    finally:
        del model
        device.cleanup()
