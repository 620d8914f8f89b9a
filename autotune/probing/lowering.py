"""What would lower the peak most, in one sentence, with the figure the estimate computes.

When activations of a repeated module family (``blocks.*``) hold a large share
of the peak, the fit rule is estimated again at the same micro-batch with
those modules under activation checkpointing
(``torch.utils.checkpoint.checkpoint``, non-reentrant: each module keeps its
inputs and recomputes its forward in the backward), and the sentence gives the
peak it then has. Otherwise it says what holds the peak, and that activation
checkpointing would lower it little. Nothing is guessed: every figure is a
run of the estimate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import AutotuneError
from ..units import format_bytes
from ..workload import Workload
from .timeline import Recorded, Walk, activations_by_family, analyse, record

#: Activations of one family below this share of the peak are not worth a re-estimate.
WORTH = 0.10


def top_family(recorded: Recorded, walk: Walk) -> tuple[str, int] | None:
    """The repeated module family (``blocks.*``) whose activations hold the most at the peak, outermost on a
    tie (the unit one checkpoints); a top-level module when the model repeats none."""
    found = activations_by_family(recorded.recording, walk.live_at_peak, walk.requested)
    repeated = {f: b for f, b in found.items() if "*" in f}
    pool = repeated or {f: b for f, b in found.items() if "." not in f}
    if not pool:
        return None
    return max(pool.items(), key=lambda kv: (kv[1], -kv[0].count(".")))


def checkpointed(workload: Workload, pattern: str) -> Workload:
    """``workload`` whose modules of the family ``pattern`` run under activation checkpointing."""
    make = workload.model

    def model() -> torch.nn.Module:
        built = make()
        for name, module in built.named_modules():
            if name and _matches(name, pattern):
                module.forward = _checkpoint(module.forward)
        return built

    return replace(workload, model=model)


def _matches(name: str, pattern: str) -> bool:
    parts, want = name.split("."), pattern.removeprefix("layers ").split(".")
    return len(parts) == len(want) and all(w in ("*", p) for p, w in zip(parts, want))


def _checkpoint(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run


def lowering(recorded: Recorded, walk: Walk, workload: Workload, batch: int, *,
             rule: dict[str, Any]) -> tuple[str, int | None]:
    """The sentence, and by how many bytes the estimate says the peak would drop (None when not estimated)."""
    peak = walk.reserved_peak
    where = f"at the peak ({walk.peak_phase}, micro-batch {batch})"
    top = top_family(recorded, walk)
    if not peak:
        return "", None
    held = {k: sum(p.bytes for p in walk.parts if p.kind == k) for k in
            ("parameters", "gradients", "optimizer_state", "activations", "workspace")}
    state = held["parameters"] + held["gradients"] + held["optimizer_state"]
    if top is None or top[1] < WORTH * peak:
        acts = held["activations"]
        return (f"{where} parameters, gradients and optimizer state hold {state / peak:.0%} "
                f"({format_bytes(state)}) and activations {acts / peak:.0%} ({format_bytes(acts)}): activation "
                "checkpointing would lower it little; a smaller model state would (fewer or lower-precision "
                "parameters, an optimizer with less state, or sharding with --parallel fsdp)."), None
    name, held_bytes = top
    try:
        again = record(checkpointed(workload, name), recorded.device, batch, frames=False, runner=recorded.device,
                       **rule)
    except AutotuneError as exc:  # the workload's own code failed under checkpointing (a WorkloadError): "cannot say"
        return (f"activations of {name} hold {held_bytes / peak:.0%} of the peak ({format_bytes(held_bytes)}) "
                f"{where}; activation checkpointing of these modules could not be estimated "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})."), None
    new = analyse(again).reserved_peak
    saved = peak - new
    figure = (f"would lower it by about {format_bytes(saved)} ({format_bytes(peak)} -> {format_bytes(new)})"
              if saved > 0 else f"would not lower it ({format_bytes(peak)} -> {format_bytes(new)})")
    return (f"activations of {name} hold {held_bytes / peak:.0%} of the peak ({format_bytes(held_bytes)}) "
            f"{where}; activation checkpointing of these modules {figure}, as the estimate computes it with "
            "torch.utils.checkpoint (non-reentrant) around each of them, which recomputes each one's forward in "
            "the backward (more compute, not counted here)."), saved
