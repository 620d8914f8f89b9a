"""The runner: train a workload by a plan, measure it, and verify it.

Verification before training: one effective batch's accumulated gradient
against a one-pass reference over the same samples (under DDP: the
synchronised gradient against the single-process gradient over the union of
the ranks' samples; under FSDP: the gradient gathered from the shards). During training: peak
memory over the whole run (the device's own measure) and, for every step, the
samples and items fed to the loss. The run fails (exit code 1 in the CLI) when
any check does not hold.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch

from .. import log, options
from ..compat import tree_map
from ..devices.base import Device, Session, own_random_state
from ..devices.oom import is_oom
from ..errors import AutotuneError, DoesNotFit, WorkloadError
from ..results.noise import NoiseScaleEstimate
from ..results.ramp import BatchPhase, RampConfig, batch_per_step
from ..results.run import RunResult, Verification
from ..units import plural
from ..workload import Workload
from . import distributed
from . import fsdp as sharded
from .accumulate import Accumulator
from .ramp_checks import gradients_check, schedule_check
from .verify import Check, count_check, gradient_check, memory_check, rounds_check, sync_check


def run_plan(plan, workload: Workload, device: Device, *, steps: int = 20, verify: bool = True,
             precision: str = "fp32", max_norm: float | None = None, seed: int = 0,
             ramp: RampConfig | None = None) -> RunResult:
    """Train ``workload`` for ``steps`` optimizer steps by ``plan`` on ``device``.

    Inside a process group (torchrun), this rank trains its share of every
    effective batch in DistributedDataParallel, or sharded by ``fully_shard``
    for a plan made for FSDP; the checks then also count the gradient
    all-reduce (reduce-scatter) rounds per step and compare parameters across ranks.
    ``ramp``: grow the effective batch toward the plan's target with the measured noise scale
    (:mod:`autotune.training.ramp`); every phase is verified like the plan.
    In a plan for ranks that differ, each rank runs its own micro-batches and
    micro-steps and is held to its own usable memory and predicted peak.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    ddp = distributed.active()
    rank, world = distributed.rank(), distributed.world_size()
    distributed.check_world(plan.world_size, f"the plan is for {plural(plan.world_size, 'rank')}",
                            f"or plan for world_size={world}")
    sizes = list(plan.schedule[rank])
    start = distributed.rank_offsets(plan.per_rank_batch)[rank]
    usable = plan.usable_bytes_of(rank) or options.usable_bytes(device.capacity_bytes(), options.MARGIN)
    fsdp = plan.parallel == "fsdp"
    scope = contextlib.ExitStack()
    mesh = scope.enter_context(sharded.mesh(device.torch_device)) if fsdp else None
    wrap = (lambda m: sharded.wrap(m, workload, mesh, precision)) if fsdp else \
        (lambda m: distributed.wrap(m, device.torch_device)) if ddp else None
    checks: list[Check] = []
    where = _Where(workload, device, plan)
    with scope, own_random_state(device.torch_device, seed), where("while building the model"):
        host_model = workload.make_model()
        data = torch.Generator().manual_seed(seed)
        if verify:
            where.now = "while verifying the gradient on the first effective batch"
            log.progress(f"verifying gradient equivalence on one effective batch of "
                         f"{plural(plan.target_batch, 'sample')} ...")
            first = workload.make_batch(plan.target_batch, torch.Generator().manual_seed(seed))
            checks.append(_gradient(host_model, sizes, first, start, workload, device, max_norm, precision,
                                    wrap))
            log.progress(checks[-1].message)

        consumed: list[tuple[int, int]] = []
        expected_items: list[int] = []
        losses: list[float] = []
        seconds: list[float] = []
        rounds: list[int] = []
        in_sync: list[bool] = []
        skipped = [0]
        noise: list[NoiseScaleEstimate] = []
        phases: list[BatchPhase] = []
        wanted: list[int] = []  # this rank's samples per step: the plan's, or its ramp phase's

        def work(session: Session) -> None:
            if fsdp:
                scope.enter_context(sharded.measured(session))
                model = trained = sharded.place(session, host_model, workload, mesh, precision)
            else:
                model = session.model(lambda: copy.deepcopy(host_model))
                trained = wrap(model) if wrap else model
            model.train()
            opt = session.optimizer(workload.optimizer, model)
            counter: Any = None
            if ddp:
                counter = sharded.ReduceScatterCounter(trained) if fsdp else distributed.RoundCounter(trained)
            acc = Accumulator(trained, opt, plan if ramp is not None else sizes, loss=workload.loss,
                              items=workload.items, move=session.move, max_norm=max_norm, precision=precision,
                              ramp=ramp)
            for step in range(steps):
                where.now = f"at step {step + 1} of {steps} of the run"
                now = plan if acc.ramp is None else acc.ramp.plan_for(acc.ramp.effective_batch)
                with session.tracker.paused():
                    wanted.append(now.per_rank_batch[rank])
                    batch = share(workload.make_batch(now.target_batch, data),
                                  distributed.rank_offsets(now.per_rank_batch)[rank], wanted[-1])
                    expected_items.append(workload.count_items(batch))
                begin = time.perf_counter()
                out = acc.step(batch)
                seconds.append(time.perf_counter() - begin)
                del batch
                losses.append(out.loss)
                consumed.append((out.samples, out.items))
                skipped[0] += int(out.skipped)
                if counter is not None:
                    with session.tracker.paused():
                        rounds.append(counter.take())
                        digest = sharded.gathered_digest(model) if fsdp else distributed.parameter_digest(model)
                        in_sync.append(len(set(distributed.gather_ints(digest))) == 1)
                log.progress(f"step {step + 1}/{steps}: loss {out.loss:.4f} ({seconds[-1]:.2f} s)")
            if acc.noise_scale is not None:
                noise.append(acc.noise_scale.estimate(unit="samples" if workload.items is None else "items"))
                acc.noise_scale.close()
            if acc.ramp is not None:
                phases.extend(acc.ramp.phases)
                acc.ramp.detach()

        _, measured = device.measure(work)
        if verify and phases:
            where.now = "while verifying the gradient of each phase of the batch ramp"
            checks += _ramp_checks(plan, phases, host_model, workload, device, max_norm, precision, wrap, seed)

    predicted = plan.predicted_peak_of(rank)
    checks.append(memory_check(measured.peak_bytes, usable, predicted))
    checks.append(count_check(consumed, wanted, expected_items))
    if ddp:
        checks += [rounds_check(rounds, collective="reduce-scatter" if fsdp else "all-reduce"), sync_check(in_sync)]
    timed = slice(1, None) if len(seconds) > 1 else slice(None)
    per_step = sum(seconds[timed]) / len(seconds[timed])
    effective = batch_per_step(phases, len(seconds)) if phases else [plan.target_batch] * len(seconds)
    verification = None
    if verify:
        grad = next((c for c in checks if c.name == "gradient_equivalence"), None)
        passed = all(c.passed for c in checks)
        everywhere = distributed.all_true(passed) if ddp else passed
        if everywhere != passed:
            checks.append(Check(name="other_ranks", passed=False, value=None, limit=None,
                                message="a check failed on another rank"))
        verification = Verification(passed=everywhere, checks=tuple(checks),
                                    gradient_relative_error=None if grad is None else grad.value)
    described = device.describe()
    notes = []
    if described.kind == "cpu":
        notes.append("timed with the memory tracker active (it sees every op); throughput without it is higher")
    if ddp:
        notes.append(f"rank {rank} of {world}: this rank's figures; checks agreed over all ranks")
    if fsdp:
        notes.append(f"FSDP: the model sharded over {plural(world, 'rank')} with fully_shard ({precision} policy); "
                     "gradients and parameters compared as gathered from the shards")
    return RunResult(
        plan=plan, workload=workload.name, device=described, precision=precision,
        losses=tuple(losses), step_seconds=tuple(seconds),
        samples_per_s=sum(effective[timed]) / sum(seconds[timed]),
        items_per_s=(sum(n for _, n in consumed) / len(consumed)) * world / per_step,
        peak_bytes=measured.peak_bytes, usable_bytes=usable, predicted_peak_bytes=predicted,
        skipped_steps=skipped[0], verification=verification, notes=tuple(notes),
        noise_scale=noise[0] if noise else None,
        allocated_peak_bytes=measured.tracked_peak_bytes, ramp=ramp, batch_schedule=tuple(phases),
    )


