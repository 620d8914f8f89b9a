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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import log, options
from ..devices.base import Device, Session, own_random_state
from ..devices.oom import is_oom
from ..errors import AutotuneError, BadInput, DoesNotFit, WorkloadError, first_line, mention
from ..planning.ramp import uniform_base
from ..results.noise import NoiseScaleEstimate
from ..results.ramp import BatchPhase, RampConfig, batch_per_step
from ..results.run import RunResult, Verification
from ..units import plural
from ..workload import Workload
from ..workload.batches import Split
from . import distributed
from . import fsdp as sharded
from .accumulate import Accumulator
from .bytokens import TokenFeed
from .noise import NoiseScale
from .parts import Batches, Part
from .precision import MixedPrecision
from .ramp import BatchRamp
from .ramp_checks import gradients_check, schedule_check
from .sync import Sync
from .verify import Check, count_check, gradient_check, memory_check, rounds_check, sync_check


def run_plan(plan, workload: Workload, device: Device, *, steps: int = options.STEPS, verify: bool = True,
             precision: str = "fp32", max_norm: float | None = None, seed: int = 0,
             ramp: RampConfig | None = None, uniform: bool = False) -> RunResult:
    """Train ``workload`` for ``steps`` optimizer steps by ``plan`` on ``device``.

    Inside a process group (torchrun), this rank trains its share of every
    effective batch in DistributedDataParallel, or sharded by ``fully_shard``
    for a plan made for FSDP; the checks then also count the gradient
    all-reduce (reduce-scatter) rounds per step and compare parameters across ranks.
    A plan in tokens (``plan.tokens``) runs its steps of samples of the planned lengths
    (:mod:`autotune.training.bytokens`) and checks their tokens too.
    ``ramp``: grow the effective batch toward the plan's target with the measured noise scale
    (:mod:`autotune.training.ramp`); every phase is verified like the plan. ``uniform`` (with ``ramp``): every
    phase in whole micro-batches of the plan's equal ones (:func:`autotune.planning.ramp.uniform_base`).
    In a plan for ranks that differ, each rank runs its own micro-batches and
    micro-steps and is held to its own usable memory and predicted peak.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if ramp is not None and plan.tokens is not None:
        raise BadInput(f"the plan holds {plan.tokens.target_tokens} tokens a step, and a ramp grows an effective "
                       "batch of samples: drop ramp, or plan with a target batch")
    world = distributed.world_size()
    distributed.check_world(plan.world_size, f"the plan is for {plural(plan.world_size, 'rank')}",
                            "or plan for " + mention("world_size", world))
    usable = plan.usable_bytes_of(distributed.rank()) or options.usable_bytes(device.capacity_bytes(), options.MARGIN)
    run = _Run(plan, workload, device, steps=steps, precision=precision, max_norm=max_norm, seed=seed, ramp=ramp,
               uniform=uniform)
    checks: list[Check] = []
    with run.scope, own_random_state(device.torch_device, seed), run.where("while building the model"):
        run.host_model = workload.make_model()
        if verify:
            run.where.now = "while verifying the gradient on the first effective batch"
            sizes, first = run.first_batch(seed)
            checks.append(run.gradient(sizes, first, run.start))
            log.progress(checks[-1].message)
        _, measured = device.measure(run.train)
        if verify and run.record.phases:
            run.where.now = "while verifying the gradient of each phase of the batch ramp"
            checks += _ramp_checks(run, seed)
    predicted = plan.predicted_peak_of(run.rank)
    checks += _run_checks(run, measured.peak_bytes, usable, predicted)
    checks += [run.feed.check()] if run.feed is not None else []
    record = run.record
    timed = slice(1, None) if len(record.seconds) > 1 else slice(None)
    per_step = sum(record.seconds[timed]) / len(record.seconds[timed])
    effective = batch_per_step(record.phases, len(record.seconds)) if record.phases else \
        record.wanted if run.feed is not None else [plan.target_batch] * len(record.seconds)
    verification = _verification(checks, run.ddp) if verify else None
    described = device.describe()
    return RunResult(
        plan=plan, workload=workload.name, device=described, precision=precision,
        losses=tuple(record.losses), step_seconds=tuple(record.seconds),
        samples_per_s=sum(effective[timed]) / sum(record.seconds[timed]),
        items_per_s=(sum(n for _, n in record.consumed) / len(record.consumed)) * world / per_step,
        peak_bytes=measured.peak_bytes, usable_bytes=usable, predicted_peak_bytes=predicted,
        skipped_steps=record.skipped, verification=verification,
        notes=_notes(run, described.kind, world), noise_scale=record.noise,
        allocated_peak_bytes=measured.tracked_peak_bytes, ramp=ramp, batch_schedule=tuple(record.phases),
    )


@dataclass
class _Record:
    """What a run saw on this rank, step by step."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    consumed: list[tuple[int, int]] = field(default_factory=list)  # (samples, items) fed to the loss
    wanted: list[int] = field(default_factory=list)  # this rank's samples per step: the plan's, or its ramp phase's
    expected_items: list[int] = field(default_factory=list)  # the items in the batch each step was given
    rounds: list[int] = field(default_factory=list)  # under DDP or FSDP: gradient collectives per step
    micro_steps: list[int] = field(default_factory=list)  # under DDP or FSDP: this rank's micro-steps per step
    in_sync: list[bool] = field(default_factory=list)  # under DDP or FSDP: every rank holds the same parameters
    skipped: int = 0  # fp16 steps GradScaler skipped
    noise: NoiseScaleEstimate | None = None
    phases: list[BatchPhase] = field(default_factory=list)  # the batch ramp's, when there is one


