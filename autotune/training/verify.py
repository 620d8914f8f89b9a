"""Verification: the plan's accumulated step is the full-batch step, and it fits.

Every check returns a :class:`Check` with its verdict, the measured value, the
limit it was held to and a one-line message. Tests plant the faults each check
exists to catch (1/k weighting, per-micro-batch token means, clipping every
micro-step, a sample dropped or counted twice) and see them caught.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..compat import BATCH_NORM, DROPOUT, INSTANCE_NORM, tree_map
from ..results.run import Check
from ..units import format_bytes, plural
from .accumulate import Accumulator

#: Largest relative gradient error that passes, by precision (fp32 against fp64); in bf16 and fp16 at least
#: ``ROUNDING_FACTOR`` x what the precision's rounding alone gives in one pass (:func:`_rounding`).
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
#: A reduced-precision limit is this many times the one-pass rounding error, where that is above the table's.
ROUNDING_FACTOR = 2.0
#: Above this many parameter bytes in float64, the reference runs on the device instead.
FP64_REFERENCE_LIMIT = 2 * 1024**3

RUNNING_STAT_LAYERS = (BATCH_NORM, INSTANCE_NORM)
BN_FIXES = ("replace BatchNorm with GroupNorm or LayerNorm, freeze BatchNorm (eval mode, or requires_grad off "
            "and fixed statistics), or accumulate fewer micro-batches (SyncBatchNorm only joins ranks, "
            "not micro-steps)")


def running_stat_layers(model: nn.Module) -> list[str]:
    """Names (and types) of layers that normalise with per-batch statistics in training."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, RUNNING_STAT_LAYERS) and (
                isinstance(module, BATCH_NORM) or module.track_running_stats):
            found.append(f"{name or '<model>'} ({type(module).__name__})")
    return found


def dropout_off(model: nn.Module) -> list[str]:
    """Put every dropout module in eval mode (identity); returns their names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, DROPOUT):
            module.eval()
            names.append(name)
    return names


def flat_grad(model: nn.Module) -> torch.Tensor:
    """Every trainable parameter's gradient as one float64 vector on the CPU; a sharded (FSDP)
    gradient is gathered from every rank's shard first."""
    from .fsdp import full

    parts = [full(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().cpu().flatten()
             for p in model.parameters() if p.requires_grad]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.norm())
    diff = float((got - want).norm())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


@contextlib.contextmanager
def _without_dropout(model: nn.Module) -> Iterator[None]:
    """Dropout modules in eval mode (identity) for the block; their modes are restored after."""
    modes = {m: m.training for m in model.modules()}
    dropout_off(model)
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def _accumulated(acc: Accumulator, batch: Any) -> torch.Tensor:
    """The gradient ``acc`` accumulates over ``batch`` from empty gradients, as one float64 vector;
    ``acc``'s gradients are empty again after."""
    acc.model.zero_grad(set_to_none=True)
    try:
        acc.backward(batch)
        return flat_grad(acc.model)
    finally:
        acc.model.zero_grad(set_to_none=True)


def _reference_fp64(model: nn.Module, batch: Any, *, loss, max_norm) -> tuple[torch.Tensor, bool]:
    """Gradient of the mean loss over the whole batch in one float64 pass on the CPU."""
    ref = copy.deepcopy(model).cpu().double()
    dropout_off(ref)
    host = tree_map(lambda t: (t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu())
                    if isinstance(t, torch.Tensor) else t, batch)
    deterministic = True
    with torch.no_grad():
        state = torch.random.get_rng_state()
        first = loss(ref, host)
        torch.random.set_rng_state(state)
        second = loss(ref, host)
        deterministic = bool(torch.equal(first, second))
    ref.zero_grad(set_to_none=True)
    loss(ref, host).backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    return flat_grad(ref), deterministic


def _rounding(model: nn.Module, batch: Any, want: torch.Tensor, *, loss, max_norm, precision: str) -> float | None:
    """How far the precision's rounding alone moves the gradient: one pass over the whole batch under the CPU's
    autocast to ``precision`` against the float64 gradient ``want`` (relative error; None in fp32, or where the
    CPU cannot run the model in that precision). No accumulation takes part, so this is the error a correct
    accumulation has too: piecewise-linear models (ReLU) turn rounding into whole flips of activations, an error
    far above the dtype's own (fp16's 1e-2 table limit is below what the built-in mlp gets at initialisation)."""
    if precision == "fp32":
        return None
    ref = copy.deepcopy(model).cpu().float()
    dropout_off(ref)
    host = tree_map(lambda t: (t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu())
                    if isinstance(t, torch.Tensor) else t, batch)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16):
            value = loss(ref, host)
        value.backward()
    except RuntimeError:  # an op the CPU's autocast does not run in this precision: the table's limit stands
        return None
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    got = flat_grad(ref)
    return relative_error(got, want) if bool(torch.isfinite(got).all()) else None


