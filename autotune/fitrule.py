"""The fit rule: the exact sequence whose peak memory decides whether a micro-batch fits.

Two optimizer steps (the first allocates optimizer state), each of two
micro-steps (with accumulation, gradients stay live while the next
micro-batch's activations build up): build the micro-batch and move it to the
device, forward, loss weighted ``n_i / N`` as the runner weights it, backward
into ``.grad``; then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from .accumulate import item_weight
from .devices.base import Device, Measurement, Session
from .errors import WorkloadError
from .oom import is_oom
from .workload import Workload

OPTIMIZER_STEPS = 2
MICRO_STEPS = 2


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One run of the fit rule at ``batch``: its peak, or the OOM that stopped it."""

    batch: int
    source: str  # "estimate" or "real"
    peak_bytes: int | None  # None when it ran out of memory before finishing
    fits: bool
    seconds: float
    oom: bool = False
    measurement: Measurement | None = None


def fit_rule_work(workload: Workload, batch: int, *, seed: int = 0,
                  data_parallel: bool = False) -> Callable[[Session], None]:
    """The fit rule for ``batch`` as work a device can measure.

    ``data_parallel``: the plan runs under DDP, which holds one gradient-sized
    communication buffer (its buckets) for as long as the model lives; the
    fit rule then holds such a buffer too.
    """

    def work(session: Session) -> None:
        generator = torch.Generator().manual_seed(seed)
        model = session.model(workload.model)
        model.train()
        buckets = ddp_buckets(model, session.torch_device) if data_parallel else None
        opt = session.optimizer(workload.optimizer, model)
        for _ in range(OPTIMIZER_STEPS):
            for _ in range(MICRO_STEPS):
                micro = session.batch(workload.batch, batch, generator)
                n = workload.count_items(micro)
                # N, the items of the whole window, is taken as MICRO_STEPS x n:
                # the weight's value does not change what memory the step holds.
                loss = workload.loss(model, micro) * item_weight(n, n * MICRO_STEPS)
                loss.backward()
                session.tag_gradients(model)
                del micro, loss
            opt.step()
            session.tag_optimizer(opt)
            opt.zero_grad(set_to_none=True)
        del buckets

    return work


def ddp_buckets(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A buffer the size of DDP's gradient buckets: every trainable parameter's bytes."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def run_trial(device: Device, workload: Workload, batch: int, usable: int, *, source: str,
              capacity_guard: bool = True, data_parallel: bool = False) -> Trial:
    """Measure the fit rule at ``batch`` on ``device``; only an OOM means "does not fit".

    Any other exception from the workload's code stops everything as a
    WorkloadError naming the batch size and the workload.
    """
    try:
        _, m = device.measure(fit_rule_work(workload, batch, data_parallel=data_parallel),
                              enforce_capacity=capacity_guard)
    except Exception as exc:
        if is_oom(exc):
            del exc
            device.cleanup()
            return Trial(batch=batch, source=source, peak_bytes=None, fits=False, seconds=0.0, oom=True)
        raise WorkloadError(
            f"workload {workload.name!r} failed at micro-batch {batch} ({source} run): "
            f"{type(exc).__name__}: {exc}",
            batch=batch, workload=workload.name,
        ) from exc
    return Trial(batch=batch, source=source, peak_bytes=m.peak_bytes, fits=m.peak_bytes <= usable,
                 seconds=m.seconds, measurement=m)


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
                    first = workload.model()
                    ref = weakref.ref(first)
                    del first
                    second = workload.model()
                break
            except Exception:
                if where is contextlib.nullcontext:
                    raise
    if ref() is not second:
        return workload
    shared = second

    def private_copy():
        with unset_fake_temporarily():
            return copy.deepcopy(shared)

    return replace(workload, model=private_copy)
