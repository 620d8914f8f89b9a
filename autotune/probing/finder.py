"""The probe: estimate with shape-only tensors first, confirm with one real run.

1. Estimate: the fit rule on shape-only tensors (``meta``, or ``FakeTensorMode``
   where the meta engine cannot run the workload) at batch sizes 2 and 3 gives
   the peak-vs-batch curve and its predicted max. Without a real device
   (``estimate``), shape-only runs check the prediction (usually two: the
   predicted max fits, one more does not).
2. Confirm: one real run of the fit rule at the predicted max. When the real
   peak says the next size would not fit either, that is the answer. When it
   does not fit, or leaves room for more, the search continues on the real
   device, guided by the estimate corrected by what the real runs measured.
3. When the estimate cannot run the workload (data-dependent shapes) or its
   peak depends on values it cannot know (``.item()`` deciding a shape), it
   says so and the search runs on the device from micro-batch 1. Real runs
   raise the device's out-of-memory error at its capacity, and no real run is
   more than twice the largest size that fitted while no larger one is known
   not to fit.

Only the device's own out-of-memory error means "does not fit"; any other
error from the workload stops the probe with that error and the batch size.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from .. import log, options
from ..devices.base import Device, own_random_state
from ..devices.estimate import EstimateDevice
from ..errors import DoesNotFit, EstimateUnavailable, WorkloadError
from ..results.probe import ProbeResult, Trial
from ..units import format_bytes
from ..workload import Workload
from .fitrule import Attempt, isolate, run_trial
from .fsdp import FsdpRule, fake_engine, sharding_note
from .search import PeakCurve, search_max

#: Relative difference between estimated and real peak worth a note.
MISMATCH_NOTE = 0.01
#: A real search never tries more than this many times the largest size that fitted for real
#: while no larger size is known not to fit.
GROWTH = 2
#: A real OOM where the estimate's peak is at most this share of the usable memory is flagged.
FAR_BELOW = 0.5


class _Trials:
    """Runs and remembers fit-rule trials of one source (estimate or real)."""

    def __init__(self, device: Device, workload: Workload, usable: int, source: str,
                 log: list[Trial], data_parallel: bool, sharding: FsdpRule | None = None):
        self.device, self.workload, self.usable, self.source = device, workload, usable, source
        self.data_parallel, self.sharding = data_parallel, sharding
        self.log = log
        self.done: dict[int, Attempt] = {}

    def __call__(self, batch: int) -> Attempt:
        if batch not in self.done:
            on_step = None
            if self.source == "real":
                log.progress(f"real run at micro-batch {batch} ...")
                begin = time.perf_counter()

                def on_step(done: int, total: int) -> None:
                    log.progress(f"real run at micro-batch {batch}: micro-step {done}/{total} "
                                 f"({time.perf_counter() - begin:.1f} s)", transient=True)

            # Real trials raise the device's OOM at its capacity (the CPU emulates it), so a
            # trial never takes more than the budget; estimates measure the whole step.
            attempt = run_trial(self.device, self.workload, batch, self.usable, source=self.source,
                                capacity_guard=self.source == "real", data_parallel=self.data_parallel,
                                sharding=self.sharding, on_step=on_step)
            self.done[batch] = attempt
            self.log.append(attempt.trial)
            trial = attempt.trial
            peak = "out of memory" if trial.oom else format_bytes(trial.peak_bytes)
            verdict = "fits" if trial.fits else "does not fit"
            log.progress(f"{self.source} at micro-batch {batch}: peak {peak}, {verdict} ({trial.seconds:.2f} s)")
        return self.done[batch]

    def fits(self, batch: int) -> bool:
        return self(batch).fits

    def last(self) -> Attempt:
        return self.done[self.log[-1].batch]


def probe(workload: Workload, device: Device, *, margin: float = options.MARGIN,
          max_batch: int = options.MAX_BATCH, data_parallel: bool = False,
          sharding: FsdpRule | None = None) -> ProbeResult:
    """The largest micro-batch of ``workload`` that fits ``device`` under the fit rule.

    ``data_parallel``: the plan will run under DDP (world size > 1); the fit rule
    then also holds DDP's gradient buckets. ``sharding``: the plan runs under
    FSDP; the fit rule is this rank's of a sharded model (estimated under
    FakeTensorMode, see :mod:`autotune.probing.fsdp`). When the estimate cannot run the
    workload, or its peak depends on values it cannot know (``.item()`` in the
    forward), the search runs on the device alone: from micro-batch 1, never
    more than doubling the largest size that fitted.
    """
    margin, max_batch = options.margin(margin), options.whole(max_batch, "max_batch")
    start = time.perf_counter()
    capacity = device.capacity_bytes()
    usable = options.usable_bytes(capacity, margin)
    workload = isolate(workload)
    trials: list[Trial] = []
    notes: list[str] = []
    with _user_rng_untouched(device):
        estimator = device.estimator() if sharding is None else fake_engine(device.estimator())
        est = _Trials(estimator, workload, usable, "estimate", trials, data_parallel, sharding)
        # With a real device to confirm on, the curve's prediction is checked by the real run
        # (fake runs cost more than real ones there); an estimate alone checks it with fake runs, and so
        # does a simulated allocator, whose reserved peak the live-bytes curve only approximates.
        check = device.estimated or getattr(est.device, "simulates", False)
        estimate = _estimate_or_why_not(est, usable, max_batch, capacity, margin, check=check)
        notes.extend(_values_notes(est, estimate))
        fallback = getattr(est.device, "fallback", None)
        if fallback:
            notes.append(f"estimated under FakeTensorMode: the meta engine cannot run this workload ({fallback})")
        if data_parallel:
            notes.append("the fit rule holds DDP's gradient buckets (one gradient-sized buffer) for world size > 1")
        if sharding is not None:
            notes.append(sharding_note(sharding))
        if isinstance(estimate, str):  # why the estimate cannot be used
            if device.estimated:
                raise EstimateUnavailable(f"cannot estimate workload {workload.name!r}: {estimate}; "
                                          "probe it on a real device (cpu or cuda:N) instead")
            notes.append(f"{estimate}; searched on the real device from micro-batch 1, at most doubling the "
                         "largest size that fitted")
            est_max, curve = 0, None
        else:
            est_max, curve = estimate
            log.detail(f"the estimate predicts max micro-batch {est_max} (usable {format_bytes(usable)}, "
                       f"engine {getattr(est.device, 'engine', 'n/a')}, {len(curve.lines()) if curve else 0} "
                       "lines in the peak curve)")
        estimate_at = _estimate_at(est, curve)
        if device.estimated:
            final = est_max
            measured = est(est_max)
            notes.append("estimated with fake tensors, not confirmed on a real device")
        else:
            real = _Trials(device, workload, usable, "real", trials, data_parallel, sharding)
            if isinstance(estimate, str):
                final = search_max(real.fits, low=0, high=max_batch, guess=_from_real_runs(real, usable),
                                   growth=GROWTH)
            else:
                final = _confirm(real, est_max, estimate_at, usable, max_batch, notes)
            notes.extend(_surprising_ooms(trials, estimate_at, usable))
            if final == 0:
                raise DoesNotFit(_does_not_fit(real(1).peak_bytes, usable, capacity, margin, measured=True))
            measured = real(final)
            if getattr(est.device, "simulates", False) and curve is not None:
                est(final)  # the simulation's figures beside the real ones at the answer
    assert measured.peak_bytes is not None and measured.measurement is not None
    predicted = estimate_at(final)
    error = None if device.estimated or not predicted else (measured.peak_bytes - predicted) / predicted
    upto = max(final + final // 2, max(est.done, default=1), 4)
    sizes = [b for b, _ in curve.points(min(upto, max_batch) if final < max_batch else upto)] if curve else []
    points = sorted({b: p for b in {*sizes, *est.done} if (p := estimate_at(b)) is not None}.items())
    notes.extend(_allocator_notes(est, measured))
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
        limited_by="max_batch" if final == max_batch else "memory",
        estimate_error=error,
        notes=tuple(notes),
        curve=tuple(points),
        curve_lines=tuple((a + _offset(est, curve, final), c) for a, c in curve.lines()) if curve else (),
        trials=tuple(trials),
        seconds=time.perf_counter() - start,
        options=dict(workload.chosen),
        data_parallel=data_parallel,
        allocated_peak_bytes=measured.measurement.allocated_peak_bytes,
        alloc_retries=measured.measurement.alloc_retries,
        predicted_allocated_peak_bytes=_simulated_allocated(est, final),
        parallel="fsdp" if sharding is not None else options.DEFAULT_PARALLEL,
        world_size=sharding.world_size if sharding is not None else None,
    )



def exhaustive_max(workload: Workload, device: Device, usable: int, limit: int, *,
                   peaks: dict[int, int | None] | None = None) -> int:
    """The largest micro-batch that fits by real runs alone: doubling from 1, then bisection.

    Every step is a real run of the fit rule, measured whole (no estimate
    involved); the ground truth the probe's answer is checked against.
    ``peaks`` (batch size -> real peak bytes, None for an OOM) is filled in and
    reused, so one cache serves several budgets of the same workload and device.
    """
    peaks = {} if peaks is None else peaks

    def fits(b: int) -> bool:
        if b not in peaks:
            peaks[b] = run_trial(device, workload, b, usable, source="real", capacity_guard=False).peak_bytes
        peak = peaks[b]
        return peak is not None and peak <= usable

    if not fits(1):
        return 0
    return search_max(fits, low=1, high=limit)


def _estimate_at(est: _Trials, curve: PeakCurve | None) -> Callable[[int], int | None]:
    """The estimated peak at a size: from a fake run at that size, else from the curve, shifted by what
    the fake run nearest that size measured above it (None when the estimate could not be used).

    On the CPU the curve is exact and the shift 0. Standing in for a GPU, the runs measure the simulated
    allocator's reserved peak and the curve counts live tensor bytes: the shift is the allocator's
    rounding, cache and workspaces at the nearest size run."""

    def at(b: int) -> int | None:
        if curve is None:
            return None
        if b in est.done and est.done[b].peak_bytes is not None:
            return est.done[b].peak_bytes
        return curve.peak(b) + _offset(est, curve, b)

    return at


def _offset(est: _Trials, curve: PeakCurve, b: int) -> int:
    """Measured minus curve at the fake run nearest ``b`` (the larger one on a tie)."""
    done = [(abs(s - b), -s, a.peak_bytes) for s, a in est.done.items() if a.peak_bytes is not None]
    if not done:
        return 0
    _, s, peak = min(done)
    return peak - curve.peak(-s)


def _simulated_allocated(est: _Trials, batch: int) -> int | None:
    attempt = est.done.get(batch)
    return attempt.trial.allocated_bytes if attempt is not None else None


def _allocator_notes(est: _Trials, measured: Attempt) -> list[str]:
    """What the estimate bounded or assumed, and a flag when the answer needs a release-and-retry."""
    notes = [n for a in est.done.values() if a.measurement is not None for n in a.measurement.notes]
    peaks = sorted((b, a.peak_bytes) for b, a in est.done.items() if a.peak_bytes is not None)
    drop = next(((b1, p1, b2, p2) for (b1, p1), (b2, p2) in zip(peaks, peaks[1:]) if p2 < p1), None)
    if drop is not None and getattr(est.device, "simulates", False):
        b1, p1, b2, p2 = drop
        notes.append(f"the simulated reserved peak is not monotone in the micro-batch: {b1} needs "
                     f"{format_bytes(p1)}, {b2} only {format_bytes(p2)} (the caching allocator's segment sizes "
                     "change with the tensors' sizes); a micro-batch below the max can need more than the max")
    trial = measured.trial
    if trial.retries:
        how = "in the simulation of the caching allocator" if trial.source == "estimate" else "on the device"
        notes.append(f"micro-batch {trial.batch} fits only through release-and-retry {how}: "
                     f"{trial.retries} time(s) per fit-rule run a cudaMalloc failed and the allocator "
                     "synchronised and freed its cache before trying again; it runs, but slower every step "
                     "(a smaller micro-batch avoids it)")
    return list(dict.fromkeys(notes))


def _estimate_or_why_not(est: _Trials, usable: int, max_batch: int, capacity: int, margin: float, *,
                         check: bool) -> tuple[int, PeakCurve | None] | str:
    """The estimate's max and curve, or why the estimate cannot be used for this workload."""
    try:
        first = est(min(2, max_batch))
    except WorkloadError as exc:
        return f"the estimate cannot run this workload ({_cause(exc)})"
    assert first.measurement is not None
    if first.measurement.unknown_reads:
        assert isinstance(est.device, EstimateDevice)
        other = run_trial(est.device.with_other_guesses(), est.workload, first.trial.batch, usable,
                          source="estimate", capacity_guard=False, data_parallel=est.data_parallel,
                          sharding=est.sharding)
        if other.measurement is None or other.measurement.timeline != first.measurement.timeline:
            answered = first.measurement.answered_reads
            return (f"the estimate read values it cannot know ({first.measurement.unknown_reads} reads of "
                    ".item(), .tolist() or a truth value in the forward and backward, of values that depend on "
                    f"parameters{f'; {answered} more were answered from the batch' if answered else ''}) and the "
                    "memory it holds depends on them, so it is not trusted")
    try:
        return _estimate(est, usable, max_batch, capacity, margin, check=check)
    except WorkloadError as exc:
        return f"the estimate cannot run this workload ({_cause(exc)})"


