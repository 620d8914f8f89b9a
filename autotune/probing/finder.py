"""The probe: estimate with shape-only tensors first, confirm with one real run.

1. Estimate: the fit rule on shape-only tensors (``meta``, or ``FakeTensorMode``
   where the meta engine cannot run the workload) at batch sizes 2 and 3 gives
   the peak-vs-batch curve and its first guess; evaluations of the estimate at the
   guessed sizes find the largest size that fits by the estimate
   (:mod:`autotune.probing.estimates`): a curve that bends (memory quadratic in
   the batch) or is flat, then rising, comes out exact.
2. Confirm: one real run of the fit rule at that size. When the real peak says
   the next size would not fit either, that is the answer. When it does not fit,
   or leaves room for more, the real peaks correct the estimate and the search
   goes straight to the size they predict (:mod:`autotune.probing.learn`).
3. When the estimate cannot run the workload (data-dependent shapes) or its
   peak depends on values it cannot know (``.item()`` deciding a shape), it
   says so and the search runs on the device: real runs at 1 and 2 give a peak
   curve from the live bytes they measured, refitted through the real runs
   nearest the answer after every run. Real runs raise the device's
   out-of-memory error at its capacity, so none takes more than the budget.

Only the device's own out-of-memory error means "does not fit"; any other
error from the workload stops the probe with that error and the batch size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from .. import log, options
from ..devices.base import Device, own_random_state
from ..devices.estimate import EstimateDevice
from ..errors import DoesNotFit, EstimateUnavailable, WorkloadError
from ..results.probe import ProbeResult, Trial
from ..results.request import ProbeRequest
from ..units import format_bytes, format_margin
from ..workload import Workload
from . import learn
from .estimates import EstimateCurve, search_estimate
from .fitrule import isolate, run_trial
from .fixes import fixes
from .fsdp import Sharding, sharding_note
from .hostbatch import HostBatches, HostMemory
from .trials import TrialRunner

R = TypeVar("R")

#: A real OOM where the estimate's peak is at most this share of the usable memory is flagged.
FAR_BELOW = 0.5


@dataclass(frozen=True)
class NoEstimate:
    """Why the estimate cannot be used for this workload."""

    why: str


@dataclass(frozen=True)
class Estimate:
    """What the estimate says: the largest size that fits by it, the estimate at any size, and a note
    when finding that size took more than the curve's first guess."""

    max: int
    curve: EstimateCurve
    note: str | None = None


def fit_rule_at(workload: Workload, device: Device, batch: int, request: ProbeRequest) -> Trial:
    """The fit rule of ``request`` evaluated once, at ``batch``, on ``device`` (an estimate), as its probe's search
    evaluates a size."""
    usable = options.usable_bytes(device.capacity_bytes(), options.margin(request.margin))
    with getattr(device, "standing_in", contextlib.nullcontext)():
        workload = isolate(workload)
    rule = request.rule
    return TrialRunner(device, workload, usable, "estimate", [], rule.buckets, Sharding.of(rule))(batch)


