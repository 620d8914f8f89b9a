"""The gradient noise scale a run measured, and what it means for the target batch.

``B_simple = tr(Σ) / |G|²`` (McCandlish et al. 2018) predicts the critical batch:
well below it a larger batch buys almost proportionally fewer optimizer steps,
well above it extra samples buy almost nothing. :mod:`autotune.training.noise`
measures it from accumulation's micro-steps; this module holds the result and
the word to the user. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .record import Count, Record


@dataclass(frozen=True, kw_only=True)
class NoiseStep(Record):
    """One optimizer step's raw estimates, and the smoothed noise scale after it (for plots)."""

    step: int                  # index of the optimizer step (counting every end_step)
    items: int                 # N: items of the effective batch, all ranks
    micro_batches: int         # k: micro-batches with items, all ranks
    grad_sq: float             # this step's unbiased |G|²
    trace_cov: float           # this step's unbiased tr(Σ)
    b_simple: float | None     # smoothed tr(Σ) / |G|² after this step (None while either is <= 0)
    low: float | None          # its 95% interval (None: too noisy to bound)
    high: float | None         # None with low set: unbounded above


@dataclass(frozen=True, kw_only=True)
class NoiseScaleEstimate(Record):
    """The smoothed noise scale and what it rests on: what a run's result carries."""

    b_simple: float | None     # EMA(tr Σ) / EMA(|G|²), in items; None when either is <= 0 or no step counted
    low: float | None          # 95% interval (Fieller, over the per-step estimates); None: too noisy
    high: float | None         # None with low set: unbounded above
    grad_sq: float | None      # EMA of the per-step |G|² (bias-corrected)
    trace_cov: float | None    # EMA of the per-step tr(Σ) (bias-corrected)
    steps: Count               # optimizer steps with an estimate
    skipped: Count             # measured steps without one (one micro-batch, non-finite or split gradients)
    items_per_step: float | None  # mean N over the counted steps
    reason: str | None = None  # why there is no estimate, when steps == 0
    unit: str = "samples"      # what the batch sizes count: samples, or the items (tokens) the loss averages over
    history: tuple[NoiseStep, ...] = ()  # every counted step, oldest first (for plots)

    def validate(self) -> None:
        if not self.steps:
            return
        for name in ("grad_sq", "trace_cov", "items_per_step"):
            if getattr(self, name) is None:
                raise ValueError(f"{name} is None though {self.steps} steps were measured")
        assert self.grad_sq is not None and self.trace_cov is not None and self.items_per_step is not None
        if not self.items_per_step > 0:
            raise ValueError(f"items_per_step {self.items_per_step} must be more than 0")
        low = next((name for name in ("grad_sq", "trace_cov") if not getattr(self, name) > 0), None)
        if self.b_simple is None and low is None:
            raise ValueError(f"b_simple is None though grad_sq {self.grad_sq} and trace_cov {self.trace_cov} are "
                             "both above 0")
        if self.b_simple is not None and low is not None:
            raise ValueError(f"b_simple {self.b_simple} is given though {low} {getattr(self, low)} is not above 0")


