"""What would lower the peak most, in one sentence, with the figure the estimate computes.

When activations of a repeated module family (``blocks.*``) hold a large share
of the peak, the fit rule is estimated again at the same micro-batch with
those modules under activation checkpointing
(``torch.utils.checkpoint.checkpoint``, non-reentrant: each module keeps its
inputs and recomputes its forward in the backward), and the sentence gives the
peak it then has. Otherwise it says what holds the peak, and that activation
checkpointing would lower it little. Nothing is guessed: every figure is a
run of the estimate.

At a size that runs out of the GPU's memory the sentence is about the demand
there (what is live and the allocation that fails), not about the replay
that goes on past it without a limit: would checkpointing avoid the error?
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import AutotuneError
from ..results.timeline import PeakPart
from ..units import format_bytes
from ..workload import Workload
from .timeline import Recorded, Walk, activations_by_family, analyse, record

#: Activations of one family below this share of the peak are not worth a re-estimate.
WORTH = 0.10


def top_family(recorded: Recorded, live: dict[int, int], requested: dict[int, int]) -> tuple[str, int] | None:
    """The repeated module family (``blocks.*``) whose activations hold the most of ``live``, outermost on a tie
    (the unit one checkpoints); a top-level module when the model repeats none."""
    found = activations_by_family(recorded.recording, live, requested)
    repeated = {f: b for f, b in found.items() if "*" in f}
    pool = repeated or {f: b for f, b in found.items() if "." not in f}
    if not pool:
        return None
    return max(pool.items(), key=lambda kv: (kv[1], -kv[0].count(".")))


@dataclass(frozen=True)
class Moment:
    """What the sentence is about: the peak of a size that fits, or the demand where a size runs out of memory."""

    where: str
    total: int  # bytes the shares are of
    parts: tuple[PeakPart, ...]
    live: dict[int, int]  # key -> block size

    @classmethod
    def of(cls, walk: Walk, batch: int) -> Moment:
        oom = walk.out_of_memory
        if oom is None:
            return cls(f"at the peak ({walk.peak_phase}, micro-batch {batch})", walk.reserved_peak,
                       tuple(walk.parts), walk.live_at_peak)
        return cls(f"at the out-of-memory error ({oom.phase}, micro-batch {batch})",
                   oom.reserved_bytes + oom.requested_bytes, (*oom.parts, oom.request), walk.live_at_oom)

    def held(self, kind: str) -> int:
        return sum(p.bytes for p in self.parts if p.kind == kind)


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
    """The sentence, and by how many bytes the estimate says the peak would drop (None when not estimated, or
    when the size runs out of memory)."""
    at = Moment.of(walk, batch)
    total, where = at.total, at.where
    if not total:
        return "", None
    top = top_family(recorded, at.live, walk.requested)
    if top is None or top[1] < WORTH * total:
        state = sum(at.held(k) for k in ("parameters", "gradients", "optimizer_state"))
        acts = at.held("activations")
        return (f"{where} parameters, gradients and optimizer state hold {state / total:.0%} "
                f"({format_bytes(state)}) and activations {acts / total:.0%} ({format_bytes(acts)}): activation "
                "checkpointing would lower it little; a smaller model state would (fewer or lower-precision "
                "parameters, an optimizer with less state, or sharding with --parallel fsdp)."), None
    name, held_bytes = top
    of = "the demand" if walk.out_of_memory else "the peak"
    what = (f"activations of {name} hold {held_bytes / total:.0%} of {of} ({format_bytes(held_bytes)}) {where}; "
            "activation checkpointing of these modules")
    try:
        again = analyse(record(checkpointed(workload, name), recorded.device, batch, frames=False,
                               runner=recorded.device, **rule))
    except AutotuneError as exc:  # the workload's own code failed under checkpointing (a WorkloadError): "cannot say"
        return (f"{what} could not be estimated ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:120] if str(exc) else ''})."), None
    how = ("as the estimate computes it with torch.utils.checkpoint (non-reentrant) around each of them, which "
           "recomputes each one's forward in the backward (more compute, not counted here).")
    oom = walk.out_of_memory
    if oom is not None:
        still = again.out_of_memory
        figure = (f"would avoid the error: reserved peak {format_bytes(again.reserved_peak)} of the "
                  f"{format_bytes(oom.capacity_bytes)} capacity" if still is None else
                  f"would still run out of memory ({still.phase}, needing at least {format_bytes(still.needed_bytes)} "
                  f"of the {format_bytes(still.capacity_bytes)} capacity)")
        return f"{what} {figure}, {how}", None
    peak, new = walk.reserved_peak, again.reserved_peak
    saved = peak - new
    figure = (f"would lower it by about {format_bytes(saved)} ({format_bytes(peak)} -> {format_bytes(new)})"
              if saved > 0 else f"would not lower it ({format_bytes(peak)} -> {format_bytes(new)})")
    return f"{what} {figure}, {how}", saved
