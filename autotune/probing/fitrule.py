"""The fit rule: the exact sequence whose peak memory decides whether a micro-batch fits.

Two optimizer steps (the first allocates optimizer state), each of two
micro-steps (with accumulation, gradients stay live while the next
micro-batch's activations build up): build the micro-batch and move it to the
device, forward, loss weighted ``n_i / N`` as the runner weights it, backward
into ``.grad``; then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.

Each micro-step builds its micro-batch with a generator of its own seed, the
same at every size, so a micro-batch of ``b + 1`` starts with the samples of
one of ``b`` wherever the workload's ``batch(n, generator)`` draws its samples
in order. Memory that depends on the data (tokens routed to as many copies as
the model decides) then grows with the batch size, sample by sample; drawn
from one stream, the later micro-batches of ``b + 1`` would begin one sample
later than those of ``b``, every size would draw other samples, and a size
could need less memory than the one below it.
"""

from __future__ import annotations

import contextlib
import copy
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..compat import FakeTensorMode, compiled_function, unset_fake_temporarily
from ..devices.base import Device, Session, own_random_state
from ..devices.oom import is_oom
from ..errors import AutotuneError, WorkloadError, first_line
from ..results.probe import Trial
from ..units import format_bytes
from ..workload import Workload, item_weight
from ..workload.bookkeeping import loss_total, noise_buffer, weighted_loss
from .hostbatch import HostBatches
from .stepreuse import OptimizerSteps, StepsDiffer, run_step

if TYPE_CHECKING:
    from .fsdp import Sharding

OPTIMIZER_STEPS = 2
MICRO_STEPS = 2


OnStep = Callable[[int, int], None]


def fit_rule_work(workload: Workload, batch: int, *, seed: int = 0, data_parallel: bool = False,
                  sharding: Sharding | None = None, on_step: OnStep | None = None,
                  host: HostBatches | None = None, optimizer_steps: OptimizerSteps | None = None
                  ) -> Callable[[Session], None]:
    """The fit rule for ``batch`` as work a device can measure.

    ``data_parallel``: the plan runs under DDP, which holds one gradient-sized
    communication buffer (its buckets) for as long as the model lives; the
    fit rule then holds such a buffer too. ``sharding``: the plan runs under
    FSDP; the model is sharded (see :mod:`autotune.probing.fsdp`) and gradients
    synchronise on the last micro-step only, or on every one (``sharding.sync_every``).
    ``on_step(done, total)`` is called after every micro-step (progress of a long real run). ``host``: the host
    memory the batch's builds took so far (one per probe); each build is bounded by the host's memory (see
    :mod:`autotune.probing.hostbatch`). ``optimizer_steps``: an estimate probe's optimizer steps, each evaluated
    once and made again at other sizes (see :mod:`autotune.probing.stepreuse`).
    """
    total = OPTIMIZER_STEPS * MICRO_STEPS
    step_optimizer = optimizer_steps if optimizer_steps is not None else run_step
    make_batch = (host if host is not None else HostBatches()).builder(workload.make_batch)

    def work(session: Session) -> None:
        if compiled_function(workload.loss):
            session.found_compiled("the loss")
        with own_random_state(session.torch_device, seed):  # the same model, whatever ran before
            if sharding is None:
                steps(session, session.model(workload.make_model))
                return
            with sharding.scope(session) as place:
                steps(session, place(workload))

    def steps(session: Session, model: torch.nn.Module) -> None:
        model.train()
        buckets = ddp_buckets(model, session.torch_device) if data_parallel else None
        opt = session.optimizer(workload.optimizer, model)
        trainable = len({id(p) for p in model.parameters() if p.requires_grad})
        noise = noise_buffer(trainable, session.torch_device) if trainable else None  # the runner measures it
        done = 0
        mark = session.tracker.mark  # the phases, for a memory timeline (nothing unless one is recorded)
        for step in range(OPTIMIZER_STEPS):
            loss_sum = None
            for i in range(MICRO_STEPS):
                if sharding is not None:
                    sharding.sync(model, last=i == MICRO_STEPS - 1)
                loss_sum = _micro_step(session, workload, model, make_batch, batch, seed, done, loss_sum, sharding)
                done += 1
                if on_step is not None:
                    on_step(done, total)
            del loss_sum
            mark(f"optimizer step {step + 1}")
            step_optimizer(session, opt)
            opt.zero_grad(set_to_none=True)
        del buckets, noise

    return work