def _values_notes(est: _Trials, estimate: object) -> list[str]:
    """One note on the values the estimate read: answered exactly from the batch, or unknown (when it is used)."""
    first = next(iter(est.done.values()), None)
    m = first.measurement if first is not None else None
    if isinstance(estimate, str) or first is None or m is None or \
            not (m.answered_reads or m.answered_shapes or m.unknown_reads):
        return []
    text = (f"values computed from the batch alone answered {m.answered_reads} reads of .item(), .tolist() or a "
            f"truth value and {m.answered_shapes} data-dependent shapes exactly (fit rule at micro-batch "
            f"{first.trial.batch})")
    if m.unknown_reads:
        text += (f"; {m.unknown_reads} reads of values that depend on parameters stayed unknown and did not change "
                 "the memory it holds (checked with other answers)")
    return [text]


def _from_real_runs(real: _Trials, usable: int) -> Callable[[int, int], int | None]:
    """A guess from the real runs alone: the line through the measured peaks nearest the bracket."""

    def guess(lo: int, hi: int) -> int | None:
        peaks = sorted({t.batch: t.peak_bytes for t in real.log if t.peak_bytes is not None}.items())
        below = [(b, p) for b, p in peaks if p <= usable]
        above = [(b, p) for b, p in peaks if p > usable]
        if not below or len(peaks) < 2:
            return None
        (b1, p1), (b2, p2) = (below[-1], above[0]) if above else (below[-2], below[-1]) if len(below) > 1 \
            else (below[-1], peaks[-1])
        slope = (p2 - p1) / (b2 - b1) if b2 != b1 else 0.0
        return hi - 1 if slope <= 0 else b1 + int((usable - p1) // slope)

    return guess


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


def _estimate(est: _Trials, usable: int, max_batch: int, capacity: int, margin: float, *,
              check: bool) -> tuple[int, PeakCurve | None]:
    """Largest size the estimate says fits, and the estimated curve.

    ``check``: confirm the curve's prediction with fake runs (the predicted max
    fits, one more does not); otherwise the prediction stands as it is.
    """
    first = est(min(2, max_batch))
    if not first.fits:
        if first.trial.batch == 1 or not est(1).fits:
            raise DoesNotFit(_does_not_fit(est.done[1].peak_bytes, usable, capacity, margin, measured=False))
        return 1, None
    if max_batch <= 2:
        return max_batch, None
    second = est(3)
    assert first.measurement is not None and second.measurement is not None
    curve = PeakCurve.try_fit(2, first.measurement.timeline, 3, second.measurement.timeline)

    def guess(lo: int, hi: int) -> int:
        # The curve's prediction, shifted by how the run nearest the usable line compared with it
        # (exact on the CPU, where the shift is 0; for a CUDA stand-in, the simulated allocator's
        # rounding, cache and workspaces there).
        assert curve is not None
        near = min((a for b in (lo, hi) if (a := est.done.get(b)) is not None and a.peak_bytes is not None),
                   key=lambda a: abs(usable - (a.peak_bytes or 0)), default=est.last())
        shift = near.peak_bytes - curve.peak(near.trial.batch) if near.peak_bytes is not None else 0
        return curve.max_fitting(usable - shift, limit=max_batch)

    low = 3 if second.fits else 2
    if curve is not None and not check and curve.max_fitting(usable, limit=max_batch) >= low:
        return curve.max_fitting(usable, limit=max_batch), curve
    return search_max(est.fits, low=low, high=max_batch, guess=guess if curve else None), curve


def _confirm(real: _Trials, m: int, estimate_at: Callable[[int], int | None], usable: int, max_batch: int,
             notes: list[str]) -> int:
    """The real maximum, starting from the estimate's ``m``."""
    first = real(m)
    predicted = estimate_at(m)
    error = None if first.peak_bytes is None or predicted is None else (first.peak_bytes - predicted) / predicted
    if first.fits:
        if m == max_batch:
            return m
        # Would one more fit for real? Scale the estimate for m + 1 by the real/estimate ratio.
        next_estimate = estimate_at(m + 1)
        if next_estimate is None or first.peak_bytes is None or not predicted or \
                first.peak_bytes / predicted * next_estimate > usable:
            _note_mismatch(notes, error, m, first, predicted, searched=False)
            return m
        _note_mismatch(notes, error, m, first, predicted, searched=True, direction="room to spare")
        low, high = m, max_batch
    else:
        _note_mismatch(notes, error, m, first, predicted, searched=True, direction="does not fit")
        low, high = 0, m - 1

    def guess(lo: int, hi: int) -> int | None:
        # Real peak ~ estimate + extra; the extra is affine in the batch size, fitted
        # to the real runs (through the origin while there is only one).
        points = [(t.batch, t.peak_bytes - e) for t in real.log
                  if t.source == "real" and t.peak_bytes is not None and (e := estimate_at(t.batch)) is not None]
        if not points:
            return None
        (b1, d1), (b2, d2) = (points[-2], points[-1]) if len(points) > 1 and points[-2][0] != points[-1][0] \
            else ((0, 0.0), points[-1])
        slope = (d2 - d1) / (b2 - b1)

        def predicted_fits(b: int) -> bool:
            e = estimate_at(b)
            return e is not None and e + d1 + slope * (b - b1) <= usable

        return search_max(predicted_fits, low=lo, high=hi - 1)  # pure arithmetic, no trials

    found = search_max(real.fits, low=low, high=high, guess=guess, growth=GROWTH, high_fails=not first.fits)
    if found != m:
        notes.append(f"searched on the real device: the max micro-batch is {found}, the estimate said {m}")
    return found


def _note_mismatch(notes: list[str], error: float | None, m: int, attempt: Attempt, predicted: int | None, *,
                   searched: bool, direction: str = "") -> None:
    trial = attempt.trial
    if trial.oom:
        notes.append(f"the estimate under-counted: micro-batch {m} ran out of memory on the real device, "
                     f"estimated peak {format_bytes(predicted)}; searched on the real device")
        return
    if error is None or predicted is None or trial.peak_bytes is None or abs(error) < MISMATCH_NOTE and not searched:
        return
    word = "under-counted" if error > 0 else "over-counted"
    text = (f"the estimate {word} by {abs(error):.1%}: real peak {format_bytes(trial.peak_bytes)} vs estimated "
            f"{format_bytes(predicted)} at micro-batch {m}")
    if searched:
        text += f" ({direction}); searched on the real device"
    notes.append(text)


def _does_not_fit(needed: int | None, usable: int, capacity: int, margin: float, *, measured: bool) -> str:
    need = "runs out of memory" if needed is None else f"needs {format_bytes(needed)}"
    how = "measured" if measured else "estimated"
    return (
        f"micro-batch 1 {need} ({how}), usable memory is {format_bytes(usable)} "
        f"({format_bytes(capacity)} capacity, margin {margin:.0%}): use bf16, enable activation "
        f"checkpointing, shrink the model or the sequence length, or use a device with more memory"
    )


@contextlib.contextmanager
def _user_rng_untouched(device: Device):
    """Trials draw random numbers; the user's generators are left as they were."""
    with own_random_state(device.torch_device):
        yield
