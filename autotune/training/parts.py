"""The parts an :class:`autotune.Accumulator` is composed of, and its keywords of the previous release.

    step = autotune.Accumulator(model, optimizer, plan, loss=my_loss, items=count_tokens, max_norm=1.0,
                                parts=[MixedPrecision("bf16"), NoiseScale(every=4), autotune.RampConfig()])

Each part is one concern, each given at most once, each with a default where
it is left out:

- :class:`Batches`: how a batch is counted, split into micro-batches and moved to the device (default: one row
  per sample, sliced, moved to the model's device);
- :class:`~autotune.training.sync.Sync`: how the ranks meet (default: from the model, DDP or FSDP);
- :class:`~autotune.training.precision.MixedPrecision`: autocast, loss scaling, the backward (default: fp32);
- :class:`~autotune.training.noise.NoiseScale` or a ``GradientNoiseScale`` of your own: the noise-scale
  measurement (default: on, every step);
- an :class:`autotune.RampConfig` or a ``BatchRamp``: the batch ramp (default: none).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import BadInput
from ..planning.ramp import RampConfig
from ..workload.batches import Samples, Split
from .noise import GradientNoiseScale, NoiseScale
from .precision import MixedPrecision
from .ramp import BatchRamp
from .sync import Sync


@dataclass(frozen=True, kw_only=True)
class Batches:
    """How a batch is handled: ``samples(batch)`` counts its samples and ``split(batch, sizes)`` splits it into
    micro-batches of ``sizes`` samples, for batches that are not one row per sample (packed sequences, graphs; see
    :class:`autotune.Workload`); by default a batch is its tensors' shared first dimension, sliced. ``move``
    puts a micro-batch on the device (default: ``.to(device)`` of the model's first parameter)."""

    samples: Samples | None = None
    split: Split | None = None
    move: Callable[[Any], Any] | None = None


Part = Batches | Sync | MixedPrecision | NoiseScale | GradientNoiseScale | RampConfig | BatchRamp

#: Each kind of part, by the types that give it.
KINDS: dict[str, tuple[type, ...]] = {
    "batches": (Batches,), "sync": (Sync,), "precision": (MixedPrecision,),
    "noise": (NoiseScale, GradientNoiseScale), "ramp": (RampConfig, BatchRamp),
}


def by_kind(parts: Iterable[Part]) -> dict[str, Any]:
    """``parts`` by their kind (``KINDS``); refuses anything else and a kind given twice."""
    found: dict[str, Any] = {}
    for part in parts:
        kind = next((k for k, types in KINDS.items() if isinstance(part, types)), None)
        if kind is None:
            raise BadInput(f"parts takes Batches, Sync, MixedPrecision, NoiseScale (or a GradientNoiseScale) and a "
                           f"RampConfig (or a BatchRamp), got {type(part).__name__}")
        if kind in found:
            raise BadInput(f"parts holds two {kind} parts ({type(found[kind]).__name__} and "
                           f"{type(part).__name__}): give each kind once")
        found[kind] = part
    return found


#: The previous release's keywords of ``Accumulator``, each with the part that now takes it.
OLD_KEYWORDS = {
    "samples": "Batches(samples=...)", "split": "Batches(split=...)", "move": "Batches(move=...)",
    "precision": "MixedPrecision(...)", "backward": "MixedPrecision(backward=...)",
    "rank": "Sync(rank=...)", "world_size": "Sync(world_size=...)", "process_group": "Sync(process_group=...)",
    "no_sync": "Sync(no_sync=...)", "external_sync": "Sync(external=...)",
    "noise_scale": "NoiseScale(...) or a GradientNoiseScale", "ramp": "the RampConfig or BatchRamp itself",
}


def old_keywords(given: dict[str, Any], *, stacklevel: int = 3) -> list[Part]:
    """The parts the previous release's keywords ``given`` spell, with a DeprecationWarning naming each new
    spelling; a keyword that never existed is a TypeError, as Python's own."""
    if not given:
        return []
    unknown = sorted(set(given) - set(OLD_KEYWORDS))
    if unknown:
        raise TypeError(f"Accumulator() got an unexpected keyword argument {unknown[0]!r}")
    warnings.warn("Accumulator(" + ", ".join(f"{k}=" for k in given) + ") is deprecated and goes in the next "
                  "release: pass parts=[" + ", ".join(OLD_KEYWORDS[k] for k in given) + "]",
                  DeprecationWarning, stacklevel=stacklevel)
    parts: list[Part] = []
    if given.keys() & {"samples", "split", "move"}:
        parts.append(Batches(samples=given.get("samples"), split=given.get("split"), move=given.get("move")))
    if given.keys() & {"precision", "backward"}:
        parts.append(MixedPrecision(given.get("precision", "fp32"), backward=given.get("backward")))
    if given.keys() & {"rank", "world_size", "process_group", "no_sync", "external_sync"}:
        parts.append(Sync(rank=given.get("rank"), world_size=given.get("world_size"),
                          process_group=given.get("process_group"), no_sync=given.get("no_sync"),
                          external=given.get("external_sync", False)))
    noise = given.get("noise_scale", True)
    if noise is not True:
        parts.append(noise if isinstance(noise, GradientNoiseScale) else NoiseScale(measure=bool(noise)))
    ramp = given.get("ramp")
    if ramp is not None:
        if not isinstance(ramp, (RampConfig, BatchRamp)):
            raise BadInput(f"ramp must be an autotune.RampConfig or a BatchRamp, got {type(ramp).__name__}")
        parts.append(ramp)
    return parts
