"""A case of torchrun_cases.py: the batch ramp under DDP decides the same next batch on every rank.

Every rank trains its share (RampSampler) of a regression whose noise scale is far above the batch, with an
autotune.Accumulator over a DistributedDataParallel model. Scenarios: every rank decides alike; rank 1's own
decision differs from rank 0's (it always wants the target) and follows rank 0's broadcast; the planted fault
(no broadcast) with rank 1 differing, where the ranks go apart. Returns, per scenario, every rank's phases as
(first step, effective batch) and whether rank 1's own decision ever differed from the one it followed.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import autotune
from autotune.planning.planner import make_plan
from autotune.training import ramp as running

STEPS = 40


def train(rank: int) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 1, bias=False))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, 30.0 * torch.randn(4000, generator=g))
    step = autotune.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.001), make_plan(64, 8, world_size=2),
                                loss=lambda m, b: 0.5 * (m(b[0]).squeeze(-1) - b[1]).pow(2).mean(),
                                parts=[autotune.RampConfig(min_steps=3, window=8)])
    for i, batch in enumerate(torch.utils.data.DataLoader(data, batch_sampler=step.ramp.sampler(len(data)))):
        step(batch)
        if i + 1 == STEPS:
            break
    return [(p.first_step, p.effective_batch) for p in step.ramp.phases]


def case() -> dict:
    rank = dist.get_rank()
    out = {}
    decide = running.next_batch
    differed = [False]

    def rank_one_wants_the_target(current, *, target, **kwargs):
        own = target if rank == 1 and current < target else decide(current, target=target, **kwargs)
        differed[0] |= own != decide(current, target=target, **kwargs)
        return own

    for name, patches in {"agree": {}, "rank_1_differs": {"next_batch": rank_one_wants_the_target},
                          "no_broadcast": {"next_batch": rank_one_wants_the_target,
                                           "_from_rank_zero": lambda value, group: value}}.items():
        differed[0] = False
        with mock.patch.multiple(running, **patches) if patches else mock.patch.object(running, "next_batch", decide):
            phases = train(rank)
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {"phases": phases, "differed": differed[0]})
        out[name] = ranks
    return out
