"""A case of torchrun_cases.py: the noise scale under DDP and FSDP against one process on the same
samples.

Every rank builds the same model and the same global batches; rank r trains on its share. Rank 0 also runs
one process over the whole batch with all ranks' micro-batches in a row. Returns the per-step
(|G|², tr(Σ)) of: the single process, every DDP rank, DDP ranks that do not pool their micro-batch norms, and
every FSDP rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from autotune.training.accumulate import Accumulator
from autotune.training.noise import GradientNoiseScale

from .accumulators import NoisyAccumulator

CASES = {"accumulating": [[20, 17], [19, 8]], "one_micro_step_per_rank": [[32], [32]]}
STEPS = 4


class Unpooled(GradientNoiseScale):
    """Fault: each rank estimates from its own micro-batches only (no all-reduce of their norms)."""

    def __init__(self, parameters, **kwargs):
        super().__init__(parameters, beta=kwargs.get("beta", 0.99))


class UnpooledAccumulator(NoisyAccumulator):
    noise_cls = Unpooled


def loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def steps_of(acc_cls, model, sizes, batches, share, **kwargs):
    acc = acc_cls(model, torch.optim.SGD(model.parameters(), lr=0.5), sizes, loss=loss, **kwargs)
    for x, y in batches:
        acc.step((x[share], y[share]))
    return [[h.grad_sq, h.trace_cov] for h in acc.noise_scale.history]


def case() -> dict:
    """Each schedule's per-step estimates: one process, every DDP rank, unpooled DDP ranks, every FSDP rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, schedule in CASES.items():
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        n = sum(map(sum, schedule))
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(STEPS):
            x = torch.randn(n, 16, generator=g)
            batches.append((x, (x[:, :4] + torch.randn(n, 4, generator=g)).argmax(1)))
        start = sum(map(sum, schedule[:rank]))
        share = slice(start, start + sum(schedule[rank]))
        ddp = steps_of(NoisyAccumulator, DistributedDataParallel(copy.deepcopy(base)), schedule[rank], batches, share)
        unpooled = steps_of(UnpooledAccumulator, DistributedDataParallel(copy.deepcopy(base)), schedule[rank],
                            batches, share)
        ranks: list = [None] * world
        dist.all_gather_object(ranks, ddp)
        sharded = copy.deepcopy(base)
        mesh = init_device_mesh("cpu", (world,))
        for layer in sharded[::2]:
            fully_shard(layer, mesh=mesh)
        fsdp = steps_of(Accumulator, fully_shard(sharded, mesh=mesh), schedule[rank], batches, share)
        fsdp_ranks: list = [None] * world
        dist.all_gather_object(fsdp_ranks, fsdp)
        single = steps_of(NoisyAccumulator, copy.deepcopy(base), [m for r in schedule for m in r], batches,
                          slice(0, n), rank=0, world_size=1) if rank == 0 else None
        out[name] = {"single": single, "ranks": ranks, "unpooled": unpooled, "fsdp": fsdp_ranks}
    return out
