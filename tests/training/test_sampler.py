"""PlanSampler: every rank its share of every effective batch, equal step counts, every sample once."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from autotune.errors import BadInput
from autotune.planning.planner import make_plan
from autotune.training.sampler import PlanSampler, split


@pytest.mark.parametrize("size,drop_last", [(1021 * 3, False), (1021 * 3 + 700, False), (1021 * 3 + 700, True),
                                            (1021 + 1, False)])
def test_ranks_get_the_plans_uneven_shares_and_the_same_number_of_steps(size, drop_last):
    plan = make_plan(1021, 128, world_size=2)
    assert plan.per_rank_batch == (510, 511)
    ranks = [list(PlanSampler(size, plan, rank=r, seed=3, drop_last=drop_last)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(PlanSampler(size, plan, rank=0, drop_last=drop_last))
    for step, (a, b) in enumerate(zip(*ranks)):
        if step < size // 1021:
            assert (len(a), len(b)) == (510, 511)
    seen = [i for batches in ranks for batch in batches for i in batch]
    assert len(seen) == len(set(seen))  # no sample twice
    used = size if not drop_last and size % 1021 >= 2 else size - size % 1021
    assert sorted(seen) == sorted(set(seen)) and len(seen) == used


def test_epochs_reshuffle_identically_on_every_rank():
    plan = make_plan(64, 16, world_size=2)
    a, b = PlanSampler(640, plan, rank=0), PlanSampler(640, plan, rank=1)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    second_a, second_b = list(a), list(b)
    assert first != second_a
    assert not set(map(tuple, second_a)) & set(map(tuple, second_b))


def test_a_dataloader_over_the_sampler_yields_the_per_rank_batches():
    plan = make_plan(10, 4, world_size=1)
    loader = DataLoader(list(range(25)), batch_sampler=PlanSampler(25, plan, shuffle=False))
    assert [len(b) for b in loader] == [10, 10, 5]


@pytest.mark.parametrize("total,shares,want", [(5, (510, 511), (2, 3)), (3, (1, 1, 1), (1, 1, 1)), (7, (3, 1), (5, 2)),
                                               (4, (1, 1, 1), (1, 1, 2))])
def test_split_keeps_proportions_and_gives_every_rank_a_sample(total, shares, want):
    assert split(total, shares) == want


def test_a_rank_outside_the_plan_is_refused():
    with pytest.raises(BadInput, match="rank 2 is outside"):
        PlanSampler(100, make_plan(10, 4, world_size=2), rank=2)
