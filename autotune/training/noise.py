"""The gradient noise scale, measured from the micro-steps of gradient accumulation.

The noise scale ``B_simple = tr(Σ) / |G|²`` (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training") predicts the critical batch size:
well below it, a larger batch buys almost proportionally fewer optimizer
steps; well above it, extra samples buy almost nothing. ``G`` is the mean
gradient over the data, ``Σ`` the covariance of one item's gradient.

Accumulation computes the small-batch gradients anyway: micro-step ``i`` adds
``w_i · s · g_i`` to ``.grad``, with ``g_i`` the mean-loss gradient of its
``n_i`` items, ``w_i`` its loss weight (``n_i / N``, times the world size
under DDP) and ``s`` the GradScaler's scale. A hook on each parameter sees that
contribution as it arrives, before it is added to ``.grad``, so
``|g_i|² = Σ_p |hook grad_p|² / (w_i s)²`` costs one norm per parameter and no
copy. After the last micro-step (after unscaling, before clipping) ``.grad``
holds ``G_N``, the gradient of all ``N`` items; ``|G_N|²`` is one more norm.

``Tensor.register_hook`` on a parameter (a leaf) runs before the gradient is
accumulated into ``.grad`` and receives this backward's whole gradient for it
(a tied parameter's uses summed); ``register_post_accumulate_grad_hook`` runs
after, on the running sum, so it cannot give a micro-step's own gradient. DDP's
reducer hooks run after accumulation too: the hook sees the rank's local,
unreduced gradient, also in the micro-step that synchronises.

    noise = GradientNoiseScale(model.parameters())
    noise.begin_step(total_items=N)
    for micro, n, w in micro_steps:           # every micro-step with items, on every rank
        with noise.micro_step(items=n, weight=w):
            scaler.scale(loss(micro) * w).backward()
    scaler.unscale_(optimizer)
    noise.end_step(scale=scale)               # before clipping
    noise.b_simple, noise.interval, noise.steps, noise.history

Sizes are items (what the loss averages over: samples, or tokens), never
samples when the loss counts tokens; tokens of one sequence are not independent,
so with tokens ``tr(Σ)`` is an effective per-token variance and ``B_simple`` is in
tokens. Under DDP the micro-step norms are local
(``n_i`` items of this rank's micro-batch), ``G_N`` is the synchronised
gradient over all ranks' ``N`` items, and one all-reduce of two numbers per
step pools the ``k · W`` micro-batches of all ranks, so the estimate equals a
single process's over the same micro-batches. Under FSDP the hooks sit on the
unsharded parameters the units compute with (``totals``: the sharded ones,
whose gradient shards after the last micro-step add up to ``|G_N|²`` over the
ranks). Parameters must receive their gradient in one piece per backward
(reentrant checkpointing of a parameter used in two segments breaks that; such
steps are dropped).

What a run reports (:class:`NoiseScaleEstimate`) and the word to the user
(:func:`autotune.results.noise.describe`) live with the results.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import foreach_norm
from ..results.noise import NoiseScaleEstimate, NoiseStep, ratio_interval
from ..workload.bookkeeping import PENDING_LIMIT, PENDING_VALUES, noise_buffer
from .distributed import collective_device

BETA = 0.99  # EMA decay: the estimate leans on about the last 100 steps


def two_batch_estimate(micro_items: Sequence[int], micro_sq: Sequence[float],
                       total_sq: float) -> tuple[float, float] | None:
    """Unbiased ``(|G|², tr(Σ))`` from one step's micro-batch and full-batch gradient norms.

    ``micro_items``: n_i of the k micro-batches (all ranks), ``N = Σ n_i``;
    ``micro_sq``: ``|g_i|²`` of each micro-batch's mean-loss gradient; ``total_sq``:
    ``|G_N|²`` of the accumulated one. Returns None for ``k < 2``: one micro-batch
    is the full batch, there is no second batch size to compare.

    Model: ``g_i = G + e_i`` with ``e_i`` independent, mean 0, covariance ``Σ/n_i``;
    ``G_N = Σ (n_i/N) g_i``; ``E|g_b|² = |G|² + tr(Σ)/b``. Observations: ``a_i = |g_i|²``
    and ``B = |G_N|²``. In ``z_i = a_i − B`` (mean ``tr(Σ)(1/n_i − 1/N)``) the parts
    linear in ``e`` cancel from ``Σ n_i z_i`` exactly. For Gaussian noise
    ``Var(a_i) = q/n_i² + l/n_i`` and ``Cov(a_i, B) = Var(B) = q/N² + l/N``
    (``q = 2tr(Σ²)``, ``l = 4GᵀΣG``), so ``B`` is uncorrelated with every ``z_i`` and
    ``Cov(z) = q(diag(1/n²) − 11ᵀ/N²) + l(diag(1/n) − 11ᵀ/N)``. Generalised least
    squares (the fit of ``E|g_b|² = |G|² + tr(Σ)/b`` over the k micro-batches and the
    full batch, weighted by the inverse covariance of the observations, the full
    batch's correlation with each micro-batch included) weighs ``z`` by ``C⁻¹d ∝ n``:
    exactly so for the ``q`` part, and ``n`` is the null direction of the ``l`` part,
    so in every regime

        tr(Σ) = (Σ n_i a_i − N B) / (k − 1) = Σ n_i |g_i − G_N|² / (k − 1)
        |G|²  = B − tr(Σ) / N

    both unbiased for any sizes (the expectations are linear in the unknowns).
    Equal sizes ``b``: ``tr(Σ) = (ā − B)/(1/b − 1/N)``, ``|G|² = (N B − b ā)/(N − b)``,
    McCandlish et al.'s Appendix A.
    """
    if len(micro_items) != len(micro_sq):
        raise ValueError(f"{len(micro_items)} micro-batch sizes for {len(micro_sq)} norms")
    if any(n < 1 for n in micro_items):
        raise ValueError(f"micro-batch sizes {list(micro_items)}: each needs at least 1 item")
    weighted = sum(n * a for n, a in zip(micro_items, micro_sq))
    return _estimate(weighted, len(micro_items), sum(micro_items), total_sq)


def _estimate(weighted_sq_sum: float, micro_batches: int, total_items: int,
              total_sq: float) -> tuple[float, float] | None:
    """``two_batch_estimate`` from its sufficient statistics: ``Σ n_i |g_i|²``, k, N, ``|G_N|²``."""
    if micro_batches < 2:
        return None
    trace = (weighted_sq_sum - total_items * total_sq) / (micro_batches - 1)
    return total_sq - trace / total_items, trace


class SmoothedNoiseScale:
    """EMAs (Adam-style bias correction) of the per-step ``tr(Σ)`` and ``|G|²``, their ratio and its interval.

    Numerator and denominator are smoothed separately; ``B_simple`` is their ratio
    (consistent, not unbiased: a ratio of unbiased means). The corrected EMA after
    T steps is the weighted mean with weights ``w_t = (1−β)β^(T−t)/(1−β^T)``, so its
    variance is ``σ² Σw²``, with ``σ²`` estimated by ``Σw(x − x̄)²/(1 − Σw²)`` from the
    spread of the per-step estimates (EMAs of squares and products keep this O(1)).
    The 95% interval is Fieller's for ``|G|²/tr(Σ)`` (``tr(Σ)`` is the better
    determined of the two) with Student's t at ``1/Σw² − 1`` degrees of freedom,
    inverted: it is bounded only when the data bound it. Steps count as independent
    draws; a drift of the noise scale over the window widens the interval.
    """

    def __init__(self, beta: float = BETA):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta is {beta}; it must be in [0, 1)")
        self.beta = beta
        self.steps = 0
        self._ema = [0.0] * 5  # x, y, xx, yy, xy (x = tr Σ, y = |G|²), not bias-corrected
        self._items = 0

    def add(self, grad_sq: float, trace_cov: float, items: int) -> None:
        b = self.beta
        for j, v in enumerate((trace_cov, grad_sq, trace_cov * trace_cov, grad_sq * grad_sq, trace_cov * grad_sq)):
            self._ema[j] = b * self._ema[j] + (1 - b) * v
        self.steps += 1
        self._items += items

    @property
    def trace_cov(self) -> float | None:
        return self._mean(0)

    @property
    def grad_sq(self) -> float | None:
        return self._mean(1)

    @property
    def b_simple(self) -> float | None:
        x, y = self._mean(0), self._mean(1)
        if x is None or y is None or x <= 0 or y <= 0:
            return None
        return x / y

    @property
    def items_per_step(self) -> float | None:
        return self._items / self.steps if self.steps else None

    def interval(self) -> tuple[float | None, float | None]:
        """``(low, high)``; ``(None, None)``: not bounded by the data (or < 2 steps); high ``inf``: no upper bound."""
        t = self.steps
        if t < 2:
            return None, None
        c = 1 - self.beta ** t
        sw2 = (1 - self.beta) * (1 + self.beta ** t) / ((1 + self.beta) * c)  # Σ w_t² of the normalised weights
        x, y, xx, yy, xy = (e / c for e in self._ema)
        v = sw2 / (1 - sw2)
        return ratio_interval(x, y, v * max(xx - x * x, 0.0), v * max(yy - y * y, 0.0), v * (xy - x * y),
                              1.0 / sw2 - 1.0)

    def _mean(self, j: int) -> float | None:
        return self._ema[j] / (1 - self.beta ** self.steps) if self.steps else None


@dataclass(frozen=True, slots=True)
class _Pending:
    """One measured step whose values (Σ n_i |scaled g_i|² and k over all ranks, a negative k dropping the
    step; |G_N|²; the scale) wait in the buffer's pending rows until ``_flush`` reads them back."""

    step: int
    total: int