def find_max_micro_batch(workload: Workload, device: Device, *, margin: float = options.MARGIN,
                         max_batch: int = options.MAX_BATCH, data_parallel: bool = False,
                         sharding: Sharding | None = None) -> ProbeResult:
    """The largest micro-batch of ``workload`` that fits ``device`` under the fit rule.

    ``data_parallel``: the plan will run under DDP (world size > 1); the fit rule
    then also holds DDP's gradient buckets. ``sharding``: the plan runs under
    FSDP; the fit rule is this rank's of a sharded model (estimated under
    FakeTensorMode, see :mod:`autotune.probing.fsdp`). When the estimate cannot run the
    workload, or its peak depends on values it cannot know (``.item()`` in the
    forward), the search runs on the device alone (see :mod:`autotune.probing.learn`).
    """
    margin, max_batch = options.margin(margin), options.whole(max_batch, "max_batch")
    start = time.perf_counter()
    capacity = device.capacity_bytes()
    usable = options.usable_bytes(capacity, margin)
    with getattr(device, "standing_in", contextlib.nullcontext)():  # an estimate's GPU, as the code sees it
        workload = isolate(workload)
    trials: list[Trial] = []
    refused: list[HostMemory] = []  # the sizes whose batch the host could not build
    found = _search(workload, device, usable, capacity, margin, max_batch, data_parallel, sharding, trials, refused)
    final, measured, notes, curve = found.max, found.measured, found.notes, found.curve
    notes.extend([refused[-1].note(found.limit)] if refused else [])
    assert measured.peak_bytes is not None and measured.measurement is not None
    predicted = curve.at(final)
    error = None if device.estimated or not predicted else (measured.peak_bytes - predicted) / predicted
    points, lines = _curve_figures(curve, final, max_batch)
    notes.extend(_allocator_notes(found.est, measured, simulates=found.simulates))
    return ProbeResult(
        workload=workload.name,
        device=device.describe(),
        estimated=device.estimated,
        max_micro_batch=final,
        max_batch=max_batch,
        capacity_bytes=capacity,
        usable_bytes=usable,
        margin=float(margin),
        peak_bytes=measured.peak_bytes,
        predicted_peak_bytes=predicted if predicted is not None else measured.peak_bytes,
        breakdown=dict(measured.measurement.breakdown),
        limited_by="max_batch" if final == max_batch else "host_memory" if refused and final == found.limit else
        "memory",
        estimate_error=error,
        notes=tuple(notes),
        curve=points,
        curve_lines=lines,
        trials=tuple(replace(t, measurement=None) for t in trials),  # (a result carries no traces along)
        seconds=time.perf_counter() - start,
        options=dict(workload.chosen),
        data_parallel=data_parallel,
        allocated_peak_bytes=measured.measurement.allocated_peak_bytes,
        alloc_retries=measured.measurement.alloc_retries,
        predicted_allocated_peak_bytes=_simulated_allocated(found.est, final),
        parallel="fsdp" if sharding is not None else options.DEFAULT_PARALLEL,
        world_size=sharding.world_size if sharding is not None else None,
        fsdp_sync=None if sharding is None else "every" if sharding.sync_every else "last",
    )


@dataclass(frozen=True)
class Found:
    """What the search found: the max micro-batch and its measured trial (the real one, or the estimate's on an
    estimate device), the limit the host's memory kept it to, the estimate's runner and curve, whether the
    estimate's peaks are the caching-allocator simulation's, and the notes so far."""

    max: int
    measured: Trial
    limit: int
    est: TrialRunner
    curve: EstimateCurve
    simulates: bool
    notes: list[str]


def _search(workload: Workload, device: Device, usable: int, capacity: int, margin: float, max_batch: int,
            data_parallel: bool, sharding: Sharding | None, trials: list[Trial], refused: list[HostMemory]) -> Found:
    """Estimate first, then, on a real device, confirm the estimate's answer with a real run (or search on the device
    where there is none); every trial goes into ``trials``, each size whose batch the host cannot build into
    ``refused``."""
    host = HostBatches()  # the batch's host memory, shared by the estimate's and the real trials
    with _user_rng_untouched(device):
        estimator = device.estimator()
        est = TrialRunner(estimator, workload, usable, "estimate", trials, data_parallel, sharding, host)
        # A simulated allocator's reserved peak is only approximated by the live-bytes curve: the
        # estimate's answer is then bracketed by evaluations; exact engines may trust lines that held.
        estimate, limit = _within_host(lambda top: _estimate_or_why_not(
            est, usable, top, capacity, margin, exact=not estimator.simulates), max_batch, refused)
        notes = _estimate_notes(estimator, est, estimate, data_parallel, sharding)
        curve = _curve_of(estimate, est, estimator, device.estimated, usable)
        if device.estimated:
            assert isinstance(estimate, Estimate)
            final = estimate.max
            measured = est(final)
            notes.append("estimated with fake tensors, not confirmed on a real device")
        else:
            real = TrialRunner(device, workload, usable, "real", trials, data_parallel, sharding, host)
            final, measured, limit = _search_real(real, estimate, curve, usable, capacity, margin, limit, notes,
                                                  refused)
            if estimator.simulates and isinstance(estimate, Estimate):
                est(final)  # the simulation's figures beside the real ones at the answer
    return Found(final, measured, limit, est, curve, estimator.simulates, notes)


