"""The optimizer step of an estimate, evaluated once per probe and made again at every other size.

What the fit rule's optimizer step allocates does not depend on the micro-batch:
Adam's moments, the step's temporaries and what it frees follow from the
optimizer, its hyperparameters, and the parameters and gradients it steps
(shapes, strides, dtypes, placements). An estimate probe therefore runs each
optimizer step for real once, records the allocations and frees it made (and
the categories and block tags they got), and at every later size where the
optimizer and its parameters and gradients are the same — the *signature*,
compared whole — makes the same events again in the tracker instead of running
the step (:meth:`autotune.devices.tracker.LiveStorageTracker.replay`): the
trace, the live bytes, the peak and its breakdown are those of a run of the
step, to the byte. The state the step would have made lives as counted bytes
that die with the optimizer, as the real state does.

A step is recorded only where replaying it is exact by construction: it frees
nothing it did not allocate, every allocation it keeps is optimizer state, and
each allocation is one event (no empty or resized storage). Elsewhere (and on
the host under FSDP's CPU offload, or while a memory timeline is recorded) the
step runs as always. A later step that differs from every recorded one after an
earlier step of the same optimizer was made again (gradients that changed with
the batch) raises :class:`StepsDiffer`, and the evaluation is run again without
reuse. What the signature does not see: an optimizer whose allocations depend
on something other than its parameters, gradients, hyperparameters and step
count (a Python attribute it keeps and changes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..devices.base import Session
from ..devices.tracker import Replayed, plain_tensors
from .fsdpoffload import offloading, optimizer_on_host


class StepsDiffer(Exception):
    """A step differs from every recorded one after an earlier step of its optimizer was made again."""


@dataclass(frozen=True)
class _Step:
    events: tuple[Replayed, ...]


def run_step(session: Session, opt: torch.optim.Optimizer) -> None:
    """One optimizer step of the fit rule as it runs: its step counters read without shaping anything, on the
    host under FSDP's CPU offload, its state tagged."""
    with session.tracker.values_do_not_shape(), optimizer_on_host(opt):  # step counters, learning rates
        opt.step()  # (under FSDP's CPU offload on a device told apart from the host, the host's step)
    session.tag_optimizer(opt)


class OptimizerSteps:
    """The optimizer steps of one estimate probe: each recorded once per signature and made again wherever it
    comes back (see the module). ``recorded``, ``replayed`` and ``differed`` (evaluations run again in full)
    count them."""

    def __init__(self) -> None:
        self._steps: dict[Any, _Step | None] = {}
        self._before: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, bool]] = \
            weakref.WeakKeyDictionary()  # each optimizer's last step: its key, and whether it was made again
        self.recorded = self.replayed = self.differed = 0

    def __call__(self, session: Session, opt: torch.optim.Optimizer) -> None:
        tracker = session.tracker
        recorder = tracker.recorder
        if not session.on_meta or tracker.trace is None or offloading() or \
                not (recorder is None or hasattr(recorder, "replayed_alloc")):
            run_step(session, opt)
            return
        dying = tracker.dying_keys()  # what died before the step: freed at its first allocation, or at its end
        before, made_again = self._before.get(opt, (None, False))
        key = (before, _signature(opt, recorder), len(opt.state) if before is None else None,
               None if recorder is None else tuple(recorder.tag_of_key(k) for k in sorted(dying)))
        step = self._steps.get(key)
        if step is not None:
            tracker.replay(step.events, opt)
            tracker.current_bytes  # noqa: B018  (the step's end: what died is freed, as tagging its state does)
            self.replayed += 1
            self._before[opt] = (key, True)
            return
        if made_again:
            self.differed += 1
            raise StepsDiffer("an optimizer step differs from the recorded ones after an earlier one was made again")
        before_step = tracker.position()
        run_step(session, opt)
        if key not in self._steps:
            self._steps[key] = _recorded(tracker, before_step, recorder, dying)
            self.recorded += self._steps[key] is not None
        self._before[opt] = (key, False)


def _recorded(tracker: Any, before: tuple[int, int, int], recorder: Any, dying: set[int]) -> _Step | None:
    """The events of the step the tracker counted since its ``position()`` was ``before``, ready to make again;
    None where making them again would not be exact.
    Frees of what was ``dying`` when the step began, before its first allocation, are left out: making the step
    again frees them at the same place (before its first allocation, or at its end)."""
    start, serial, timeline = before
    if recorder is not None and len(recorder.tags) != len(tracker.trace):
        return None  # (the recorder was not told every event)
    index: dict[int, int] = {}
    events: list[Replayed] = []
    foreign = 0
    for i, (key, nbytes, stream) in enumerate(tracker.trace[start:], start):
        if nbytes < 0:
            if key in dying and not events:
                foreign += 1
                continue
            if key not in index:
                return None  # it frees what it did not allocate
            device = key in tracker.device_keys
            events.append(Replayed(-1, device=device, freed=index.pop(key)))
            continue
        device = key in tracker.device_keys
        tags = (recorder.tags[i], recorder.tags_next[i]) if recorder is not None else None
        index[key] = len(events)
        events.append(Replayed(nbytes, stream, device, tracker.category_of(key), tags))
    allocations = sum(e.nbytes >= 0 for e in events)
    tensor_events = sum(not e.device for e in events)
    _, serial_now, timeline_now = tracker.position()
    if serial_now - serial != allocations or timeline_now - timeline != tensor_events + foreign:
        return None  # an empty or resized storage, or an allocation not in the trace
    if not _its_state([events[i] for i in index.values()]):
        return None  # it keeps what is not its state: made again, that would die with the optimizer
    return _Step(tuple(events))


def _its_state(kept: list[Replayed]) -> bool:
    """Is every allocation the step keeps a tensor of the optimizer's state (which dies with the optimizer)?"""
    return all(not e.device and e.category == "optimizer_state" for e in kept)


def _signature(opt: torch.optim.Optimizer, recorder: Any) -> tuple:
    """Everything a step's allocations follow from: the optimizer's class and hyperparameters, each parameter and
    its gradient (and, while blocks are tagged, their blocks and the tags of the event before)."""
    groups = []
    for group in opt.param_groups:
        hyper = tuple(sorted((k, _value(v)) for k, v in group.items() if k != "params"))
        params = tuple((_tensor(p), _tensor(p.grad), _tags(recorder, p)) for p in group["params"])
        groups.append((hyper, params))
    return type(opt), tuple(groups), None if recorder is None else recorder.state()


def _tags(recorder: Any, p: torch.Tensor) -> tuple[int, int] | None:
    if recorder is None:
        return None
    return recorder.tag_of(p), (recorder.tag_of(p.grad) if p.grad is not None else -1)


def _tensor(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    parts = tuple((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device.type,
                   x.untyped_storage().nbytes()) for x in plain_tensors(t))
    return type(t), tuple(t.shape), t.dtype, t.requires_grad, repr(getattr(t, "placements", None)), parts


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return "tensor", tuple(v.shape), v.dtype, v.device.type
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    return repr(v)