class _Run:
    """One run of a plan on this rank: how its model is placed and wrapped, and the training loop, whose
    steps go into ``record``. ``scope`` holds what lasts the whole run (FSDP's mesh)."""

    def __init__(self, plan: Any, workload: Workload, device: Device, *, steps: int, precision: str,
                 max_norm: float | None, seed: int, ramp: RampConfig | None, uniform: bool = False):
        self.plan, self.workload, self.device = plan, workload, device
        self.steps, self.precision, self.max_norm = steps, precision, max_norm
        self.ramp: RampConfig | BatchRamp | None = ramp
        if ramp is not None and uniform:  # every phase in whole micro-batches of the plan's
            base, quantum = uniform_base(plan)
            self.ramp = BatchRamp(base, ramp, quantum=quantum)
        self.ddp, self.rank = distributed.active(), distributed.rank()
        self.fsdp = plan.parallel == "fsdp"
        self.offload = self.fsdp and plan.setting is not None and plan.setting.offload  # FSDP's CPU offload
        # FSDP syncing every micro-step: no micro-step runs with gradient sync off
        self.no_sync = contextlib.nullcontext if plan.fsdp_sync == "every" else None
        self.sizes = list(plan.schedule[self.rank])
        self.start = distributed.rank_offsets(plan.per_rank_batch)[self.rank]
        self.scope = contextlib.ExitStack()
        self.mesh = self.scope.enter_context(sharded.mesh(device.torch_device)) if self.fsdp else None
        self.where = _Where(workload, device, plan)
        self.data = torch.Generator().manual_seed(seed)
        self.host_model: Any = None
        self.record = _Record()
        self.feed = TokenFeed(plan.tokens, workload) if plan.tokens is not None else None

    def first_batch(self, seed: int) -> tuple[list[int], Any]:
        """The first effective batch (this rank's micro-batches and the global batch) the gradient is checked on:
        of the plan's target batch, or a plan in tokens' first step."""
        if self.feed is None:
            log.progress(f"verifying gradient equivalence on one effective batch of "
                         f"{plural(self.plan.target_batch, 'sample')} ...")
            return self.sizes, self.workload.make_batch(self.plan.target_batch, torch.Generator().manual_seed(seed))
        step = self.feed.step(0)
        log.progress(f"verifying gradient equivalence on the first step of {plural(step.tokens, 'token')} ...")
        return self.feed.sizes(step), self.feed.batch(step, torch.Generator().manual_seed(seed))

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` as the run trains it: sharded (FSDP), in DistributedDataParallel, or as it is."""
        if self.fsdp:
            return sharded.wrap(model, self.workload, self.mesh, self.precision, self.offload)
        return distributed.wrap(model, self.device.torch_device) if self.ddp else model

    def gradient(self, sizes: list[int], global_batch: Any, start: int) -> Check:
        """The gradient check of the run's accumulation, over a device copy of the initial model wrapped as the
        run wraps it: this rank's share (``sizes`` from ``start``) against all samples."""
        model = copy.deepcopy(self.host_model).to(self.device.torch_device)
        trained: nn.Module | None = None
        try:
            trained = self.wrap(model)
            return gradient_check(
                Accumulator(trained, torch.optim.SGD(trained.parameters(), lr=0.0), sizes, loss=self.workload.loss,
                            items=self.workload.items, max_norm=self.max_norm,
                            parts=[Batches(samples=self.workload.samples, split=self.workload.split),
                                   MixedPrecision(self.precision), Sync(no_sync=self.no_sync),
                                   NoiseScale(measure=False)]),
                self.host_model, self.workload.share(global_batch, start, sum(sizes)), reference_batch=global_batch)
        finally:
            del model  # the copy's memory is free before the cleanup
            trained = None
            self.device.cleanup()

    def train(self, session: Session) -> None:
        """The run itself, in ``session``: ``steps`` optimizer steps, each recorded."""
        if self.fsdp:
            self.scope.enter_context(sharded.measured(session))
            model = trained = sharded.place(session, self.host_model, self.workload, self.mesh, self.precision,
                                            self.offload)
        else:
            model = session.model(lambda: copy.deepcopy(self.host_model))
            trained = self.wrap(model)
        model.train()
        opt = session.optimizer(self.workload.optimizer, model)
        counter: Any = None
        if self.ddp:
            counter = sharded.ReduceScatterCounter(trained) if self.fsdp else distributed.RoundCounter(trained)
        batches = Batches(samples=self.workload.samples, split=_on_host(session, self.workload.split),
                          move=session.move)
        parts: list[Part] = [batches, MixedPrecision(self.precision), Sync(no_sync=self.no_sync)]
        acc = Accumulator(trained, opt, self.plan if self.ramp is not None else self.sizes, loss=self.workload.loss,
                          items=self.workload.items, max_norm=self.max_norm,
                          parts=parts if self.ramp is None else [*parts, self.ramp])
        for step in range(self.steps):
            self.where.now = f"at step {step + 1} of {self.steps} of the run"
            self._step(session, acc, model, counter)
            log.progress(f"step {step + 1}/{self.steps}: loss {self.record.losses[-1]:.4f} "
                         f"({self.record.seconds[-1]:.2f} s)")
        if acc.noise_scale is not None:
            unit = "samples" if self.workload.items is None else "items"
            self.record.noise = acc.noise_scale.estimate(unit=unit)
            acc.noise_scale.close()
        if acc.ramp is not None:
            self.record.phases.extend(acc.ramp.phases)
            acc.ramp.detach()

    def _step(self, session: Session, acc: Accumulator, model: nn.Module, counter: Any) -> None:
        """One optimizer step on this rank's share of a new effective batch (the size its ramp phase wants)."""
        record = self.record
        now = self.plan if acc.ramp is None else acc.ramp.plan_for(acc.ramp.effective_batch)
        with session.tracker.paused():
            if self.feed is not None:  # a plan in tokens: its next step's samples and micro-batches
                batch, sizes = self.feed.next(self.data)
                acc.reschedule(sizes)
                record.wanted.append(sum(sizes))
            else:
                record.wanted.append(now.per_rank_batch[self.rank])
                batch = self.workload.share(self.workload.make_batch(now.target_batch, self.data),
                                            distributed.rank_offsets(now.per_rank_batch)[self.rank],
                                            record.wanted[-1])
            record.expected_items.append(self.workload.count_items(batch))
        begin = time.perf_counter()
        out = acc.step(batch)
        record.seconds.append(time.perf_counter() - begin)
        del batch
        record.losses.append(out.loss)
        record.consumed.append((out.samples, out.items))
        record.skipped += int(out.skipped)
        if counter is not None:
            with session.tracker.paused():
                record.rounds.append(counter.take())
                record.micro_steps.append(out.micro_steps)
                digest = sharded.gathered_digest(model) if self.fsdp else distributed.parameter_digest(model)
                record.in_sync.append(len(set(distributed.gather_ints(digest))) == 1)


def _run_checks(run: _Run, peak: int, usable: int, predicted: int | None) -> list[Check]:
    """What the run measured held: memory within the usable and the prediction, every sample and item counted
    once, and under DDP or FSDP one gradient collective round per step and the ranks' parameters alike."""
    checks = [memory_check(peak, usable, predicted), count_check(run.record.consumed, run.record.wanted,
                                                                 run.record.expected_items)]
    if run.ddp:
        every = run.record.micro_steps if run.no_sync is not None else None  # one round a micro-step
        checks += [rounds_check(run.record.rounds, collective="reduce-scatter" if run.fsdp else "all-reduce",
                                every_micro_step=every),
                   sync_check(run.record.in_sync)]
    return checks


def _verification(checks: list[Check], ddp: bool) -> Verification:
    """The verdict of ``checks``: passed only where every check passed, on every rank."""
    grad = next((c for c in checks if c.name == "gradient_equivalence"), None)
    passed = all(c.passed for c in checks)
    everywhere = distributed.all_true(passed) if ddp else passed
    if everywhere != passed:
        checks.append(Check(name="other_ranks", passed=False, value=None, limit=None,
                            message="a check failed on another rank"))
    return Verification(passed=everywhere, checks=tuple(checks),
                        gradient_relative_error=None if grad is None else grad.value)


def _notes(run: _Run, kind: str, world: int) -> tuple[str, ...]:
    notes = []
    if kind == "cpu":
        notes.append("timed with the memory tracker active (it sees every op); throughput without it is higher")
    if run.ddp:
        notes.append(f"rank {run.rank} of {world}: this rank's figures; checks agreed over all ranks")
    if run.fsdp:
        notes.append(f"FSDP: the model sharded over {plural(world, 'rank')} with fully_shard ({run.precision} "
                     "policy); gradients and parameters compared as gathered from the shards")
    if run.offload:
        notes.append("CPU offload: the shards of the parameters, gradients and optimizer state on the host "
                     "(CPUOffloadPolicy), the optimizer step on the CPU")
    return tuple(notes)


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
        cause = first_line(exc)
        if is_oom(exc, self.device.torch_device.type):
            del exc
            self.device.cleanup()
            raise DoesNotFit(f"micro-batch {self.plan.micro_batch} ran out of memory {self.now} ({cause}): the "
                             f"plan does not fit {self.device.name}; plan again on this device, or give the plan a "
                             "smaller micro-batch") from None
        raise WorkloadError(f"workload {self.workload.name!r} failed {self.now}: {cause}",
                            workload=self.workload.name) from exc


def _on_host(session: Session, split: Split | None) -> Split | None:
    """The workload's ``split`` as host-side work, not counted on the device (as building the batch is not):
    the micro-batches it makes reach the device when they are moved there, one by one."""
    if split is None:
        return None

    def host_split(batch: Any, sizes: list[int]) -> Any:
        with session.tracker.paused():
            return split(batch, sizes)

    return host_split


def _ramp_checks(run: _Run, seed: int) -> list[Check]:
    """The ramp's schedule within the plan, and each phase's gradient check on one batch of its size (this rank's
    share against all samples, as for the plan)."""

    def phase_gradient(phase: BatchPhase) -> Check:
        first = run.workload.make_batch(phase.effective_batch, torch.Generator().manual_seed(seed))
        own = distributed.rank_offsets(tuple(map(sum, phase.schedule)))[run.rank]
        return run.gradient(list(phase.schedule[run.rank]), first, own)

    checks = [schedule_check(run.plan, run.record.phases), gradients_check(run.record.phases, phase_gradient)]
    log.progress(checks[-1].message)
    return checks
