"""How an accumulation's ranks meet: one part of an :class:`autotune.Accumulator`.

    step = autotune.Accumulator(model, optimizer, plan, loss=my_loss)      # DDP or FSDP: found from the model
    step = autotune.Accumulator(lm, optimizer, plan, loss=my_loss,
                                parts=[Sync(no_sync=strategy.block_backward_sync, external=True)])

A :class:`Sync` knows this rank, the world size and the process group, and
the context in which a micro-step's backward does not synchronise gradients
(DDP's ``no_sync()``; for a model sharded by ``fully_shard``, gradient sync
off via ``set_requires_gradient_sync``). Micro-steps 1..k-1 run in it, the
last one outside, so gradients are synchronised once per optimizer step. It
holds the step's collectives: ``N`` (the items of the whole effective batch)
summed over ranks before the first backward, the most micro-steps any rank
needs, and the global loss. A model whose every micro-step meets the other
ranks' (FSDP gathers parameters in each) runs as many micro-steps as the rank
with the most.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import BadInput
from .distributed import collective_device

NoSync = Callable[[], contextlib.AbstractContextManager[Any]]


class Sync:
    """The ranks' gradient synchronisation for one Accumulator.

    ``rank``, ``world_size``, ``process_group``: default torch.distributed's (one rank when it is not
    initialised). ``no_sync()``: the context without gradient synchronisation (default: the model's own).
    ``external``: the caller synchronises the gradients (its own all-reduce, a framework's backward), so a model
    that is not DDP or FSDP is accepted on several ranks.
    """

    def __init__(self, *, rank: int | None = None, world_size: int | None = None, process_group: Any = None,
                 no_sync: NoSync | None = None, external: bool = False):
        self.rank, self.world_size = _rank_and_world(rank, world_size, process_group)
        self.process_group, self.no_sync, self.external = process_group, no_sync, external
        self.every_micro_step = False  # set by bind: FSDP meets the other ranks in every micro-step

    def bind(self, model: nn.Module) -> Sync:
        """A copy of this Sync for ``model``: its own no_sync unless one was given, and whether every micro-step
        meets the other ranks'. Refuses several ranks whose model does not synchronise gradients."""
        if self.world_size > 1 and not self.external and not synchronises(model):
            raise BadInput(
                f"{self.world_size} ranks are training but the model ({type(model).__name__}) is not wrapped in "
                "DistributedDataParallel or FSDP, so every rank would keep its own gradients and the parameters "
                "would drift apart: wrap it (DistributedDataParallel(model), accelerator.prepare(model)), use "
                "autotune.integrations.lightning.accumulator in a LightningModule, or pass "
                "parts=[Sync(external=True)] if you all-reduce the gradients yourself")
        bound = copy.copy(self)
        bound.no_sync = self.no_sync if self.no_sync is not None else own_no_sync(model)
        bound.every_micro_step = sharded(model)
        return bound

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of a micro-step's backward: without gradient sync unless it is the ``last``."""
        if not last and self.no_sync is not None:
            return self.no_sync()
        return contextlib.nullcontext()

    def total_items(self, local: int) -> int:
        """N: items of the whole effective batch, this rank's ``local`` summed over ranks."""
        return local if self.world_size == 1 else int(self._all_reduce(torch.tensor([local], dtype=torch.int64)))

    def most_steps(self, steps: int) -> int:
        """The most micro-steps any rank needs this step (every rank asks, so the collectives stay paired)."""
        import torch.distributed as dist

        return int(self._all_reduce(torch.tensor([steps], dtype=torch.int64), dist.ReduceOp.MAX))

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """The effective batch's loss from this rank's sum of weighted losses (weights carry W under DDP: each
        rank's sum / W is its share of the global mean)."""
        if self.world_size == 1:
            return float(loss_sum)
        return float(self._all_reduce(loss_sum.double() / self.world_size))

    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        import torch.distributed as dist

        t = t.to(collective_device(self.process_group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=self.process_group)
        return t


def sharded(model: nn.Module) -> bool:
    """Is ``model`` sharded by FSDP (``fully_shard`` or the FSDP1 wrapper)?"""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def synchronises(model: nn.Module) -> bool:
    """Does ``model`` synchronise gradients across ranks itself (DDP, FSDP1, FSDP2)?"""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel) or sharded(model)


def own_no_sync(model: nn.Module) -> NoSync | None:
    """The model's own context without gradient synchronisation, if it has one."""
    own: Any = getattr(model, "no_sync", None)  # DDP, FSDP1
    if own is not None:
        return own
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        from .fsdp import gradient_sync_off

        return lambda: gradient_sync_off(model)
    return None


def _rank_and_world(rank: int | None, world: int | None, group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank(group) if rank is None else rank,
                dist.get_world_size(group) if world is None else world)
    return (0 if rank is None else rank, 1 if world is None else world)
