"""FSDP's gradient sync chosen by the probe: a reduce-scatter after every micro-step, or at the last one only.

Syncing at the last micro-step only (FSDP2's ``set_requires_gradient_sync(False)``
before it) keeps each unit's *unsharded* gradients from the first micro-step
until the last one reduce-scatters them: the whole model's gradients on every
rank, between micro-steps. Syncing after every micro-step reduce-scatters each
micro-step's gradients at once and accumulates them in their shards, so no
unsharded gradient outlives its unit's backward; it costs one reduce-scatter a
micro-step instead of one a step, and on few ranks (where a shard is most of a
gradient) the sharded sum beside each micro-step's reduce-scatter can hold more
than deferring does. "auto" probes both and takes the larger max micro-batch,
"last" on a tie (fewer collectives); the result says what the other gave. On an
estimate, "auto" probes "every" first and evaluates "last" once, at that max
micro-batch: where "last" does not fit it there, "every" is taken and the result
says what "last" needs there (a probe of "last" follows only where it fits). On a
real device, where each probe costs a real run, "auto" probes "last" and
probes "every" only when "last" does not fit a micro-batch of 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .. import log
from ..errors import DoesNotFit, first_line
from ..results.probe import FSDP_CHOICE, ProbeResult, Trial
from ..results.request import ProbeRequest
from ..units import format_bytes

Probe = Callable[[ProbeRequest], ProbeResult]
OneSize = Callable[[ProbeRequest, int], Trial]


def probe_chosen(probe: Probe, request: ProbeRequest, *, estimated: bool,
                 one_size: OneSize | None = None) -> ProbeResult:
    """``probe`` of ``request`` with its ``fsdp_sync`` measured when it is "every" or "last", chosen when it is
    "auto" (see the module; ``estimated``: the device is an estimate, whose probes run nothing real;
    ``one_size(request, b)``: its fit rule evaluated at micro-batch ``b`` alone). Where neither fits a micro-batch
    of 1, raises the DoesNotFit of the one that needs less, with what the other needs."""
    if not request.rule.sharded or request.rule.fsdp_sync != "auto":
        return probe(request)
    found: dict[str, ProbeResult | DoesNotFit] = {}
    if estimated and one_size is not None:
        found["every"] = _probed(probe, request, "every")
        chosen = _every_unless_last_fits(found["every"], one_size, request)
        if chosen is not None:
            return chosen
    for sync in ("last", "every"):
        if sync not in found:
            found[sync] = _probed(probe, request, sync)
        done = found[sync]
        if not estimated and isinstance(done, ProbeResult) and sync == "last":
            return _noted(done, f"{FSDP_CHOICE}at the last micro-step only (chosen: it fits, and on a real "
                                "device each sync costs real runs to compare; fsdp_sync every may fit more)")
    last, every = found["last"], found["every"]
    if isinstance(last, DoesNotFit) and isinstance(every, DoesNotFit):
        raise _neither(every, last)
    if isinstance(every, DoesNotFit) or (isinstance(last, ProbeResult) and isinstance(every, ProbeResult)
                                         and last.max_micro_batch >= every.max_micro_batch):
        assert isinstance(last, ProbeResult)
        return _noted(last, f"{FSDP_CHOICE}at the last micro-step only (chosen: one reduce-scatter a step; "
                            f"syncing after every micro-step {_gives(every)})")
    return _noted(every, f"{FSDP_CHOICE}after every micro-step (chosen: max micro-batch "
                         f"{every.max_micro_batch}; syncing at the last micro-step only, which holds the unsharded "
                         f"gradients between micro-steps, {_gives(last, every.max_micro_batch)})")


def _probed(probe: Probe, request: ProbeRequest, sync: str) -> ProbeResult | DoesNotFit:
    """The probe of ``request`` under ``sync``, or why it does not fit a micro-batch of 1."""
    try:
        return probe(request.with_rule(fsdp_sync=sync))
    except DoesNotFit as exc:
        return exc


def _neither(every: DoesNotFit, last: DoesNotFit) -> DoesNotFit:
    """Neither sync fits a micro-batch of 1: the refusal of the one that needs less (``every`` on a tie or where
    a need is unknown), naming it, with what the other needs."""
    first, other = (last, every) if last.needed is not None and every.needed is not None and \
        last.needed < every.needed else (every, last)
    names = {id(every): "after every micro-step", id(last): "at the last micro-step only"}
    need = "runs out of memory" if other.needed is None else f"needs {format_bytes(other.needed)}"
    facts = f"{FSDP_CHOICE}{names[id(first)]}: {first.facts}; syncing {names[id(other)]} {need}"
    return DoesNotFit(facts=facts, needed=first.needed, fixes=first.fixes)


def _every_unless_last_fits(every: ProbeResult | DoesNotFit, one_size: OneSize,
                            request: ProbeRequest) -> ProbeResult | None:
    """The "every" probe, chosen, where "last" does not fit its max micro-batch (one evaluation of "last"
    says so); None where "every" does not fit 1 or "last" fits as many (both are then probed)."""
    if isinstance(every, DoesNotFit):
        return None
    at = every.max_micro_batch
    log.progress(f"FSDP gradient sync at the last micro-step only, at micro-batch {at} (the max of syncing after "
                 "every micro-step): does it fit too?")
    last = one_size(request.with_rule(fsdp_sync="last"), at)
    if last.fits:
        return None
    needs = "out of memory" if last.peak_bytes is None else format_bytes(last.peak_bytes)
    return _noted(every, f"{FSDP_CHOICE}after every micro-step (chosen: max micro-batch {at}; syncing at "
                         f"the last micro-step only, which holds the unsharded gradients between micro-steps, needs "
                         f"{needs} at {at}, over the usable {format_bytes(every.usable_bytes)})")


def _gives(other: ProbeResult | DoesNotFit, at: int | None = None) -> str:
    """What the sync not chosen gave: its max micro-batch (and its peak at the chosen one's, ``at``), or why
    it does not fit."""
    if isinstance(other, DoesNotFit):
        return f"does not fit: {first_line(other)}"
    need = other.predicted_peak_at(at) if at is not None else None
    held = f", {format_bytes(need)} at {at}" if need else ""
    return f"gives max micro-batch {other.max_micro_batch}{held}"


def _noted(result: ProbeResult, note: str) -> ProbeResult:
    return replace(result, notes=(*result.notes, note))