def _curve_of(estimate: Estimate | NoEstimate, est: TrialRunner, estimator: EstimateDevice, estimated: bool,
              usable: int) -> EstimateCurve:
    """The estimate's curve of peaks against sizes: its answer's, or, where it had none, one the real search fills
    (none where the device is an estimate: EstimateUnavailable)."""
    simulates = estimator.simulates
    if isinstance(estimate, NoEstimate):
        if estimated:
            raise EstimateUnavailable(f"cannot estimate workload {est.workload.name!r}: {estimate.why}; "
                                      "probe it on a real device (cpu or cuda:N) instead")
        return EstimateCurve(est, exact=not simulates)
    log.detail(f"the estimate's max micro-batch is {estimate.max} (usable {format_bytes(usable)}, engine "
               f"{estimator.engine}, {len(est.by_size)} evaluations)")
    return estimate.curve


def _within_host(search: Callable[[int], R], max_batch: int, refused: list[HostMemory]) -> tuple[R, int]:
    """``search(limit)`` with ``limit`` from ``max_batch`` down to below the smallest size whose batch the host
    cannot build (each such size goes into ``refused``); the limit it answered at. When the host cannot
    build micro-batch 1, that is the probe's answer."""
    limit = max_batch
    while True:
        try:
            return search(limit), limit
        except HostMemory as exc:
            if exc.largest < 1 or exc.batch > limit:
                raise
            refused.append(exc)
            limit = min(exc.batch - 1, exc.largest)


def _estimate_notes(estimator: EstimateDevice, est: TrialRunner, estimate: Estimate | NoEstimate, data_parallel: bool,
                    sharding: Sharding | None) -> list[str]:
    """What the estimate read and ran on, and the fit rule it held, as the probe's first notes."""
    notes = _values_notes(est, estimate)
    if estimator.fallback:
        notes.append(f"estimated under FakeTensorMode: the meta engine cannot run this workload ({estimator.fallback})")
    if data_parallel:
        notes.append("the fit rule holds DDP's gradient buckets (one gradient-sized buffer) for world size > 1")
    if sharding is not None:
        notes.append(sharding_note(sharding))
    if isinstance(estimate, Estimate) and estimate.note:
        notes.append(estimate.note)
    return notes


def _search_real(real: TrialRunner, estimate: Estimate | NoEstimate, curve: EstimateCurve, usable: int, capacity: int,
                 margin: float, max_batch: int, notes: list[str], refused: list[HostMemory]
                 ) -> tuple[int, Trial, int]:
    """:func:`_search_once` within what the host can build (see :func:`_within_host`); the limit it kept to."""
    def search(top: int) -> tuple[int, Trial, list[str]]:
        said: list[str] = []
        start = replace(estimate, max=top) if isinstance(estimate, Estimate) and estimate.max > top else estimate
        return (*_search_once(real, start, curve, usable, capacity, margin, top, said), said)

    (final, measured, said), limit = _within_host(search, max_batch, refused)
    notes.extend(said)
    return final, measured, limit


def _search_once(real: TrialRunner, estimate: Estimate | NoEstimate, curve: EstimateCurve, usable: int, capacity: int,
                 margin: float, max_batch: int, notes: list[str]) -> tuple[int, Trial]:
    """The real maximum and its real run: confirmed from the estimate's answer, or searched on the device
    alone when there is none; what the search did goes into ``notes``."""
    note: str | None
    if isinstance(estimate, NoEstimate):
        final, note = learn.search_device(real, usable, capacity, max_batch, why=estimate.why)
    else:
        final, note = learn.confirm(real, curve, estimate.max, usable, capacity, max_batch)
    notes.extend([note] if note else [])
    notes.extend(_surprising_ooms(real.log, curve.at, usable))
    if final == 0:
        raise _does_not_fit(real.workload, real(1).peak_bytes, usable, capacity, margin, measured=True)
    return final, real(final)


