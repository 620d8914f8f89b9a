"""A batch sampler that feeds a plan: each rank its share of every effective batch, all ranks in step.

    sampler = autotune.PlanSampler(len(dataset), plan)          # rank and world: the process group's, as it runs
    loader = DataLoader(dataset, batch_sampler=sampler)
    for batch in loader:                                          # plan.per_rank_batch[rank] samples
        step(batch)                                               # an autotune.Accumulator

Every optimizer step takes the next ``target_batch`` indices of one
permutation of the dataset (a new one each epoch, the same on every rank);
rank ``r`` gets its ``per_rank_batch[r]`` of them, so shares may differ by a
sample (1021 over 2 ranks: 510 and 511) and every rank yields the same number
of batches. The last, smaller effective batch is split over the ranks in the
plan's proportions, so every sample is used once per epoch (``drop_last``
drops it instead; it is dropped as well when it holds fewer samples than
there are ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import options
from ..errors import BadInput


class PlanSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's index list for every optimizer step of a plan (see the module docstring)."""

    def __init__(self, dataset_size: int, plan: Any, *, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        self.size = options.whole(dataset_size, "dataset_size")
        self.shares = tuple(int(n) for n in plan.per_rank_batch)
        if rank is not None and not 0 <= rank < len(self.shares):
            raise BadInput(f"rank {rank} is outside the plan's {len(self.shares)} ranks")
        self._rank = rank
        _ = self.rank  # a process group already running is checked now
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    @property
    def rank(self) -> int:
        """The rank given, else the process group's as the loader iterates: a sampler made before the group
        starts (a loader passed to Lightning's ``fit``, which starts it) gives each rank its own share."""
        if self._rank is not None:
            return self._rank
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0
        if dist.get_world_size() != len(self.shares):
            raise BadInput(f"the plan is for {len(self.shares)} rank(s) but {dist.get_world_size()} are running")
        return dist.get_rank()

    def set_epoch(self, epoch: int) -> None:
        """A new permutation each epoch (as DistributedSampler), the same on every rank."""
        self.epoch = epoch

    def __len__(self) -> int:
        target = sum(self.shares)
        full, rest = divmod(self.size, target)
        return full + (not self.drop_last and rest >= len(self.shares))

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        indices = order.tolist()
        target, rank = sum(self.shares), self.rank
        for step in range(len(self)):
            window = indices[step * target:(step + 1) * target]
            shares = self.shares if len(window) == target else split(len(window), self.shares)
            start = sum(shares[:rank])
            yield window[start:start + shares[rank]]


def split(total: int, shares: Sequence[int]) -> tuple[int, ...]:
    """``total`` samples over the ranks in proportion to ``shares``, each at least 1, summing to ``total``."""
    whole = sum(shares)
    out = [max(1, total * n // whole) for n in shares]
    i = len(out) - 1
    while sum(out) > total:  # the floor of 1 can overshoot: take back from the largest
        j = max(range(len(out)), key=lambda k: out[k])
        out[j] -= 1
    while sum(out) < total:
        out[i] += 1
        i = (i - 1) % len(out)
    return tuple(out)
