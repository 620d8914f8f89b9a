"""A Workload from objects a user already has: a model instance, one real batch, an optimizer.

    workload = autotune.Workload.from_model(model, batch)              # HF: loss = model(**batch).loss
    plan = autotune.plan(1024, probe=workload, device="cuda")

The factories never hand out the user's objects: every model is a copy (on
``meta``, with no memory, when an estimate builds it), every optimizer a new
one of the same class, param groups and hyperparameters, and micro-batches of
any size are built from the batch's samples, cycling through them.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..compat import tree_map
from ..errors import BadInput, ProbeFileError
from .batches import batch_size

Optimizer = torch.optim.Optimizer


def factories_from_model(model: nn.Module, batch: Any, *, loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                         optimizer: Optimizer | Callable[..., Optimizer] | None = None,
                         items: Callable[[Any], int] | None = None, name: str | None = None) -> dict[str, Any]:
    """The fields of the Workload of ``model`` trained on batches like ``batch`` (see :meth:`Workload.from_model`):
    its name and factories; no ``optimizer`` when none is given (the Workload's default then)."""
    if not isinstance(model, nn.Module):
        raise BadInput(f"model must be a torch.nn.Module instance, got {type(model).__name__}")
    try:
        rows = batch_size(batch)
    except ValueError as exc:
        raise BadInput(f"batch must be a tensor, or a tuple, list or dict of tensors sharing their first "
                       f"(batch) dimension: {exc}") from None
    if optimizer is not None and not isinstance(optimizer, Optimizer) and not callable(optimizer):
        raise BadInput(f"optimizer must be a torch.optim.Optimizer or a factory of one, got {type(optimizer).__name__}")
    label = name or type(model).__name__
    host = tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, batch)
    fields: dict[str, Any] = dict(
        name=label,
        model=lambda: copy_model(model),
        batch=lambda n, generator: _cycle(host, rows, n),
        loss=loss if loss is not None else _loss_from_output(label),
        items=items,
    )
    if isinstance(optimizer, Optimizer):
        fields["optimizer"] = reproduce_optimizer(model, optimizer)
    elif optimizer is not None:
        fields["optimizer"] = optimizer
    return fields


def copy_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the host, or on ``meta`` (no memory) inside ``with torch.device("meta")``;
    tied parameters stay tied, the user's model is not touched."""
    meta = torch.get_default_device().type == "meta"
    memo: dict[int, Any] = {}
    for p in itertools.chain(model.parameters(), model.buffers()):
        if id(p) in memo:
            continue
        data = torch.empty_like(p, device="meta") if meta else p.detach().to("cpu", copy=True)
        memo[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad) if isinstance(p, nn.Parameter) else data
    for name in ("_trainer", "_fabric"):  # a LightningModule's trainer is not part of the model
        value = getattr(model, name, None)
        if value is not None:
            memo[id(value)] = None
    copied = copy.deepcopy(model, memo)
    copied.zero_grad(set_to_none=True)
    return copied


def _cycle(batch: Any, rows: int, n: int) -> Any:
    """``n`` samples from ``batch``, cycling through its ``rows`` in order."""
    index = torch.arange(n) % rows
    return tree_map(lambda t: t.index_select(0, index) if isinstance(t, torch.Tensor) and t.dim() and
                    t.shape[0] == rows else t, batch)


def _loss_from_output(name: str) -> Callable[[nn.Module, Any], torch.Tensor]:
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            out = model(**batch)
        elif isinstance(batch, (tuple, list)):
            out = model(*batch)
        else:
            out = model(batch)
        value = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if not isinstance(value, torch.Tensor):
            raise ProbeFileError(
                f"workload {name!r}: the model's output has no loss (it returned {type(out).__name__}); pass "
                "loss=lambda model, batch: ... (Hugging Face models return one when the batch holds labels)")
        return value

    return loss


def reproduce_optimizer(model: nn.Module, optimizer: Optimizer) -> Callable[[Iterable[nn.Parameter]], Optimizer]:
    """A factory of optimizers like ``optimizer`` (class, param groups, hyperparameters) for copies of
    ``model``: a copy's parameters, in ``model.parameters()`` order, take the places of the originals."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in position]
        if missing:
            raise BadInput(f"optimizer holds {len(missing)} parameter(s) that are not the model's: give the "
                           "optimizer of this model, or a factory, e.g. optimizer=lambda params: AdamW(params)")
        groups.append(({k: v for k, v in group.items() if k != "params"}, [position[id(p)] for p in group["params"]]))
    cls = type(optimizer)
    accepted: Mapping[str, Any]
    try:  # what the constructor takes; every group carries its own settings anyway
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}

    def factory(params: Iterable[nn.Parameter]) -> Optimizer:
        params = list(params)
        try:
            return cls([{**settings, "params": [params[i] for i in places]} for settings, places in groups],
                       **defaults)
        except TypeError as exc:
            raise BadInput(f"cannot build another {cls.__name__} like the one given ({exc}): pass a factory, "
                           f"e.g. optimizer=lambda params: {cls.__name__}(params, ...)") from None

    return factory
