"""The plan store as a cache around the probe: :func:`probe_through_store` is
:func:`autotune.probing.finder.find_max_micro_batch`, answered from the store when it holds the answer and kept there
when it does not.

A probe with a store takes the fingerprint (:mod:`autotune.store.fingerprint`), then uses the store by
its three calls only: ``get`` the entry under it, ``claim`` it to probe once while others asking wait,
``put`` what the probe gave with its measurements. The entry answers the probe when memory set its max
(whatever the probe's own limit), or when it stopped at a limit no smaller than the probe's
(:meth:`~autotune.store.schema.Entry.answers`). When it does:

- on an estimate, that answer is the result (:func:`autotune.store.answer.for_estimate`): nothing is
  estimated again;
- on a real device, one confirm run of the fit rule at the stored max runs. It must fit the usable
  memory now, peak within :data:`CONFIRM_TOLERANCE` of the stored peak, and leave no room for one
  more (when memory set the max and the probe's limit is larger); otherwise the entry is invalidated
  with the reason, and the probe runs in full.

Otherwise the probe runs, once for all processes asking at the same time (the others wait for its
answer), and its result is stored; a damaged entry (one that cannot be read back) is probed again and
replaced. Every real fit-rule run is recorded as a measurement against the fingerprint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from .. import log, options
from ..devices.base import Device, own_random_state
from ..errors import DoesNotFit
from ..probing import finder, learn
from ..probing.fitrule import isolate, run_trial
from ..probing.fsdp import Sharding
from ..results.device import DeviceInfo
from ..results.plan import Plan
from ..results.probe import ProbeResult, Trial
from ..results.request import FitRule, ProbeRequest
from ..results.run import RunResult
from ..training import distributed
from ..units import format_bytes
from ..workload import Workload
from .fingerprint import Untraceable, fingerprint

if TYPE_CHECKING:
    from .schema import Entry, Observation
    from .store import Store

# The store's own modules (answer, claims, rows, schema) load SQLAlchemy: they are imported where a store is in
# use, so that a probe without one starts without a database library.

#: A confirm run whose peak differs from the stored one by more than this share disagrees with it.
CONFIRM_TOLERANCE = 0.05


def probe_through_store(store: Store | None, request: ProbeRequest, workload: Workload, device: Device, *,
                        ranks: Sequence[DeviceInfo] | None = None) -> ProbeResult:
    """:func:`autotune.probing.finder.find_max_micro_batch` of ``request``, answered from ``store`` when it can
    be (see the module); without a store, the probe itself. The request is part of the fingerprint, and so are
    ``ranks``, every rank's device in a job whose ranks differ (the plans kept beside it are that job's)."""
    rule = request.rule

    def probed() -> ProbeResult:
        return finder.find_max_micro_batch(workload, device, margin=request.margin, max_batch=request.max_batch,
                                           data_parallel=rule.buckets, sharding=Sharding.of(rule))

    if store is None:
        return probed()
    try:
        fp = fingerprint(workload, device, request, ranks=ranks)
    except Untraceable as exc:
        result = probed()
        return replace(result, notes=result.notes + (
            f"not kept in the store: the workload cannot be built on shape-only tensors to take its "
            f"fingerprint ({exc})",))
    log.detail(f"fingerprint {fp.short} ({fp.seconds:.2f} s)")

    def answer() -> ProbeResult | None:
        return _answer(store, fp.digest, workload, device, margin=request.margin, max_batch=request.max_batch,
                       rule=rule)

    def waiting(holder: str) -> None:
        from .claims import owner_words

        log.progress(f"waiting for {owner_words(holder)}, which is probing the same workload (fingerprint "
                     f"{fp.short})")

    if (served := answer()) is not None:
        return served
    with store.claim(fp.digest, on_wait=waiting):
        # Look again once the claim is held: another job may have stored its answer since the first look,
        # after waiting for it or not (it let go of the claim before this job asked).
        if (served := answer()) is not None:
            return served
        result = replace(probed(), fingerprint=fp.digest)
        was_stored = store.put(fp.digest, result=result, parts=fp.components, measurements=probe_observations(result))
    if was_stored:
        log.detail(f"stored as fingerprint {fp.short} in {store.shown}")
    return result


def _answer(store: Store, digest: str, workload: Workload, device: Device, *, margin: float, max_batch: int,
            rule: FitRule) -> ProbeResult | None:
    """The stored answer (served, its hit counted), or None: none stored, damaged (then invalidated),
    not answering this limit, or not borne out by a confirm run."""
    entry = store.get(digest)
    if entry is None:
        return None
    if entry.damage is not None:
        if entry.valid:
            log.progress(f"the store's entry {entry.short} is damaged ({entry.damage}): probing again to replace it")
            store.put(digest, invalid=f"damaged: {entry.damage}")
        return None
    if not entry.answers(max_batch):
        return None
    if device.estimated:
        from .answer import for_estimate

        served = for_estimate(entry, max_batch)
        store.put(digest, result=served)
        return served
    confirm, observed, why = confirmed(entry, workload, device, margin=margin, max_batch=max_batch, rule=rule)
    store.put(digest, result=confirm, measurements=(observed,), invalid=why)
    if why is not None:
        log.progress(f"the store's entry {entry.short} no longer holds: {why}; probing again")
    return confirm


def confirmed(entry: Entry, workload: Workload, device: Device, *, margin: float, max_batch: int,
              rule: FitRule) -> tuple[ProbeResult | None, Observation, str | None]:
    """The stored answer to a probe limited to ``max_batch`` on a real device, confirmed by one real run
    of the fit rule at the stored max (:func:`narrowed`): the answer (None when the run disagrees), the
    run's measurement, and why it disagrees (None when it agrees)."""
    from .answer import narrowed, note, stored

    start = time.perf_counter()
    result = stored(entry)
    m = result.max_micro_batch
    said = note(entry)
    capacity = device.capacity_bytes()
    usable = options.usable_bytes(capacity, margin)
    log.progress(f"{said}; confirming micro-batch {m} with one real run ...")
    measured = _confirm_run(device, workload, m, usable, rule)
    why = disagreement(result, measured, usable, max_batch)
    observed = observation(measured, result, entry.fingerprint, device.describe(), "confirm", note=why)
    if why is not None:
        return None, observed, why
    assert measured.measurement is not None and measured.peak_bytes is not None
    predicted = result.predicted_peak_at(m) or result.predicted_peak_bytes
    log.progress(f"real at micro-batch {m}: peak {format_bytes(measured.peak_bytes)}, fits, as stored")
    result = replace(
        result, device=device.describe(), capacity_bytes=capacity, usable_bytes=usable,
        peak_bytes=measured.peak_bytes, breakdown=dict(measured.measurement.breakdown),
        estimate_error=(measured.peak_bytes - predicted) / predicted if predicted else None,
        trials=result.trials + (replace(measured, measurement=None),),
        notes=(f"{said}; confirmed by one real run",) + result.notes)
    return replace(narrowed(result, max_batch), seconds=time.perf_counter() - start), observed, None