def _limit(precision: str, rounding: float | None) -> tuple[float, str]:
    """The relative error a correct accumulation in ``precision`` stays within, and its words: the table's, or
    :data:`ROUNDING_FACTOR` x the one-pass ``rounding`` where that is larger."""
    limit = TOLERANCE[precision]
    if rounding is None or ROUNDING_FACTOR * rounding <= limit:
        return limit, f"limit {limit:.0e}, {precision}"
    limit = ROUNDING_FACTOR * rounding
    return limit, (f"limit {limit:.1e}: {ROUNDING_FACTOR:g} x the {rounding:.2e} of one {precision} pass over the "
                   "whole batch, no accumulation, on the CPU")


def gradient_check(acc: Accumulator, model: nn.Module, batch: Any, *, reference_batch: Any = None) -> Check:
    """Does ``acc`` accumulate the full-batch gradient? Its gradient over one effective batch against a
    one-pass reference over the same samples.

    ``acc`` is the accumulation under test, over a copy of ``model`` (on its
    device; across ranks wrapped in DDP or FSDP); it is never stepped, and its
    gradients are cleared before and after. ``model`` is the initial model the
    reference is computed from; it is not changed. Across ranks ``batch`` is
    this rank's share and ``reference_batch`` the union of all ranks' shares:
    the synchronised gradient must equal the single-process full-batch gradient.
    Dropout is off for the check only. The loss, clipping and precision are
    ``acc``'s own.
    """
    reference_batch = batch if reference_batch is None else reference_batch
    sizes, precision, max_norm = list(acc.sizes), acc.precision, acc.max_norm
    param_bytes = sum(p.numel() for p in model.parameters()) * 8
    with _without_dropout(acc.model):
        got = _accumulated(acc, batch)
        rounding = None
        if param_bytes <= FP64_REFERENCE_LIMIT:
            want, deterministic = _reference_fp64(model, reference_batch, loss=acc.loss_fn, max_norm=max_norm)
            how = "one float64 pass on the CPU over the same samples"
            rounding = _rounding(model, reference_batch, want, loss=acc.loss_fn, max_norm=max_norm,
                                 precision=precision)
        else:
            # Too big for float64 on the host: the same samples, partitioned differently, on the device.
            want = _accumulated(acc.repartitioned(_other_partition(sizes)), batch)
            deterministic, how = True, "the same samples in a different partition on the device"
    limit, bound = _limit(precision, rounding)
    details: dict[str, Any] = {"reference": how, "micro_steps": len(sizes), "sizes": list(sizes)}
    if rounding is not None:
        details["rounding"] = rounding
    bad = _not_finite(got, want)
    if bad:
        details["not_finite"] = bad
        return Check(name="gradient_equivalence", passed=False, value=None, limit=limit, details=details,
                     message=f"the {bad} is not finite (nan or inf) on the first effective batch, so no gradient "
                             "can be compared: check the loss for a log of 0, a division by zero or an overflow")
    error = relative_error(got, want)
    dropouts = [n for n, m in model.named_modules() if isinstance(m, DROPOUT)]
    if dropouts:
        details["dropout"] = f"dropout disabled for this check only ({plural(len(dropouts), 'layer')})"
    passed = error <= limit
    message = f"accumulated vs full-batch gradient: relative error {error:.2e} ({bound})"
    bn = running_stat_layers(model)
    if bn and len(sizes) > 1:
        details["running_statistics"] = bn
        message += (f"; {plural(len(bn), 'layer')} normalise each micro-batch with its own statistics "
                    f"({', '.join(bn[:4])}{', ...' if len(bn) > 4 else ''}), so accumulation cannot equal "
                    f"the full batch: {BN_FIXES}")
    if not deterministic:
        details["nondeterministic"] = True
        message += "; the model's training-mode forward is not deterministic (dropout outside nn.Dropout modules?)"
    if not passed and not bn and deterministic:
        message += (f"; more than {precision} rounding explains: " if rounding is not None else "; ") + \
            "the micro-steps do not add up to the full-batch gradient"
    return Check(name="gradient_equivalence", passed=passed, value=error, limit=limit, message=message,
                 details=details)


