"""What would lower the peak most, in one sentence, with the figure the estimate computes.

When activations of a repeated module family (``blocks.*``) hold a large share
of the peak, the fit rule is estimated again at the same micro-batch with
those modules under activation checkpointing
(``torch.utils.checkpoint.checkpoint``, non-reentrant: each module keeps its
inputs and recomputes its forward in the backward), and the sentence gives the
peak it then has. Otherwise it says what holds the peak, and that activation
checkpointing would lower it little. Where checkpointing would not lower it,
or would lower it little, the sentence names the largest part of the peak that
a change lowers, with that change's figure: activations with a smaller
micro-batch (an estimate at half the size), the cuBLAS workspaces with
``CUBLAS_WORKSPACE_CONFIG`` (the trace replayed with smaller ones), the
allocator's cache with the allocator setting that reserves least (the
comparison's replay), the model state with a smaller one (no figure: that
is a different model). Nothing is guessed: every figure is a run of the
estimate or a replay of its trace.

At a size that runs out of the GPU's memory the sentence is about the demand
there (what is live and the allocation that fails), not about the replay
that goes on past it without a limit: would checkpointing avoid the error?
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..devices.replay import replay
from ..errors import AutotuneError
from ..results.request import FitRule
from ..results.timeline import PeakPart, share
from ..units import format_bytes
from ..workload import Workload
from .timeline import Recorded, Walk, activations_by_family, analyse, record

#: Activations of one family below this share of the peak are not worth a re-estimate.
WORTH = 0.10
#: The smaller cuBLAS workspace the sentence names: 2 x 4096 KiB per handle and stream.
SMALL_CUBLAS = ":4096:2"
SMALL_CUBLAS_BYTES = 2 * 4096 * 1024
#: What each part of the peak is called in the sentence, and which kinds it holds.
GROUPS = (("parameters, gradients and optimizer state", ("parameters", "gradients", "optimizer_state")),
          ("activations", ("activations",)), ("cuBLAS workspaces and kernel scratch", ("workspace",)),
          ("the allocator's cached free blocks and rounding", ("cache", "rounding")))


@dataclass(frozen=True)
class Levers:
    """Figures from the probe the sentence may cite: its max micro-batch and the peak there, and the allocator
    setting (``VARIABLE=conf``) that reserves least at this micro-batch, with that figure."""

    fits: tuple[int, int] | None = None
    allocator: tuple[str, int] | None = None


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

    def held(self, *kinds: str) -> int:
        return sum(p.bytes for p in self.parts if p.kind in kinds)


def checkpointed(workload: Workload, pattern: str, every: int = 1, *, preserve_rng_state: bool = False) -> Workload:
    """``workload`` whose modules of the family ``pattern`` run under activation checkpointing (every
    ``every``-th of them in the order the model names them, from the first); the estimate's runs need not
    preserve the random state (``preserve_rng_state``: a real run's recompute draws the same dropout)."""
    make = workload.model

    def model() -> torch.nn.Module:
        return checkpoint_blocks(make(), pattern, every=every, preserve_rng_state=preserve_rng_state)

    return replace(workload, model=model)


def checkpoint_blocks(model: torch.nn.Module, pattern: str, *, every: int = 1,
                      preserve_rng_state: bool = True) -> torch.nn.Module:
    """``model`` (changed in place, and returned) with its modules named by ``pattern`` (``blocks.*``, ``*`` for any
    one name) under activation checkpointing: every ``every``-th of them in the order the model names them, from
    the first; each keeps its inputs and recomputes its forward in the backward (non-reentrant). A copy of the
    model (``copy.deepcopy``) checkpoints the same modules of its own. A Hugging Face model's ``use_cache`` is
    turned off, as transformers does under gradient checkpointing."""
    found = [m for name, m in model.named_modules() if name and _matches(name, pattern)]
    config = getattr(model, "config", None)
    if found and config is not None and getattr(config, "use_cache", None):  # a KV cache would grow in the recompute
        config.use_cache = False  # as transformers sets it under gradient checkpointing
    for module in found[::every]:
        module.forward = types.MethodType(functools.partial(_checkpointed, preserve_rng_state), module)
    return model


def _matches(name: str, pattern: str) -> bool:
    parts, want = name.split("."), pattern.removeprefix("layers ").split(".")
    return len(parts) == len(want) and all(w in ("*", p) for p, w in zip(parts, want))


def _checkpointed(preserve_rng_state: bool, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s own forward under ``torch.utils.checkpoint`` (a bound method: a deep copy rebinds it)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(type(module).forward, module, *args, use_reentrant=False,
                      preserve_rng_state=preserve_rng_state, **kwargs)


def lowering(recorded: Recorded, walk: Walk, workload: Workload, batch: int, *, rule: FitRule,
             levers: Levers | None = None) -> tuple[str, int | None]:
    """The sentence, and by how many bytes the estimate says the peak would drop (None when not estimated, or
    when the size runs out of memory)."""
    at = Moment.of(walk, batch)
    total, where = at.total, at.where
    if not total:
        return "", None
    top = top_family(recorded, at.live, walk.requested)
    instead = _Instead(recorded, walk, at, workload, batch, rule, levers or Levers())
    if top is None or top[1] < WORTH * total:
        state, acts = at.held("parameters", "gradients", "optimizer_state"), at.held("activations")
        little = "would lower it little" if acts < WORTH * total else \
            "has no module family holding a large share of them to wrap"
        return (f"{where} parameters, gradients and optimizer state hold {share(state, total)} "
                f"({format_bytes(state)}) and activations {share(acts, total)} ({format_bytes(acts)}): activation "
                f"checkpointing {little}{instead.clause()}."), None
    name, held_bytes = top
    of = f"the {format_bytes(total)} demand" if walk.out_of_memory else "the peak"
    request = walk.out_of_memory.request if walk.out_of_memory else None
    inside = request is not None and request.kind == "activations" and \
        (request.name == name or request.name.startswith(f"{name}."))
    asked = f", the request's {format_bytes(request.bytes)} included" if inside and request is not None else ""
    what = (f"activations of {name} and the modules in it hold {share(held_bytes, total)} of {of} "
            f"({format_bytes(held_bytes)}{asked}) {where}; "
            "activation checkpointing of these modules")
    try:
        again = analyse(record(checkpointed(workload, name), recorded.device, batch, frames=False,
                               runner=recorded.device, rule=rule))
    except AutotuneError as exc:  # the workload's own code failed under checkpointing (a WorkloadError): "cannot say"
        return (f"{what} could not be estimated ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:120] if str(exc) else ''})."), None
    how = ("as the estimate computes it with torch.utils.checkpoint (non-reentrant) around each of them, which "
           "recomputes each one's forward in the backward (more compute, not counted here)")
    oom = walk.out_of_memory
    if oom is not None:
        still = again.out_of_memory
        if still is None:
            return (f"{what} would avoid the error: reserved peak {format_bytes(again.reserved_peak)} of the "
                    f"{format_bytes(oom.capacity_bytes)} capacity, {how}."), None
        return (f"{what} would still run out of memory (in {still.phase}, the live blocks and the request "
                f"coming to {still.shortfall()}), {how}{instead.clause()}."), None
    peak, new = walk.reserved_peak, again.reserved_peak
    saved = peak - new
    if saved > 0:
        return (f"{what} would lower it by about {format_bytes(saved)} ({format_bytes(peak)} -> "
                f"{format_bytes(new)}), {how}."), saved
    return (f"{what} would not lower it ({format_bytes(peak)} -> {format_bytes(new)}), {how}"
            f"{instead.clause()}."), saved


class _Instead:
    """What would lower it where activation checkpointing would not: the largest part of the moment that a
    change lowers, with that change's figure (see the module's docstring)."""

    def __init__(self, recorded: Recorded, walk: Walk, at: Moment, workload: Workload, batch: int,
                 rule: FitRule, levers: Levers):
        self.recorded, self.walk, self.at, self.workload = recorded, walk, at, workload
        self.batch, self.rule, self.levers = batch, rule, levers
        self.peak = "reserved peak" if recorded.simulation is not None else "peak"

    def clause(self) -> str:
        """``; what would lower it: the largest part, X (bytes, share), shrinks with ...``, or ``""``."""
        at, first = self.at, True
        changes = {"activations": self.smaller_batch, "workspace": self.smaller_cublas, "cache": self.allocator}
        for label, kinds in sorted(GROUPS, key=lambda g: -self.at.held(*g[1])):
            held = at.held(*kinds)
            if not held:
                break
            change = "a smaller model state (fewer or lower-precision parameters, an optimizer with less state, " \
                "or sharding with --parallel fsdp)" if kinds[0] == "parameters" else changes[kinds[0]]()
            if change:
                which = "the largest part" if first else "the largest part a change lowers"
                return (f"; what would lower it: {which}, {label} ({format_bytes(held)}, {share(held, at.total)}), "
                        f"shrinks with {change}")
            first = False
        return ""

    def smaller_batch(self) -> str:
        """A smaller micro-batch: past the capacity, the probe's max; else half this one, estimated."""
        fits = self.levers.fits
        past = self.walk.out_of_memory is not None or \
            (self.recorded.simulation is None and self.walk.reserved_peak > self.recorded.device.capacity_bytes())
        if past and fits is not None and fits[0] < self.batch:
            return (f"a smaller micro-batch (micro-batch {fits[0]}, the probe's max: {self.peak} "
                    f"{format_bytes(fits[1])}; more accumulation steps keep the effective batch)")
        if self.batch < 2 or past:
            return ""
        half = self.batch // 2
        smaller = analyse(record(self.workload, self.recorded.device, half, frames=False,
                                 runner=self.recorded.device, rule=self.rule))
        if smaller.out_of_memory is not None or smaller.reserved_peak >= self.walk.reserved_peak:
            return ""
        return (f"a smaller micro-batch (micro-batch {half}: {self.peak} {format_bytes(smaller.reserved_peak)} by "
                "the estimate; more accumulation steps keep the effective batch)")

    def smaller_cublas(self) -> str:
        """``CUBLAS_WORKSPACE_CONFIG=:4096:2``: the trace replayed with cuBLAS workspaces of that size."""
        sim, rec = self.recorded.simulation, self.recorded.recording
        if sim is None:
            return ""

        def cublas(key: int, nbytes: int) -> bool:
            made = rec.made.get(key)
            return nbytes > SMALL_CUBLAS_BYTES and made is not None and made.label == "cuBLAS workspace"

        trace = [(k, SMALL_CUBLAS_BYTES if cublas(k, n) else n, st) for k, n, st in rec.trace]
        if trace == rec.trace:
            return ""
        r = replay(trace, capacity=sim.capacity, conf=sim.conf, device_total=sim.device_total)
        if not r.out_of_memory and r.reserved_peak >= self.walk.reserved_peak:
            return ""  # the workspaces shrink inside segments the allocator keeps anyway: the peak stays
        figure = "it would still run out of memory" if r.out_of_memory else \
            f"{self.peak} {format_bytes(r.reserved_peak)}"
        return (f"CUBLAS_WORKSPACE_CONFIG={SMALL_CUBLAS} ({SMALL_CUBLAS_BYTES >> 20} MiB per cuBLAS handle and "
                f"stream): {figure} in the simulation")

    def allocator(self) -> str:
        """The allocator setting that reserves least at this micro-batch, where it reserves less than yours."""
        found = self.levers.allocator
        if found is None:
            return ""
        setting, reserved = found
        return f"{setting}: {self.peak} {format_bytes(reserved)} in the simulation"