def _confirm_run(device: Device, workload: Workload, batch: int, usable: int, rule: FitRule) -> Trial:
    """One real run of the fit rule at ``batch``, the user's random state left as it was."""
    with own_random_state(device.torch_device):
        return run_trial(device, isolate(workload), batch, usable, source="real", capacity_guard=True,
                         data_parallel=rule.buckets, sharding=Sharding.of(rule))


def disagreement(stored: ProbeResult, measured: Trial, usable: int, max_batch: int) -> str | None:
    """Why a confirm run at the stored max does not bear the stored result out, or None when it does."""
    m, peak = stored.max_micro_batch, measured.peak_bytes
    if measured.oom or peak is None:
        return f"micro-batch {m} ran out of memory in the confirm run ({measured.why})"
    if peak > usable:
        return (f"micro-batch {m} peaks at {format_bytes(peak)} in the confirm run, over the "
                f"{format_bytes(usable)} usable now")
    if stored.peak_bytes and abs(peak - stored.peak_bytes) > CONFIRM_TOLERANCE * stored.peak_bytes:
        change = (peak - stored.peak_bytes) / stored.peak_bytes
        return (f"micro-batch {m} peaks at {format_bytes(peak)} in the confirm run, {abs(change):.1%} "
                f"{'above' if change > 0 else 'below'} the stored {format_bytes(stored.peak_bytes)}")
    if stored.limited_by == "memory" and m < max_batch:
        # One more, as the stored real runs corrected the estimate, scaled by how the confirm run compares.
        at_m, at_next = stored.peak_bytes, learn.expected_peak(stored, m + 1)
        if at_m and at_next and peak / at_m * at_next <= usable:
            return (f"micro-batch {m + 1} would fit the {format_bytes(usable)} usable now (about "
                    f"{format_bytes(int(peak / at_m * at_next))}); it was stored with "
                    f"{format_bytes(stored.usable_bytes)} usable")
    return None


