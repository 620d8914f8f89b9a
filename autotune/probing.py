"""The probe: estimate with fake tensors first, confirm with one real run.

1. Estimate: the fit rule under ``FakeTensorMode`` at batch sizes 2 and 3 gives
   the peak-vs-batch curve and its predicted max. Without a real device
   (``estimate``), fake runs check the prediction (usually two: the predicted
   max fits, one more does not).
2. Confirm: one real run of the fit rule at the predicted max. When the real
   peak says the next size would not fit either, that is the answer. When it
   does not fit, or leaves room for more, the search continues on the real
   device inside the estimate's bracket, guided by the estimate corrected by
   what the real runs measured.

Only an out-of-memory error means "does not fit"; any other error from the
workload stops the probe with that error and the batch size it hit.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from .devices.base import Device
from .errors import BadInput, DoesNotFit
from .fitrule import Trial, isolate, run_trial
from .results import ProbeResult, trials_frame
from .search import PeakCurve, search_max
from .units import format_bytes
from .workload import Workload

DEFAULT_MARGIN = 0.10
DEFAULT_MAX_BATCH = 65536
#: Relative difference between estimated and real peak worth a note.
MISMATCH_NOTE = 0.01

Progress = Callable[[str], None]


def usable_bytes(capacity: int, margin: float) -> int:
    """Usable capacity = capacity x (1 - margin), in whole bytes."""
    return int(capacity * (1.0 - margin))


def validate(margin: float, max_batch: int) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise BadInput(f"margin {margin!r} must be a fraction in [0, 1), e.g. 0.1 for 10% kept free")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise BadInput(f"max batch {max_batch!r} must be a whole number of at least 1")


class _Trials:
    """Runs and remembers fit-rule trials of one source (estimate or real)."""

    def __init__(self, device: Device, workload: Workload, usable: int, source: str,
                 log: list[Trial], progress: Progress | None, data_parallel: bool):
        self.device, self.workload, self.usable, self.source = device, workload, usable, source
        self.data_parallel = data_parallel
        self.log, self.progress = log, progress
        self.done: dict[int, Trial] = {}

    def __call__(self, batch: int) -> Trial:
        if batch not in self.done:
            if self.progress and self.source == "real":
                self.progress(f"real run at micro-batch {batch} ...")
            # Real trials measure the whole fit rule where the device allows (the CPU does):
            # how far past the budget a size goes is what the search learns from.
            trial = run_trial(self.device, self.workload, batch, self.usable, source=self.source,
                              capacity_guard=False, data_parallel=self.data_parallel)
            self.done[batch] = trial
            self.log.append(trial)
            if self.progress:
                peak = "out of memory" if trial.oom else format_bytes(trial.peak_bytes)
                verdict = "fits" if trial.fits else "does not fit"
                self.progress(f"{self.source} at micro-batch {batch}: peak {peak}, {verdict} "
                              f"({trial.seconds:.2f} s)")
        return self.done[batch]

    def fits(self, batch: int) -> bool:
        return self(batch).fits

    def last(self) -> Trial:
        return self.log[-1]


def probe(workload: Workload, device: Device, *, margin: float = DEFAULT_MARGIN,
          max_batch: int = DEFAULT_MAX_BATCH, data_parallel: bool = False,
          progress: Progress | None = None) -> ProbeResult:
    """The largest micro-batch of ``workload`` that fits ``device`` under the fit rule.

    ``data_parallel``: the plan will run under DDP (world size > 1); the fit rule
    then also holds DDP's gradient buckets.
    """
    validate(margin, max_batch)
    start = time.perf_counter()
    capacity = device.capacity_bytes()
    usable = usable_bytes(capacity, margin)
    workload = isolate(workload)
    log: list[Trial] = []
    with _user_rng_untouched(device):
        est = _Trials(device.estimator(), workload, usable, "estimate", log, progress, data_parallel)
        # With a real device to confirm on, the curve's prediction is checked by the real run
        # (fake runs cost more than real ones there); an estimate alone checks it with fake runs.
        est_max, curve = _estimate(est, usable, max_batch, capacity, margin, check=device.estimated)
        notes: list[str] = []
        fallback = getattr(est.device, "fallback", None)
        if fallback:
            notes.append(f"estimated under FakeTensorMode: the meta engine cannot run this workload ({fallback})")
        if data_parallel:
            notes.append("the fit rule holds DDP's gradient buckets (one gradient-sized buffer) for world size > 1")
        if device.estimated:
            best = est(est_max)
            final, measured, error = est_max, best, None
            notes.append("estimated with fake tensors, not confirmed on a real device")
        else:
            real = _Trials(device, workload, usable, "real", log, progress, data_parallel)
            final, error = _confirm(real, est_max, _estimate_at(est, curve), usable, max_batch, notes)
            if final == 0:
                raise DoesNotFit(_does_not_fit(real(1).peak_bytes, usable, capacity, margin, measured=True))
            measured = real(final)
    predicted = _estimate_at(est, curve)(final)
    upto = max(final + final // 2, max(est.done), 4)
    points = curve.points(min(upto, max_batch) if final < max_batch else upto) if curve else []
    points = sorted({**dict(points), **{b: t.peak_bytes for b, t in est.done.items() if t.peak_bytes is not None}}.items())
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
        curve_lines=tuple(curve.lines()) if curve else (),
        trials=trials_frame([{"batch": t.batch, "source": t.source, "peak_bytes": t.peak_bytes, "fits": t.fits,
                              "seconds": t.seconds, "oom": t.oom} for t in log]),
        seconds=time.perf_counter() - start,
        options=dict(workload.chosen),
        data_parallel=data_parallel,
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
        return peaks[b] is not None and peaks[b] <= usable

    if not fits(1):
        return 0
    return search_max(fits, low=1, high=limit)


def _estimate_at(est: _Trials, curve: PeakCurve | None) -> Callable[[int], int | None]:
    """The estimated peak at a size: from a fake run at that size, else from the curve."""

    def at(b: int) -> int | None:
        if b in est.done and est.done[b].peak_bytes is not None:
            return est.done[b].peak_bytes
        return curve.peak(b) if curve else None

    return at


def _estimate(est: _Trials, usable: int, max_batch: int, capacity: int, margin: float, *,
              check: bool) -> tuple[int, PeakCurve | None]:
    """Largest size the estimate says fits, and the estimated curve.

    ``check``: confirm the curve's prediction with fake runs (the predicted max
    fits, one more does not); otherwise the prediction stands as it is.
    """
    first = est(min(2, max_batch))
    if not first.fits:
        if first.batch == 1 or not est(1).fits:
            raise DoesNotFit(_does_not_fit(est.done[1].peak_bytes, usable, capacity, margin, measured=False))
        return 1, None
    if max_batch <= 2:
        return max_batch, None
    second = est(3)
    curve = PeakCurve.try_fit(2, first.measurement.timeline, 3, second.measurement.timeline)

    def guess(lo: int, hi: int) -> int:
        # The curve's prediction, scaled by how the last run compared with it
        # (exact on the CPU; rounding makes it slightly off for a CUDA stand-in).
        last = est.last()
        scale = last.peak_bytes / max(1, curve.peak(last.batch)) if last.peak_bytes else 1.0
        return curve.max_fitting(int(usable / max(scale, 1e-9)), limit=max_batch)

    low = 3 if second.fits else 2
    if curve is not None and not check and curve.max_fitting(usable, limit=max_batch) >= low:
        return curve.max_fitting(usable, limit=max_batch), curve
    return search_max(est.fits, low=low, high=max_batch, guess=guess if curve else None), curve


def _confirm(real: _Trials, m: int, estimate_at: Callable[[int], int | None], usable: int, max_batch: int,
             notes: list[str]) -> tuple[int, float | None]:
    """The real maximum, starting from the estimate's ``m``; and the estimate's error at ``m``."""
    first = real(m)
    predicted = estimate_at(m)
    error = None if first.oom or predicted is None else (first.peak_bytes - predicted) / predicted
    if first.fits:
        if m == max_batch:
            return m, error
        # Would one more fit for real? Scale the estimate for m + 1 by the real/estimate ratio.
        next_estimate = estimate_at(m + 1)
        if next_estimate is None or first.peak_bytes / predicted * next_estimate > usable:
            _note_mismatch(notes, error, m, first, predicted, searched=False)
            return m, error
        _note_mismatch(notes, error, m, first, predicted, searched=True, direction="room to spare")
        low, high = m, max_batch
    else:
        _note_mismatch(notes, error, m, first, predicted, searched=True, direction="does not fit")
        low, high = 0, m - 1

    def guess(lo: int, hi: int) -> int:
        # Real peak ~ estimate + extra; the extra is affine in the batch size, fitted
        # to the real runs (through the origin while there is only one).
        points = [(t.batch, t.peak_bytes - estimate_at(t.batch)) for t in real.log if t.source == "real"
                  and not t.oom and estimate_at(t.batch) is not None]
        if not points:
            return (lo + hi) // 2
        (b1, d1), (b2, d2) = (points[-2], points[-1]) if len(points) > 1 and points[-2][0] != points[-1][0] \
            else ((0, 0.0), points[-1])
        slope = (d2 - d1) / (b2 - b1)

        def predicted_fits(b: int) -> bool:
            e = estimate_at(b)
            return e is not None and e + d1 + slope * (b - b1) <= usable

        return search_max(predicted_fits, low=lo, high=hi - 1)  # pure arithmetic, no trials

    found = search_max(real.fits, low=low, high=high, guess=guess)
    if found != m:
        notes.append(f"searched on the real device: the max micro-batch is {found}, the estimate said {m}")
    return found, error


def _note_mismatch(notes: list[str], error: float | None, m: int, trial: Trial, predicted: int, *,
                   searched: bool, direction: str = "") -> None:
    if trial.oom:
        notes.append(f"the estimate under-counted: micro-batch {m} ran out of memory on the real device, "
                     f"estimated peak {format_bytes(predicted)}; searched on the real device")
        return
    if error is None or abs(error) < MISMATCH_NOTE and not searched:
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
    name = getattr(device, "name", "")
    devices = [int(name.split(":")[1])] if name.startswith("cuda:") else []
    with torch.random.fork_rng(devices=devices):
        yield
