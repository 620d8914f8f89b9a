"""A case of torchrun_cases.py: under DDP, ranks with batches of other sizes than planned."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from autotune.training.accumulate import Accumulator
from autotune.training.verify import flat_grad, relative_error

SHARES = (37, 5)  # rank 0 needs 3 micro-steps of at most 16, rank 1 only 1


def loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def case() -> list:
    """Every rank's micro-steps, samples, total items and gradient error against the whole batch."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(sum(SHARES), 16, generator=g), torch.randint(0, 4, (sum(SHARES),), generator=g)
    start = sum(SHARES[:rank])
    mine = (x[start:start + SHARES[rank]], y[start:start + SHARES[rank]])
    ddp = DistributedDataParallel(model)
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), [16, 16], loss=loss)
    out = acc.backward(mine)
    loss(reference, (x, y)).backward()
    error = relative_error(flat_grad(model), flat_grad(reference))
    report = {"rank": rank, "micro_steps": out.micro_steps, "samples": out.samples, "total_items": out.total_items,
              "error": error}
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports
