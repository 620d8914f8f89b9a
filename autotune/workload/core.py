"""What autotune plans for: a Workload, a training step given as factories.

The factories build fresh objects on the host every time; autotune moves them
to the device. Probe files provide one (:mod:`autotune.workload.loading`), and
so does a model you already have (:meth:`Workload.from_model`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..compat import tree_flatten
from ..errors import ProbeFileError, WorkloadError, user_code
from .batches import FIX, Samples, Split, count_samples, take
from .from_model import factories_from_model


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``torch.optim.AdamW(params, lr=1e-3)``."""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A training step to plan for, as factories.

    ``model()`` builds a fresh model on the CPU. ``batch(size, generator)`` makes
    a micro-batch of ``size`` items as a pytree of CPU tensors at the worst-case
    shape. ``loss(model, batch)`` is the scalar **mean** over the batch's items.
    ``items(batch)`` counts the items that mean is over (e.g. real target tokens);
    by default the batch size. ``options`` names knobs ``--tune`` may try, e.g.
    ``{"checkpointing": [False, True]}``; a chosen value is passed as a keyword
    to every factory that takes it. ``shard(model)`` names the submodules FSDP
    shards as units of their own, in order (the root is always the last unit);
    by default every block of the model's largest ``nn.ModuleList``.

    A micro-batch is whatever ``batch(n, generator)`` makes of ``n`` samples;
    by default its tensors share a first dimension of ``n``. A batch that is not
    ``n`` rows (padding-free packing: one row of concatenated samples; a graph
    batch: nodes, edges and graphs; nested tensors) says how many samples it
    holds with ``samples(batch)`` and how it splits into consecutive
    micro-batches with ``split(batch, sizes)`` (one micro-batch per size, in
    order); ``items`` then defaults to ``samples``.

    A plan in tokens (``target_tokens``) runs where the workload can build samples of given lengths:
    ``lengths_batch(lengths, generator)`` makes one sample of each length in ``lengths`` (tokens), in order,
    and ``tokens(batch)`` counts a batch's tokens (by default its ``items``).
    """

    name: str
    model: Callable[..., nn.Module]
    batch: Callable[..., Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer] = default_optimizer
    items: Callable[[Any], int] | None = None
    options: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    chosen: Mapping[str, Any] = field(default_factory=dict)
    shard: Callable[[nn.Module], Iterable[nn.Module]] | None = None
    samples: Samples | None = None
    split: Split | None = None
    lengths_batch: Callable[[Sequence[int], torch.Generator], Any] | None = None
    tokens: Callable[[Any], int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("Workload.name must be a non-empty string")
        for attr in ("model", "batch", "loss", "optimizer"):
            if not callable(getattr(self, attr)):
                raise ValueError(f"Workload.{attr} must be callable, got {type(getattr(self, attr)).__name__}")
        for attr in ("items", "shard", "samples", "split", "lengths_batch", "tokens"):
            if getattr(self, attr) is not None and not callable(getattr(self, attr)):
                raise ValueError(f"Workload.{attr} must be callable or None")
        for key, values in self.options.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise ValueError(f"Workload.options[{key!r}] must be a non-empty list of values")

    @classmethod
    def from_model(cls, model: nn.Module, batch: Any, *, loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                   optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
                   items: Callable[[Any], int] | None = None, name: str | None = None) -> Workload:
        """The workload of a model you already have, trained on batches like ``batch``.

        ``batch``: one real batch (a tensor, or a tuple, list or dict of tensors,
        batch dimension first); micro-batches of any size are built from its
        samples. ``loss(model, batch)`` defaults to ``model(**batch).loss`` (a
        Hugging Face model given labels). ``optimizer``: a factory of one
        (``lambda params: AdamW(params)``) or an optimizer instance, whose class,
        param groups and hyperparameters are reproduced for every copy (default
        AdamW, lr 1e-3). Your model, optimizer and random state are never touched:
        every trial builds its own copy.
        """
        return cls(**factories_from_model(model, batch, loss=loss, optimizer=optimizer, items=items, name=name))

    def make_model(self) -> nn.Module:
        """``model()``, checked: a WorkloadError when it raises, a ProbeFileError when it is no Module."""
        with user_code(self._failed("model()")):
            model = self.model()
        if not isinstance(model, nn.Module):
            raise ProbeFileError(f"workload {self.name!r}: model() returned {type(model).__name__}, not a "
                                 "torch.nn.Module: return the model, e.g. model=lambda: MyModel()")
        return model

    def make_batch(self, size: int, generator: torch.Generator) -> Any:
        """``batch(size, generator)``, checked: it holds ``size`` samples (``samples(batch)``, else every
        tensor's first dimension)."""
        batch = self.batch(size, generator)
        try:
            got = count_samples(batch, self.samples)
        except ValueError as exc:
            raise ProbeFileError(f"workload {self.name!r}: batch({size}, generator) returned no usable batch: "
                                 f"{exc}") from None
        if got != size:
            counted = "samples(batch)" if self.samples is not None else "the first dimension of every tensor"
            raise ProbeFileError(
                f"workload {self.name!r}: batch({size}, generator) returned {got} samples, not {size}: "
                f"batch(n, generator) must build exactly n samples ({counted}; {FIX})")
        return batch

    def count_items(self, batch: Any) -> int:
        """Items the loss averages over in ``batch``: ``items(batch)``, else its samples."""
        if self.items is not None:
            return int(self.items(batch))
        if self.samples is not None:
            return int(self.samples(batch))
        for leaf in tree_flatten(batch)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                return int(leaf.shape[0])
        raise ValueError(f"workload {self.name!r}: cannot tell the batch size of a batch with no tensor")

    def count_tokens(self, batch: Any) -> int:
        """Tokens in ``batch``: ``tokens(batch)``, else its items."""
        return int(self.tokens(batch)) if self.tokens is not None else self.count_items(batch)

    def share(self, batch: Any, start: int, size: int) -> Any:
        """The ``size`` samples of ``batch`` from sample ``start`` on (a rank's share), split as the workload
        says."""
        try:
            return take(batch, start, size, samples=self.samples, split=self.split)
        except ValueError as exc:
            raise ProbeFileError(f"workload {self.name!r}: cannot take samples {start}..{start + size} of a batch: "
                                 f"{exc}") from None

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules of ``model`` FSDP shards as units of their own (the root comes after them):
        ``shard(model)``, checked, else every block of the largest ``nn.ModuleList``."""
        if self.shard is None:
            return largest_module_list(model)
        with user_code(self._failed("shard(model)")):
            units = list(self.shard(model))
        inside = {id(m) for m in model.modules()}
        for unit in units:
            if not isinstance(unit, nn.Module) or id(unit) not in inside or unit is model:
                raise ProbeFileError(f"workload {self.name!r}: shard(model) must return submodules of the model "
                                     f"(the root is sharded last on its own), got {type(unit).__name__}")
        return units

    def _failed(self, call: str) -> Callable[[Exception], WorkloadError]:
        """What an error ``call`` (one of the factories) raised becomes: a WorkloadError naming the workload."""
        return lambda exc: WorkloadError(f"workload {self.name!r}: {call} failed: {type(exc).__name__}: {exc}",
                                         workload=self.name)

    def choices(self) -> list[dict[str, Any]]:
        """Every combination of ``options`` (one empty dict when there are none)."""
        keys = list(self.options)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(self.options[k] for k in keys))]

    def configure(self, **choice: Any) -> Workload:
        """This workload with option values bound into the factories that take them."""
        unknown = set(choice) - set(self.options)
        if unknown:
            raise ValueError(f"workload {self.name!r} has no option(s) {sorted(unknown)}; "
                             f"it offers {sorted(self.options)}")
        bound: dict[str, Any] = {attr: _bind(getattr(self, attr), choice)
                                 for attr in ("model", "batch", "loss", "optimizer")}
        return replace(self, **bound, chosen={**self.chosen, **choice})


def largest_module_list(model: nn.Module) -> list[nn.Module]:
    """Every block of the ``nn.ModuleList`` holding the most parameters (a transformer's layers);
    none when the model has no ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def _bind(fn: Callable, choice: Mapping[str, Any]) -> Callable:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in choice.items() if takes_all or k in params}
    return functools.partial(fn, **kwargs) if kwargs else fn