def describe(estimate: NoiseScaleEstimate, batch: float | None = None, *, unit: str | None = None) -> str:
    """The trade-off of the target batch ``batch`` (in the estimate's items; default: its mean N per step).

    From the paper's model: optimizer steps ``S = S_min (1 + B_noise/B)``, samples
    processed ``E = E_min (1 + B/B_noise)``; ``B = B_noise`` costs 2x of each. Ranges
    come from the estimate's 95% interval; a noisy estimate says so instead of a number.
    """
    est, t = estimate, estimate.steps
    unit = est.unit if unit is None else unit
    if t == 0:
        return f"noise scale: no estimate ({est.reason or 'no step measured'})"
    b = est.items_per_step if batch is None else batch
    if b is None or b <= 0:
        raise ValueError(f"batch is {b}; the target batch must hold at least 1 item")
    rests = f"from {t} optimizer step{'s' * (t != 1)}"
    later = "; the noise scale usually grows as the loss falls: re-measure later in training"
    assert est.trace_cov is not None and est.grad_sq is not None
    if est.trace_cov <= 0:
        return (f"noise scale: not measurable yet ({rests}): the gradient noise tr(Σ) is estimated at "
                f"{est.trace_cov:.3g} <= 0, i.e. the micro-batches' gradients agree as well as the whole batch's. "
                "Either the noise scale is far below the micro-batch size (any larger batch buys almost nothing) "
                "or the micro-batches are not independent samples (repeated data, batch normalisation)")
    if est.grad_sq <= 0:
        above = f" (95%: above ~{_fmt(est.low)} {unit})" if est.low is not None else ""
        return (f"noise scale: the mean gradient |G|² is estimated at {est.grad_sq:.3g} <= 0 ({rests}): it is "
                f"too small to see beside the noise, so the noise scale is probably well above the target "
                f"{round(b)} {unit}{above} and every sample still counts almost fully; measure more steps{later}")
    x = est.b_simple
    assert x is not None
    if est.low is None:
        return (f"noise scale: ~{_fmt(x)} {unit} {rests}, too noisy yet to bound (no 95% interval): "
                f"no word on the target {round(b)} {unit} yet; measure more steps")
    lo, hi = est.low, (est.high if est.high is not None else math.inf)
    if hi == math.inf:
        return (f"noise scale: at least ~{_fmt(lo)} {unit} (95%, {rests}; no upper bound yet, point estimate "
                f"~{_fmt(x)}): the target {round(b)} {unit} costs at least {_fmt(1 + lo / b)}x the fewest optimizer "
                f"steps and at most {_fmt(1 + b / lo)}x the fewest {unit}, so a larger batch would likely still "
                f"pay in steps{later}")
    rough = "; rough: the interval spans more than 4x" if hi > 4 * lo else ""
    return (f"target {round(b)} {unit} is {_fmt(b / x)}x the measured noise scale (~{_fmt(x)} {unit}, 95% "
            f"{_fmt(lo)}–{_fmt(hi)}, {rests}{rough}): about {_fmt(1 + x / b)}x the fewest optimizer steps "
            f"({_fmt(1 + lo / b)}–{_fmt(1 + hi / b)}) for {_fmt(1 + b / x)}x the fewest {unit} "
            f"({_fmt(1 + b / hi)}–{_fmt(1 + b / lo)}); a batch near {_fmt(x)} ({_fmt(lo)}–{_fmt(hi)}) trades them "
            f"evenly (2x each){later}")


def ratio_interval(x: float, y: float, vxx: float, vyy: float, vxy: float,
                   df: float) -> tuple[float | None, float | None]:
    """The 95% interval of ``B = x / y`` (``x`` the mean tr(Σ), ``y`` the mean |G|² of per-step estimates; ``vxx``,
    ``vyy``, ``vxy`` the variances and covariance of those means; ``df`` their degrees of freedom).

    Fieller's interval for ``y / x`` (``tr(Σ)`` is the better determined of the two) with Student's t at ``df``,
    inverted: ``(low, high)``, high ``inf`` when unbounded above, ``(None, None)`` when the data do not bound it.
    """
    if x <= 0:
        return None, None
    q2 = _t975(df) ** 2
    a, b, c = x * x - q2 * vxx, x * y - q2 * vxy, y * y - q2 * vyy
    if a <= 0:
        return None, None  # tr(Σ) itself not distinguishable from 0
    root = math.sqrt(max(b * b - a * c, 0.0))
    rho_lo, rho_hi = (b - root) / a, (b + root) / a
    if rho_hi <= 0:
        return None, None
    return 1.0 / rho_hi, (1.0 / rho_lo if rho_lo > 0 else math.inf)


def _t975(df: float) -> float:
    """Student's t 97.5% quantile for ``df`` degrees of freedom, rounded down to a tabulated df (conservative)."""
    table = ((1, 12.71), (2, 4.30), (3, 3.18), (4, 2.78), (5, 2.57), (6, 2.45), (7, 2.36), (8, 2.31), (9, 2.26),
             (10, 2.23), (12, 2.18), (15, 2.13), (20, 2.09), (30, 2.04), (60, 2.00), (120, 1.98))
    q = table[0][1]
    for d, value in table:
        if df >= d:
            q = value
    return q if df < 1000 else 1.96


def _fmt(x: float | None) -> str:
    """Two significant digits, as much as an estimate holds: 250, 12000, 4.1, 0.26."""
    if x is None or not math.isfinite(x):
        return "∞" if x == math.inf else "?"
    rounded = float(f"{x:.2g}")  # first: 99.6 rounds to 100, which is written out, not as 1e+02
    return f"{rounded:.0f}" if abs(rounded) >= 100 else f"{rounded:.2g}"