class _MicroStep:
    """``with noise.micro_step(n, w):`` hooks take norms only inside."""

    __slots__ = ("items", "measure", "noise", "weight")

    def __init__(self, noise: GradientNoiseScale, items: int, weight: float, measure: bool):
        self.noise, self.items, self.weight, self.measure = noise, items, weight, measure

    def __enter__(self) -> None:
        if self.measure:
            self.noise._start_micro()

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if not self.measure:
            return
        self.noise._active = False
        if kind is not None:
            self.noise._broken = "backward failed"
            return
        self.noise._take_micro(self.items, self.weight)


class GradientNoiseScale:
    """Measures ``|G|²``, ``tr(Σ)`` and ``B_simple`` per optimizer step, from accumulation's micro-steps.

    ``parameters``: the model's (tied ones once). Registers one gradient hook
    per parameter; ``close()`` removes them. ``beta``: EMA decay of the per-step
    estimates. ``every``: measure every ``every``-th optimizer step only (the
    others cost one no-op hook call per parameter and micro-step).
    ``world_size``/``process_group``: under DDP and FSDP, ranks pool their micro-batch
    norms with one all-reduce per measured step (every rank calls every method).
    ``totals``: the parameters whose ``.grad`` holds the synchronised gradient when
    it is not ``parameters`` (FSDP's sharded ones: each rank holds a shard, and the
    shards' squares are summed over the ranks); default ``parameters``.
    Values on the device are read back lazily (when a property is read, or every
    ``PENDING_LIMIT`` steps), so a step adds no host synchronisation. What the
    measurement keeps on the device is one buffer made here
    (:func:`autotune.workload.bookkeeping.noise_buffer`): its memory does not grow
    with micro-steps or steps, and the probe's fit rule holds the same buffer.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], *, beta: float = BETA, every: int = 1,
                 world_size: int = 1, process_group: Any = None,
                 totals: Iterable[torch.nn.Parameter] | None = None):
        if every < 1:
            raise ValueError(f"every is {every}; measure every step (1) or every n-th (n > 1)")
        self.smoothed = SmoothedNoiseScale(beta)
        self.params = [p for p in dict.fromkeys(parameters) if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients: no noise scale to measure")
        self.every, self.world_size, self.process_group = every, world_size, process_group
        self._totals = None if totals is None else [p for p in dict.fromkeys(totals) if p.requires_grad]
        self._device = self.params[0].device
        self._active = False
        buffer = noise_buffer(len(self.params), self._device)
        count = len(self.params)
        self._slots = buffer[:count]                 # this micro-step's contribution norm, per parameter
        self._weighted = buffer[count]               # Σ n_i / w_i² · |scaled g_i|² over the step's micro-steps
        self._rows = buffer[count + 1:].view(PENDING_LIMIT, PENDING_VALUES)  # measured steps not read back
        self._arrived: set[int] = set()              # parameters whose gradient this micro-step has seen
        self._handles = [p.register_hook(self._hook(j, p)) for j, p in enumerate(self.params)]
        self._micro = 0
        self._items: int | None = None
        self._measuring = False
        self._broken: str | None = None
        self._pending: list[_Pending] = []
        self._step = 0
        self.skipped = 0
        self.reasons: dict[str, int] = {}
        self._history: list[NoiseStep] = []

    # -- the calls accumulation makes --------------------------------------------------

    def begin_step(self, total_items: int) -> None:
        """Before the first micro-step: ``total_items`` is N, items over all micro-steps and ranks."""
        if total_items < 1:
            raise ValueError(f"total_items is {total_items}; an effective batch holds at least 1 item")
        self._weighted.zero_()
        self._micro, self._items, self._broken = 0, total_items, None
        self._measuring = self._step % self.every == 0

    def drop_step(self, reason: str) -> None:
        """Measure nothing of the step begun (``reason`` is counted, as for a step whose backward could not be
        read): e.g. a framework's accumulation that turned out not to hold the items ``begin_step`` was told."""
        if self._items is None:
            raise RuntimeError("drop_step() outside a step: call begin_step(total_items) first")
        self._broken = reason

    def micro_step(self, items: int, weight: float) -> _MicroStep:
        """Context manager around one micro-step's ``backward()``: ``items`` n_i (this rank), ``weight`` w_i of
        its mean loss. A micro-step of 0 items (or weight 0) contributes nothing and is not measured."""
        if self._items is None:
            raise RuntimeError("micro_step() outside a step: call begin_step(total_items) first")
        return _MicroStep(self, items, weight, self._measuring and items > 0 and weight > 0)

    def end_step(self, scale: float | torch.Tensor = 1.0, grad_norm: float | torch.Tensor | None = None) -> None:
        """After the last micro-step, after unscaling, before clipping.

        ``scale``: the GradScaler's scale during this step's backwards (1 without one;
        a tensor is copied, GradScaler updates its own in place). ``grad_norm``: the
        norm of the unscaled, unclipped accumulated gradient when already known (what
        ``clip_grad_norm_`` returns); else computed from ``.grad``.
        """
        if self._items is None:
            raise RuntimeError("end_step() without begin_step(total_items)")
        total, micro, broken, step = self._items, self._micro, self._broken, self._step
        self._items = None
        self._step += 1
        if not self._measuring:
            return
        if grad_norm is not None and hasattr(grad_norm, "full_tensor"):  # clipping FSDP's shards: a DTensor
            grad_norm = grad_norm.full_tensor()
        total_sq = self._total_sq() if grad_norm is None else grad_norm ** 2
        row = self._rows[len(self._pending)]  # written in place: the device copies, no host sync
        if self.world_size > 1:  # pool Σ n_i |g_i|² and k over ranks; -1 anywhere drops the step everywhere
            counted = torch.tensor(-1e30 if broken else micro, dtype=torch.float64, device=self._device)
            row[:2].copy_(self._all_reduce(torch.stack([self._weighted, counted])))
        else:
            row[0].copy_(self._weighted)
            row[1].fill_(micro if broken is None else -1)
        for column, value in ((2, total_sq), (3, scale)):  # the scale as it was: GradScaler updates it in place
            row[column].copy_(value) if isinstance(value, torch.Tensor) else row[column].fill_(float(value))
        self._pending.append(_Pending(step, total))
        if broken is not None:
            self.reasons[broken] = self.reasons.get(broken, 0) + 1
        if len(self._pending) >= PENDING_LIMIT:
            self._flush()

    def close(self) -> None:
        """Remove the hooks (the measurements stay readable)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __del__(self) -> None:
        if hasattr(self, "_handles"):  # not when __init__ raised before the hooks were registered
            self.close()

    # -- what it measured --------------------------------------------------------------

    @property
    def history(self) -> list[NoiseStep]:
        """Every counted step's raw estimates and the smoothed value after it, oldest first (a copy)."""
        self._flush()
        return list(self._history)

    def since(self, start: int) -> list[NoiseStep]:
        """The counted steps from the ``start``-th on (``history[start:]`` without copying the rest)."""
        self._flush()
        return self._history[start:]

    @property
    def steps(self) -> int:
        """Optimizer steps the estimate rests on."""
        self._flush()
        return self.smoothed.steps

    @property
    def grad_sq(self) -> float | None:
        """Smoothed |G|² (EMA of unbiased per-step estimates, bias-corrected); None before any step."""
        self._flush()
        return self.smoothed.grad_sq

    @property
    def trace_cov(self) -> float | None:
        """Smoothed tr(Σ), the gradient covariance of one item; None before any step."""
        self._flush()
        return self.smoothed.trace_cov

    @property
    def b_simple(self) -> float | None:
        """tr(Σ) / |G|² in items: None before any step, or while either estimate is <= 0."""
        self._flush()
        return self.smoothed.b_simple

    @property
    def interval(self) -> tuple[float | None, float | None]:
        """95% interval of ``b_simple``: see ``SmoothedNoiseScale``."""
        self._flush()
        return self.smoothed.interval()

    def estimate(self, unit: str = "samples") -> NoiseScaleEstimate:
        """What a run reports: the smoothed estimate, its interval, the steps it rests on and their history;
        ``unit`` names what the sizes count (samples, or the tokens a loss averages over)."""
        self._flush()
        s = self.smoothed
        low, high = s.interval()
        return NoiseScaleEstimate(b_simple=s.b_simple, low=low, high=None if high == math.inf else high,
                                  grad_sq=s.grad_sq, trace_cov=s.trace_cov, steps=s.steps, skipped=self.skipped,
                                  items_per_step=s.items_per_step,
                                  reason=None if s.steps else self._no_estimate_reason(), unit=unit,
                                  history=tuple(self._history))

    # -- inside --------------------------------------------------------------------------

    def _hook(self, j: int, p: torch.Tensor):
        """One torch call per gradient, its norm written into the parameter's slot (nothing allocated): inside
        a backward each distinct call pays for cold code paths. The hook holds this object weakly: once nothing
        else does, it is collected and its hooks leave the parameters."""
        slot, arrived = self._slots[j], self._arrived  # cleared in place, never rebound
        kwargs = {"dtype": torch.float32} if p.dtype in (torch.float16, torch.bfloat16) else {}
        direct = p.device == self._device and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
        vector_norm = torch.linalg.vector_norm
        measurer = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            noise = measurer()
            if noise is None or not noise._active:
                return
            if j in arrived:
                noise._broken = "a parameter's gradient arrived in several parts in one backward"
            arrived.add(j)
            if grad.is_sparse:  # e.g. nn.Embedding(sparse=True)
                grad = grad.coalesce()._values()
            if direct:
                vector_norm(grad, out=slot, **kwargs)
            else:  # float64, or on another device than the slots
                slot.copy_(vector_norm(grad, **kwargs))

        return hook

    def _start_micro(self) -> None:
        """Before a measured micro-step's backward: empty slots (a parameter without a gradient adds 0)."""
        self._slots.zero_()
        self._arrived.clear()
        self._active = True

    def _take_micro(self, items: int, weight: float) -> None:
        """Close a measured micro-step: add its norms' squares, weighted by ``n_i / w_i²``, to the step's sum."""
        self._weighted.add_(torch.dot(self._slots, self._slots), alpha=items / weight ** 2)
        self._micro += 1

    def _all_reduce(self, stats: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = stats.to(collective_device(self.process_group))
        dist.all_reduce(t, group=self.process_group)
        return t

    def _total_sq(self) -> torch.Tensor | float:
        """|G_N|²: from the gradients of ``parameters``, or from this rank's shards of ``totals``' gradients
        summed over the ranks."""
        params = self.params if self._totals is None else self._totals
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if not grads:
            return 0.0
        if all(g.device == self._device for g in grads):
            norms = torch.stack(foreach_norm(grads)).float()
        else:
            norms = torch.stack([torch.linalg.vector_norm(g).float().to(self._device) for g in grads])
        total = torch.dot(norms, norms)
        if self._totals is not None and self.world_size > 1:
            total = self._all_reduce(total.double().reshape(1))[0]
        return total

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        rows = self._rows[:len(pending)].tolist()  # one host sync for every pending step
        for p, (weighted, micro, total_sq, scale) in zip(pending, rows):
            if micro < 0:
                self.skipped += 1  # its reason was counted at end_step
                continue
            est = _estimate(weighted / scale ** 2, round(micro), p.total, total_sq)
            if est is None or not all(math.isfinite(v) for v in est):
                self.skipped += 1
                key = "one micro-batch per step" if est is None else "non-finite gradients"
                self.reasons[key] = self.reasons.get(key, 0) + 1
                continue
            self.smoothed.add(*est, p.total)
            low, high = self.smoothed.interval()
            self._history.append(NoiseStep(step=p.step, items=p.total, micro_batches=round(micro), grad_sq=est[0],
                                           trace_cov=est[1], b_simple=self.smoothed.b_simple, low=low,
                                           high=None if high == math.inf else high))

    def _no_estimate_reason(self) -> str:
        if not self._step:
            return "no optimizer step measured yet"
        most = max(self.reasons, key=lambda k: self.reasons[k]) if self.reasons else "no step counted"
        if most == "one micro-batch per step":
            return ("each step ran one micro-batch in all (no accumulation, one rank): there is no smaller batch "
                    "to compare with; the noise scale needs at least 2 micro-batches per step")
        return f"{self._step} step(s), none usable: {most}"


def _local(grad: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a gradient: a sparse one's values, a DTensor's local shard, else itself."""
    if grad.is_sparse:
        return grad.coalesce()._values()
    return grad.to_local() if hasattr(grad, "to_local") else grad


@dataclass(frozen=True, kw_only=True)
class NoiseScale:
    """The noise-scale measurement of an Accumulator, as one of its parts (on by default).

    ``measure``: False measures nothing (no hooks). ``every``, ``beta``: see :class:`GradientNoiseScale`.
    ``model``'s parameters are measured where their gradients arrive (under FSDP2 the unsharded ones; FSDP1's
    flat parameters hide each parameter's gradient, so nothing is measured there), pooled over the ranks of
    ``process_group``.
    """

    measure: bool = True
    every: int = 1
    beta: float = BETA

    def build(self, model: torch.nn.Module, *, world_size: int = 1,
              process_group: Any = None) -> GradientNoiseScale | None:
        """The measurement for ``model``, or None (off, no trainable parameters, FSDP1)."""
        if not self.measure or not any(p.requires_grad for p in model.parameters()):
            return None
        from .sync import sharded

        if not sharded(model):
            return GradientNoiseScale(model.parameters(), beta=self.beta, every=self.every, world_size=world_size,
                                      process_group=process_group)
        if not hasattr(model, "unshard"):  # FSDP1
            return None
        from .fsdp import unsharded_parameters

        return GradientNoiseScale(unsharded_parameters(model), beta=self.beta, every=self.every,
                                  world_size=world_size, process_group=process_group, totals=model.parameters())