class _Where:
    """Names the phase of a run in the error it ends with: the workload's own error (exit 1), or the
    device running out of memory (the plan does not fit this device)."""

    def __init__(self, workload: Workload, device: Device, plan: Any):
        self.workload, self.device, self.plan = workload, device, plan
        self.now = ""

    def __call__(self, now: str) -> _Where:
        self.now = now
        return self

    def __enter__(self) -> _Where:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, AutotuneError) or not isinstance(exc, Exception):
            return None
        text = str(exc).strip().splitlines()
        cause = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
        if is_oom(exc, self.device.torch_device.type):
            del exc
            self.device.cleanup()
            raise DoesNotFit(f"micro-batch {self.plan.micro_batch} ran out of memory {self.now} ({cause}): the "
                             f"plan does not fit {self.device.name}; plan again on this device, or give the plan a "
                             "smaller micro-batch") from None
        raise WorkloadError(f"workload {self.workload.name!r} failed {self.now}: {cause}",
                            workload=self.workload.name) from exc


def share(batch: Any, start: int, size: int) -> Any:
    """This rank's samples of a global effective batch."""
    return tree_map(lambda t: t[start:start + size] if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def _ramp_checks(plan, phases: list[BatchPhase], host_model, workload: Workload, device: Device, max_norm,
                 precision, wrap, seed: int) -> list[Check]:
    """The ramp's schedule within the plan, and each phase's gradient check on one batch of its size (this rank's
    share against all samples, as for the plan)."""
    rank = distributed.rank()

    def phase_gradient(phase: BatchPhase) -> Check:
        first = workload.make_batch(phase.effective_batch, torch.Generator().manual_seed(seed))
        own = distributed.rank_offsets(tuple(map(sum, phase.schedule)))[rank]
        return _gradient(host_model, list(phase.schedule[rank]), first, own, workload, device, max_norm, precision,
                         wrap)

    checks = [schedule_check(plan, phases), gradients_check(phases, phase_gradient)]
    log.progress(checks[-1].message)
    return checks


def _gradient(host_model, sizes, global_batch: Any, start: int, workload: Workload, device: Device, max_norm,
              precision, wrap) -> Check:
    """The gradient check of the run's accumulation, over a device copy of the initial model wrapped as the
    run wraps it: this rank's share against all samples."""
    model = copy.deepcopy(host_model).to(device.torch_device)
    try:
        trained = wrap(model) if wrap is not None else model
        return gradient_check(
            Accumulator(trained, torch.optim.SGD(trained.parameters(), lr=0.0), sizes, loss=workload.loss,
                        items=workload.items, max_norm=max_norm, precision=precision, noise_scale=False),
            host_model, share(global_batch, start, sum(sizes)), reference_batch=global_batch)
    finally:
        model = trained = None  # the copy's memory is free before the cleanup
        device.cleanup()