def _curve_figures(curve: EstimateCurve, final: int, max_batch: int
                   ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[float, float], ...]]:
    """The estimated curve as the result keeps it: (batch, peak) points, at every size the estimate ran
    and along the curve up to half again past the answer, and its lines (none when it bends)."""
    runs = curve.runs.by_size
    fitted = curve.curve(final)
    upto = max(final + final // 2, max(runs, default=1), 4)
    sizes = [b for b, _ in fitted.points(min(upto, max_batch) if final < max_batch else upto)] if fitted else []
    points = tuple(sorted({b: p for b in {*sizes, *runs} if (p := curve.at(b)) is not None}.items()))
    if fitted is None:
        return points, ()
    shift = curve.shift(fitted, final)
    return points, tuple((a + shift, c) for a, c in fitted.lines())


def _simulated_allocated(est: TrialRunner, batch: int) -> int | None:
    measured = est.by_size.get(batch)
    return measured.allocated_bytes if measured is not None else None


def _allocator_notes(est: TrialRunner, measured: Trial, *, simulates: bool) -> list[str]:
    """What the estimate bounded or assumed, and a flag when the answer needs a release-and-retry (``simulates``:
    the estimate's peaks are the caching-allocator simulation's)."""
    notes = _one_of_each(est, measured.batch)
    if measured.source == "real" and measured.measurement is not None:
        notes.extend(measured.measurement.notes)  # how the real run measured (a compiled model's, say)
    peaks = sorted((b, a.peak_bytes) for b, a in est.by_size.items() if a.peak_bytes is not None)
    drop = next(((b1, p1, b2, p2) for (b1, p1), (b2, p2) in zip(peaks, peaks[1:]) if p2 < p1), None)
    if drop is not None and simulates:
        b1, p1, b2, p2 = drop
        notes.append(f"the simulated reserved peak is not monotone in the micro-batch: {b1} needs "
                     f"{format_bytes(p1)}, {b2} only {format_bytes(p2)} (the caching allocator's segment sizes "
                     "change with the tensors' sizes); a micro-batch below the max can need more than the max")
    if measured.retries:
        how = "in the simulation of the caching allocator" if measured.source == "estimate" else "on the device"
        notes.append(f"micro-batch {measured.batch} fits only through release-and-retry {how}: "
                     f"{measured.retries} time(s) per fit-rule run a cudaMalloc failed and the allocator "
                     "synchronised and freed its cache before trying again; it runs, but slower every step "
                     "(a smaller micro-batch avoids it)")
    return list(dict.fromkeys(notes))


def _one_of_each(est: TrialRunner, batch: int) -> list[str]:
    """The evaluations' notes, one of each kind (the text before its first colon): the one at ``batch`` (the
    answer) where it was evaluated, else at the size nearest it (each size's figures differ, the kind of note
    does not)."""
    def notes(b: int) -> tuple[str, ...]:
        measured = est.by_size[b].measurement
        return measured.notes if measured is not None else ()

    def kind(note: str) -> str:
        return note.split(":", 1)[0]

    kinds = dict.fromkeys(kind(n) for b in est.by_size for n in notes(b))  # in the order they first came
    nearest_of_kind: dict[str, str] = {}
    for b in sorted(est.by_size, key=lambda b: (abs(b - batch), b)):
        for note in notes(b):
            nearest_of_kind.setdefault(kind(note), note)
    return [nearest_of_kind[k] for k in kinds]


def _estimate_or_why_not(est: TrialRunner, usable: int, max_batch: int, capacity: int, margin: float, *,
                         exact: bool) -> Estimate | NoEstimate:
    """The estimate's max and curve, or why the estimate cannot be used for this workload."""
    try:
        first = est(min(2, max_batch))
    except WorkloadError as exc:
        return NoEstimate(f"the estimate cannot run this workload ({_cause(exc)})")
    assert first.measurement is not None
    if first.measurement.unknown_reads:
        assert isinstance(est.device, EstimateDevice)
        other = run_trial(est.device.with_other_guesses(), est.workload, first.batch, usable,
                          source="estimate", capacity_guard=False, data_parallel=est.data_parallel,
                          sharding=est.sharding, host=est.host)
        if other.measurement is None or other.measurement.timeline != first.measurement.timeline:
            answered = first.measurement.answered_reads
            origin = first.measurement.unknown_origin or "values that depend on parameters"
            return NoEstimate(f"the estimate read values it cannot know ({first.measurement.unknown_reads} reads "
                              f"of .item(), .tolist() or a truth value in the forward and backward, of {origin}"
                              f"{f'; {answered} more were answered from the batch' if answered else ''}) and the "
                              "memory it holds depends on them, so it is not trusted")
    try:
        return _estimate(est, usable, max_batch, capacity, margin, exact=exact)
    except WorkloadError as exc:
        return NoEstimate(f"the estimate cannot run this workload ({_cause(exc)})")


def _values_notes(est: TrialRunner, estimate: Estimate | NoEstimate) -> list[str]:
    """One note on the values the estimate read: answered exactly from the batch, or unknown (when it is used)."""
    first = next(iter(est.by_size.values()), None)
    m = first.measurement if first is not None else None
    if isinstance(estimate, NoEstimate) or first is None or m is None or \
            not (m.answered_reads or m.answered_shapes or m.unknown_reads):
        return []
    text = (f"values computed from the batch alone answered {m.answered_reads} reads of .item(), .tolist() or a "
            f"truth value and {m.answered_shapes} data-dependent shapes exactly (fit rule at micro-batch "
            f"{first.batch})")
    if m.unknown_reads:
        text += (f"; {m.unknown_reads} reads of {m.unknown_origin or 'values that depend on parameters'} stayed "
                 "unknown and did not change "
                 "the memory it holds (checked with other answers)")
    return [text]


def _cause(exc: WorkloadError) -> str:
    """The workload's own error inside a WorkloadError's message."""
    return str(exc).split("): ", 1)[-1]


def _surprising_ooms(trials: list[Trial], estimate_at: Callable[[int], int | None], usable: int) -> list[str]:
    """A note for the first real OOM at a size the estimate put far below the usable memory."""
    for t in trials:
        predicted = estimate_at(t.batch)
        if t.source == "real" and t.oom and predicted is not None and predicted <= usable * FAR_BELOW:
            return [f"micro-batch {t.batch} ran out of memory on the device far below the estimate: "
                    f"estimated peak {format_bytes(predicted)}, {predicted / usable:.0%} of the usable "
                    f"{format_bytes(usable)} ({t.why}); something outside the fit rule holds memory (another "
                    "process, a cache), or the workload raises its own out-of-memory error"]
    return []


def _estimate(est: TrialRunner, usable: int, max_batch: int, capacity: int, margin: float, *, exact: bool) -> Estimate:
    """Largest size the estimate says fits, found by evaluating it (see :mod:`autotune.probing.estimates`).

    ``exact``: the engine's figures are exact live bytes (no allocator simulation).
    """
    curve = EstimateCurve(est, exact=exact)
    first = est(min(2, max_batch))
    if not first.fits:
        if first.batch == 1 or not est(1).fits:
            raise _does_not_fit(est.workload, est.by_size[1].peak_bytes, usable, capacity, margin, measured=False)
        return Estimate(1, curve)
    if max_batch <= 2:
        return Estimate(max_batch, curve)
    if not est(3).fits:
        return Estimate(2, curve)
    found, note = search_estimate(est, curve, usable, max_batch)
    return Estimate(found, curve, note)


def _does_not_fit(workload: Workload, needed: int | None, usable: int, capacity: int, margin: float, *,
                  measured: bool) -> DoesNotFit:
    need = "runs out of memory" if needed is None else f"needs {format_bytes(needed)}"
    how = "measured" if measured else "estimated"
    facts = (f"micro-batch 1 {need} ({how}), usable memory is {format_bytes(usable)} "
             f"({format_bytes(capacity)} capacity, margin {format_margin(margin)})")
    return DoesNotFit(facts=facts, needed=needed, fixes=lambda: fixes(workload))


@contextlib.contextmanager
def _user_rng_untouched(device: Device):
    """Trials draw random numbers; the user's generators are left as they were."""
    with own_random_state(device.torch_device):
        yield