def _micro_step(session: Session, workload: Workload, model: torch.nn.Module, make_batch: Callable[..., Any],
                batch: int, seed: int, done: int, loss_sum: torch.Tensor | None,
                sharding: Sharding | None) -> torch.Tensor:
    """Micro-step ``done + 1`` of the fit rule: its micro-batch of ``batch`` (built with a generator seeded by
    ``seed + done``: the same samples at every size), forward, the weighted loss, backward into ``.grad``;
    the loss sum that holds every micro-step's loss (made at the first), with this one's added. The micro-batch,
    loss and graph are freed when it returns."""
    mark = session.tracker.mark
    mark(f"micro-step {done + 1} forward")
    generator = torch.Generator().manual_seed(seed + done)  # the same samples at every size
    micro = session.batch(make_batch, batch, generator)
    n = workload.count_items(micro)
    # N, the items of the whole window, is taken as MICRO_STEPS x n:
    # the weight's value does not change what memory the step holds.
    loss = workload.loss(model, micro)
    weighted = weighted_loss(loss, item_weight(n, n * MICRO_STEPS))
    if loss_sum is None:
        loss_sum = loss_total(weighted)
    mark(f"micro-step {done + 1} backward")
    weighted.backward()
    loss_sum.add_(weighted.detach())
    if sharding is None:
        session.tag_gradients(model)
    else:
        sharding.tag_gradients(session, model)
    del micro, loss, weighted
    return loss_sum


def ddp_buckets(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A buffer the size of DDP's gradient buckets: every trainable parameter's bytes."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def run_trial(device: Device, workload: Workload, batch: int, usable: int, *, source: str,
              capacity_guard: bool = True, data_parallel: bool = False, sharding: Sharding | None = None,
              on_step: OnStep | None = None, host: HostBatches | None = None,
              optimizer_steps: OptimizerSteps | None = None) -> Trial:
    """Measure the fit rule at ``batch`` on ``device``; only the device's own OOM means "does not fit".

    ``capacity_guard``: the device raises its out-of-memory error at its
    capacity (a GPU always does; the CPU emulates it), so a trial never takes
    more than the budget. ``host``: see :func:`fit_rule_work`; a batch the host cannot build raises
    :class:`~autotune.probing.hostbatch.HostMemory`. Any other exception from the workload's code stops
    everything as a WorkloadError naming the batch size and the workload. ``optimizer_steps``: see
    :func:`fit_rule_work`; where a step differs from the recorded ones, the fit rule runs again without them.
    """
    start = time.perf_counter()
    try:
        _, m = device.measure(fit_rule_work(workload, batch, data_parallel=data_parallel, sharding=sharding,
                                            on_step=on_step, host=host, optimizer_steps=optimizer_steps),
                              enforce_capacity=capacity_guard)
    except AutotuneError:
        raise
    except StepsDiffer:
        return run_trial(device, workload, batch, usable, source=source, capacity_guard=capacity_guard,
                         data_parallel=data_parallel, sharding=sharding, on_step=on_step, host=host)
    except Exception as exc:  # the workload's own code runs here, and may raise anything: an OOM means "does not
        # fit", any other error stops the probe as a WorkloadError naming it (never a silent "does not fit")
        if is_oom(exc, device.torch_device.type):
            stopped = first_line(exc)
            del exc
            device.cleanup()
            return Trial(batch=batch, source=source, peak_bytes=None, fits=False,
                         seconds=time.perf_counter() - start, oom=True, why=stopped)
        raise WorkloadError(
            f"workload {workload.name!r} failed at micro-batch {batch} ({source} run): {first_line(exc)}",
            batch=batch, workload=workload.name,
        ) from exc
    fits = m.peak_bytes <= usable
    why: str | None = None if fits else f"peak {format_bytes(m.peak_bytes)} is over the usable {format_bytes(usable)}"
    return Trial(batch=batch, source=source, peak_bytes=m.peak_bytes, fits=fits, seconds=m.seconds,
                 why=why, allocated_bytes=m.allocated_peak_bytes, retries=m.alloc_retries, measurement=m)


def isolate(workload: Workload) -> Workload:
    """This workload, made safe to train: its model factory never hands out the user's model.

    A factory that returns the same module on every call (a model the user
    already holds) would be trained by the trials; such a factory is wrapped to
    return a deep copy instead. The check calls the factory twice on the
    ``meta`` device (or under ``FakeTensorMode`` where the factory needs real
    devices), so a fresh-building factory costs no real memory.
    """
    with torch.random.fork_rng(devices=[]):
        for where in (lambda: torch.device("meta"), FakeTensorMode, contextlib.nullcontext):
            try:
                with where():
                    first = workload.make_model()
                    ref = weakref.ref(first)
                    del first
                    second = workload.make_model()
                break
            except WorkloadError:  # the factory needs real devices (or fails): the next place, the real one last
                if where is contextlib.nullcontext:
                    raise
    if ref() is not second:
        return workload
    shared = second

    def private_copy():
        with unset_fake_temporarily():
            return copy.deepcopy(shared)

    return replace(workload, model=private_copy)
