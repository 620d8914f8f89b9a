"""FSDP's collectives with every buffer freed in program order, by the thread that runs the step.

FSDP frees a communication buffer by dropping its last reference to it (a
unit's all-gather output right after its copy-out in backward, the
reduce-scatter buffers later in the step). On a GPU the memory follows that
order: NCCL keeps no tensor of a collective on its own threads (its watchdog's
copy of the work holds none), so the buffer is free when FSDP lets go of it.
gloo does not: the work its worker thread ran holds the tensors it was given
until that thread drops it, and a tensor's last reference dropped there waits
for the GIL and a free CPU. On a loaded machine a buffer FSDP has freed can
thus stay alive past the step's peak, for as long as thread scheduling makes
it: on FSDP's own buffers, a CPU measurement one unit's unsharded parameters
too high, on one rank, in one run in a few.

So the collectives FSDP calls on gloo run on copies of its buffers, made and
freed outside every dispatch mode (the tracker counts none of them: they are
the transport's, no device memory a GPU would hold), and the result is copied
into FSDP's own buffer; gloo's threads then hold only the copies. On every other
backend (NCCL, the fake process group of an estimate) the collective runs on
FSDP's buffers, as FSDP's own default does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..compat import disable_current_modes, fsdp_default_all_gather, fsdp_default_reduce_scatter, group_backend

DefaultAllGather: Any = fsdp_default_all_gather()
DefaultReduceScatter: Any = fsdp_default_reduce_scatter()


def transport_keeps_tensors(group: Any, device: torch.device) -> bool:
    """Does ``group``'s backend for ``device`` keep a finished collective's tensors on its own threads (gloo)?"""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    return gloo is not None and isinstance(group_backend(group, device), gloo)


def _on_copies(collective: Callable[[torch.Tensor, torch.Tensor], object], output: torch.Tensor,
               input_tensor: torch.Tensor) -> None:
    """``collective(output, input)`` run to completion on uncounted copies; its result lands in ``output``."""
    with disable_current_modes(), torch.no_grad():
        out = torch.empty_like(output)
        collective(out, input_tensor.clone())
        output.copy_(out)


class CallerReleasedAllGather(DefaultAllGather):
    """FSDP's all-gather; on gloo, on copies (synchronous: the result is in ``output_tensor`` on return)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        if not transport_keeps_tensors(group, output_tensor.device):
            return super().__call__(output_tensor, input_tensor, group, async_op)
        _on_copies(lambda out, inp: super(CallerReleasedAllGather, self).__call__(out, inp, group, False),
                   output_tensor, input_tensor)
        return None


class CallerReleasedReduceScatter(DefaultReduceScatter):
    """FSDP's reduce-scatter; on gloo, on copies (synchronous)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if not transport_keeps_tensors(group, output_tensor.device):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        _on_copies(lambda out, inp: super(CallerReleasedReduceScatter, self).__call__(out, inp, group, op, False),
                   output_tensor, input_tensor)
        return None


def release_on_caller(model: nn.Module) -> None:
    """Every sharded module of ``model`` communicates through the collectives above."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(CallerReleasedAllGather())
            module.set_custom_reduce_scatter(CallerReleasedReduceScatter())