def _not_finite(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Which gradient is not finite: the accumulated one, the reference, or both (None: both are)."""
    got_ok, want_ok = bool(torch.isfinite(got).all()), bool(torch.isfinite(want).all())
    if got_ok and want_ok:
        return None
    return ("accumulated gradient" if want_ok else "reference gradient" if got_ok
            else "loss or gradient (accumulated and reference alike)")


def _other_partition(sizes: Sequence[int]) -> list[int]:
    total, largest = sum(sizes), max(sizes)
    first = max(1, largest // 2)
    out = [min(first, total)]
    while sum(out) < total:
        out.append(min(largest, total - sum(out)))
    return out


def rounds_check(rounds: Sequence[int], *, collective: str = "all-reduce",
                 every_micro_step: Sequence[int] | None = None) -> Check:
    """The gradients were synchronised once per optimizer step, not once per micro-step: DDP's
    all-reduce, or FSDP's reduce-scatter (``collective="reduce-scatter"``); or, with ``every_micro_step``
    giving each step's micro-steps (FSDP syncing every micro-step), once per micro-step."""
    expected = list(every_micro_step) if every_micro_step is not None else [1] * len(rounds)
    bad = next((i for i, (r, k) in enumerate(zip(rounds, expected)) if r != k), None)
    ok = bool(rounds) and len(rounds) == len(expected) and bad is None
    worst = max(rounds) if rounds else 0
    if every_micro_step is None:
        fix = "no_sync()" if collective == "all-reduce" else "no_sync() (FSDP2: set_requires_gradient_sync(False))"
        text = (f"1 gradient {collective} round per optimizer step over {plural(len(rounds), 'step')}" if ok else
                f"{worst} gradient {collective} rounds in an optimizer step, expected 1: micro-steps before the last "
                f"must run inside {fix}")
    else:
        at = bad if bad is not None else 0
        text = (f"1 gradient {collective} round per micro-step over {plural(len(rounds), 'step')}" if ok else
                f"{rounds[at] if rounds else 0} gradient {collective} rounds in optimizer step {at + 1}, expected "
                f"{expected[at] if expected else 1} (one a micro-step): with gradients synchronised every "
                "micro-step, no micro-step may run with gradient sync off")
    name = {"all-reduce": "allreduce_rounds", "reduce-scatter": "reduce_scatter_rounds"}[collective]
    return Check(name=name, passed=ok, value=worst, limit=max(expected, default=1), message=text,
                 details={"rounds_per_step": list(rounds)})


def sync_check(agree: Sequence[bool]) -> Check:
    """Every rank holds the same parameters after every step."""
    bad = [i + 1 for i, ok in enumerate(agree) if not ok]
    text = (f"parameters identical on every rank after each of {plural(len(agree), 'step')}" if not bad else
            f"parameters differ between ranks after step {bad[0]} ({len(bad)} of {len(agree)} steps)")
    return Check(name="parameters_in_sync", passed=not bad, value=len(agree) - len(bad), limit=len(agree),
                 message=text)


def memory_check(peak: int, usable: int, predicted: int | None) -> Check:
    ratio = peak / predicted if predicted else None
    text = f"peak {format_bytes(peak)} of {format_bytes(usable)} usable"
    if ratio is not None:
        text += f"; measured/predicted {ratio:.3f} (predicted {format_bytes(predicted)})"
    return Check(name="memory", passed=peak <= usable, value=peak, limit=usable,
                 message=text if peak <= usable else f"over budget: {text}",
                 details={"predicted_bytes": predicted, "ratio": ratio})


def count_check(consumed: Sequence[tuple[int, int]], expected_samples: int | Sequence[int],
                expected_items: Sequence[int]) -> Check:
    """Every step fed exactly the plan's samples (``expected_samples``: per step, when a ramp changes them), and
    exactly the items its effective batch holds."""
    samples = [expected_samples] * len(consumed) if isinstance(expected_samples, int) else list(expected_samples)
    bad = [(i, s, n, want, wanted) for i, ((s, n), want, wanted) in enumerate(zip(consumed, expected_items, samples))
           if s != wanted or n != want]
    steps = len(consumed)
    if not bad:
        text = (f"all {plural(steps, 'step')} consumed exactly {plural(samples[0] if samples else 0, 'sample')} "
                "and their items" if len(set(samples)) <= 1 else
                f"each of the {plural(steps, 'step')} consumed exactly the samples of its phase and their items")
        return Check(name="count", passed=True, value=steps, limit=steps, message=text)
    i, s, n, want, wanted = bad[0]
    return Check(name="count", passed=False, value=steps - len(bad), limit=steps,
                 message=f"step {i + 1} consumed {s} samples / {n} items, expected {wanted} samples / "
                         f"{want} items: a sample was dropped or counted twice ({len(bad)} of {steps} steps wrong)")