def observation(measured: Trial, stored: ProbeResult, digest: str, device: DeviceInfo, source: str, *,
                runs_before: int = 0, note: str | None = None) -> Observation:
    """A measurement from one real fit-rule run, against the stored estimate."""
    from .rows import device_label
    from .schema import Observation

    m = measured.measurement
    return Observation(
        fingerprint=digest, source=source, device=device_label(device), device_kind=device.kind,
        batch=measured.batch, peak_reserved_bytes=measured.peak_bytes,
        peak_allocated_bytes=m.tracked_peak_bytes if m is not None else None,
        estimated_peak_bytes=stored.predicted_peak_at(measured.batch), oom=measured.oom, runs_before=runs_before,
        seconds=measured.seconds, note=note)


def probe_observations(result: ProbeResult) -> list[Observation]:
    """A measurement per real fit-rule run of a probe (none for an estimate)."""
    if result.estimated or result.fingerprint is None:
        return []
    from .rows import device_label
    from .schema import Observation

    device = device_label(result.device)
    real = [t for t in result.trials if t.source == "real"]
    out = []
    for i, t in enumerate(real):
        at_max = t.batch == result.max_micro_batch and t.peak_bytes == result.peak_bytes
        out.append(Observation(
            fingerprint=result.fingerprint, source="probe", device=device, device_kind=result.device.kind,
            batch=t.batch, peak_reserved_bytes=t.peak_bytes,
            peak_allocated_bytes=sum(result.breakdown.values()) if at_max and result.breakdown else None,
            estimated_peak_bytes=result.predicted_peak_at(t.batch), oom=t.oom, runs_before=i, seconds=t.seconds,
            note=t.why))
    return out


def run_observation(result: RunResult, digest: str) -> Observation:
    """The measurement of a run of a plan: its peaks against the plan's prediction (when the run
    trained in fp32, as the probe measures), and its throughput."""
    from .rows import device_label
    from .schema import Observation

    return Observation(
        fingerprint=digest, source="run", device=device_label(result.device), device_kind=result.device.kind,
        batch=result.plan.micro_batch, peak_reserved_bytes=result.peak_bytes,
        peak_allocated_bytes=result.allocated_peak_bytes,
        estimated_peak_bytes=result.predicted_peak_bytes if result.precision == "fp32" else None,
        throughput=result.samples_per_s, seconds=sum(result.step_seconds),
        note=None if result.precision == "fp32" else f"trained in {result.precision}")


def oom_observation(plan: Plan, digest: str, device: Device, why: str) -> Observation:
    """The measurement of a run of a plan that ran out of memory."""
    from .rows import device_label
    from .schema import Observation

    info, rank = device.describe(), distributed.rank()
    return Observation(fingerprint=digest, source="run", device=device_label(info), device_kind=info.kind,
                       batch=max(plan.schedule[rank]) if plan.mixed is not None else plan.micro_batch,
                       estimated_peak_bytes=plan.predicted_peak_of(rank), oom=True, note=why)


def record_run(store: Store, plan: Plan, workload: Workload, device: Device, precision: str,
               train: Callable[[], RunResult]) -> RunResult:
    """``train()``, with what it measured (or that it ran out of memory) recorded in ``store`` against
    the fingerprint of the plan's probe (taken here when the plan has none)."""
    digest = plan.probe.fingerprint if plan.probe is not None else None
    if plan.mixed is not None:  # each rank's own probe, whichever rank's the plan holds
        digest = plan.mixed.ranks[distributed.rank()].fingerprint
    if digest is None:
        margin = plan.probe.margin if plan.probe is not None else options.MARGIN
        request = ProbeRequest(device=device.describe().name, margin=margin, precision=options.precision(precision),
                               rule=FitRule.of(plan.parallel, plan.world_size, rank=distributed.rank()))
        try:
            digest = fingerprint(workload, device, request).digest
        except Untraceable as exc:
            log.progress(f"the run is not recorded in the store: the workload cannot be built on shape-only "
                         f"tensors to take its fingerprint ({exc})")
            return train()
    try:
        result = train()
    except DoesNotFit as exc:
        store.put(digest, measurements=(oom_observation(plan, digest, device, str(exc)),))
        raise
    store.put(digest, measurements=(run_observation(result, digest),))
    return result
