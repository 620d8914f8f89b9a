"""Training under FSDP (``fully_shard``): the model sharded over the ranks, and what the runner checks.

Under torchrun the model is sharded over the real process group (a single
process trains on a fake group of one rank, where FSDP moves no data). Micro-steps
before the last run with gradient synchronisation off
(``set_requires_gradient_sync(False)``), so each optimizer step reduce-scatters
once; :class:`ReduceScatterCounter` counts that through FSDP's own
custom-communication hook. The gradient and the parameters are compared as
full tensors gathered from the shards.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..devices.base import Session
from ..probing.fsdp import fake_mesh, real_mesh, shape_propagation_uncounted, shard, sharded_model
from ..workload import Workload
from . import distributed


@contextlib.contextmanager
def mesh(device: torch.device) -> Iterator[Any]:
    """The mesh a run shards over: the process group's under torchrun, else one rank of a fake group."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if distributed.active():
            yield real_mesh(device.type)
        else:
            with fake_mesh(1, 0, device.type) as single:
                yield single


def wrap(model: nn.Module, workload: Workload, device_mesh: Any, precision: str, offload: bool = False) -> nn.Module:
    """``model`` (already on its device) sharded in place by the workload's units, then the root; ``offload``:
    with FSDP2's CPU offload (the shards and the optimizer step on the host)."""
    return shard(model, workload.shard_units(model), device_mesh, precision, offload)


def place(session: Session, host_model: nn.Module, workload: Workload, device_mesh: Any, precision: str,
          offload: bool = False) -> nn.Module:
    """A copy of ``host_model`` sharded onto the session's device: this rank's shards only, counted (``offload``:
    on the host, FSDP's CPU offload)."""
    return sharded_model(session, lambda: copy.deepcopy(host_model), workload.shard_units, device_mesh, precision,
                         offload)


def measured(session: Session) -> contextlib.AbstractContextManager[None]:
    """What a measured FSDP run needs around it: DTensor's shape propagation is no device memory."""
    return shape_propagation_uncounted(session.tracker)


def is_fsdp(model: nn.Module) -> bool:
    """Is ``model`` sharded by ``fully_shard`` (FSDP2)?"""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync()``: the backward passes in the block keep unsharded gradients, reduce-scatter none."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


class ReduceScatterCounter:
    """Counts each sharded unit's gradient reduce-scatters through FSDP's custom-communication hook.

    A round is one synchronising backward: every unit reduce-scatters once.
    :meth:`take` gives the most reduce-scatters any unit made since the last
    call (1 per optimizer step when micro-steps before the last do not
    synchronise, the number of micro-steps when they all do).
    """

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        from ..probing.fsdpcomm import CallerReleasedReduceScatter

        counts: dict[int, int] = {}
        self.counts = counts

        class Counting(CallerReleasedReduceScatter):
            """The reduce-scatter :func:`~autotune.probing.fsdp.shard` gives every unit, counted."""

            def __init__(self, key: int):
                self.key = key

            def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                         async_op: bool = False) -> Any:
                counts[self.key] = counts.get(self.key, 0) + 1
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(Counting(id(module)))

    def take(self) -> int:
        """Reduce-scatter rounds since the last call: the most any unit made."""
        n = max(self.counts.values(), default=0)
        self.counts.clear()
        return n


def unsharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2's units compute with: the leaves autograd gives each micro-step's gradient to,
    before FSDP reduce-scatters it. FSDP makes them at a unit's first all-gather and keeps them (their
    storage freed while resharded), so each unit is unsharded and resharded once here, one at a time.
    Every rank must call this (it all-gathers)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    found: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            found += [p for p in module.parameters() if p.requires_grad and not isinstance(p, DTensor)]
            module.reshard()
    return list(dict.fromkeys(found))


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered from every rank's shard (a collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_digest(model: nn.Module) -> int:
    """A 63-bit hash of every parameter gathered from the shards, to compare ranks."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(full(p.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1
