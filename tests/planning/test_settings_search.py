"""The settings search's arithmetic: which settings are tried, the time model's parts, the ranking's reasons."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.planning.settings_search import Rank, Work, candidates, ranked, step_time
from autotune.results.search import SettingRow, TrainSetting


def labels(settings: list[TrainSetting]) -> list[str]:
    return [s.label for s in settings]


def test_one_rank_tries_checkpointing_and_offload_only_and_never_a_change_not_allowed() -> None:
    assert labels(candidates(1, "blocks.*", 6)) == [
        "ddp", "fsdp(sync every) + offload", "ddp + checkpoint blocks.* every block",
        "fsdp(sync every) + offload + checkpoint blocks.* every block", "ddp + checkpoint blocks.* every 2nd block",
        "fsdp(sync every) + offload + checkpoint blocks.* every 2nd block"]
    assert labels(candidates(1, "blocks.*", 3))[::2] == ["ddp", "ddp + checkpoint blocks.* every block"]
    assert labels(candidates(1, None, 0)) == ["ddp", "fsdp(sync every) + offload"]
    assert labels(candidates(1, None, 0, offload=False)) == ["ddp"]  # the CPU: its host is the device
    assert all(not s.changes for s in candidates(8, "blocks.*", 6))


def test_several_ranks_try_fsdp_and_allowed_changes_each_alone_and_together() -> None:
    found = candidates(4, None, 0, ("bf16-mixed", "lora"))
    assert labels(found[:4]) == ["ddp", "fsdp(sync last)", "fsdp(sync every)", "fsdp(sync every) + offload"]
    assert all(s.parallel == "fsdp" for s in found if s.offload)
    assert {s.changes for s in found} == {(), ("bf16-mixed",), ("lora",), ("bf16-mixed", "lora")}
    assert ("bf16", "bf16-mixed") not in {s.changes for s in candidates(2, None, 0, ("bf16-mixed", "bf16"))}


GB = 1e9
RANK = Rank(bandwidth=1000 * GB, link=100 * GB, host_link=25 * GB, host_adam=1e9)
WORK = Work(micro_seconds=0.5, micro_batch=8, steps=4, param_bytes=10 * GB, trainable_bytes=10 * GB,
            trainable_count=int(2.5e9))


@pytest.mark.parametrize(("setting", "world", "communication", "optimizer"), [
    (TrainSetting(), 1, 0.0, 0.07),  # one rank: nothing to synchronise; Adam moves 7 x 10 GB at 1 TB/s
    (TrainSetting(), 4, 0.15, 0.07),  # DDP: one all-reduce a step, 2 x 3/4 x 10 GB at 100 GB/s
    (TrainSetting(parallel="fsdp", fsdp_sync="last"), 4, 4 * 0.15 + 0.075, 0.07 / 4),  # 2 all-gathers a micro-step
    (TrainSetting(parallel="fsdp", fsdp_sync="every"), 4, 4 * (0.15 + 0.075), 0.07 / 4),  # + a reduce-scatter each
])
def test_the_time_model_of_a_step(setting: TrainSetting, world: int, communication: float, optimizer: float) -> None:
    t = step_time(setting, WORK, RANK, world)
    assert t.compute == pytest.approx(2.0)
    assert (t.communication, t.optimizer) == (pytest.approx(communication), pytest.approx(optimizer))
    assert t.host == 0.0


@pytest.mark.parametrize(("world", "host"), [
    # each micro-step: 2 all-gathers copy the rank's parameter shard in (2 x 10 GB / W), the reduce-scatter copies its
    # gradient shard out (10 GB / W), at 25 GB/s
    (4, 4 * (2 * 2.5 + 2.5) / 25),
    (1, 4 * (2 * 10 + 10) / 25),
])
def test_offload_adds_its_pcie_copies_and_the_hosts_adam_step(world: int, host: float) -> None:
    setting = TrainSetting(parallel="fsdp", fsdp_sync="every", offload=True)
    t, kept = step_time(setting, WORK, RANK, world), step_time(replace(setting, offload=False), WORK, RANK, world)
    assert t.host == pytest.approx(host)
    assert t.communication == pytest.approx(kept.communication)  # the all-gathers and reduce-scatters as before
    # the host steps every rank's shard (one host serves the ranks): 2.5e9 parameters at 1e9 a second
    assert t.optimizer == pytest.approx(2.5)
    assert t.total > kept.total


def test_of_two_plans_with_the_same_flops_the_one_with_fewer_micro_steps_is_faster() -> None:
    """A micro-step costs its ops' launches and its checkpointed blocks' own work whatever its size: 24 samples as
    2 micro-steps of 12 beat 6 of 4 on the same roofline seconds a sample."""
    rank = replace(RANK, per_op=4e-6, per_region=2e-4)
    few = replace(WORK, micro_seconds=12e-3, micro_batch=12, steps=2, ops=300, regions=6)
    many = replace(few, micro_seconds=4e-3, micro_batch=4, steps=6)
    setting = TrainSetting(blocks="blocks.*", checkpoint_every=1)
    t_few, t_many = step_time(setting, few, rank, 1), step_time(setting, many, rank, 1)
    assert t_few.compute == pytest.approx(2 * (12e-3 + 300 * 4e-6 + 6 * 2e-4))
    assert t_many.compute - t_few.compute == pytest.approx(4 * (300 * 4e-6 + 6 * 2e-4))
    assert step_time(setting, few, RANK, 1).compute == step_time(setting, many, RANK, 1).compute  # no fixed costs


@pytest.mark.slow  # the CPU's costs are timed once
def test_the_fixed_costs_are_the_cpus_measured_ones_and_a_gpus_launch() -> None:
    """On the CPU each op's and each checkpointed block's cost is measured on a small training step (the host is
    the device); on a GPU an op costs its stated launch, and the checkpoint's host work runs ahead of the kernels."""
    from autotune.devices import get_device
    from autotune.planning.settings_search import LAUNCH
    from autotune.probing.settings import cpu_overheads, speed_of

    cpu = speed_of(get_device("cpu"))[1]
    assert (cpu.per_op, cpu.per_region) == cpu_overheads() and cpu.per_op > 0
    gpu = speed_of(get_device("estimate:H100-80GB"))[1]
    assert (gpu.per_op, gpu.per_region) == (LAUNCH, 0.0)


def test_offload_says_it_trades_speed_for_memory() -> None:
    offload = TrainSetting(parallel="fsdp", fsdp_sync="every", offload=True)
    rows = ranked([SettingRow(setting=TrainSetting(parallel="fsdp", fsdp_sync="every"), fits=True, max_micro_batch=2,
                              micro_batch=2, accumulation_steps=4, samples_per_second=100.0),
                   SettingRow(setting=offload, fits=True, max_micro_batch=8, micro_batch=8, accumulation_steps=1,
                              samples_per_second=40.0)])
    assert rows[1].setting == offload and "slower by 150%" in rows[1].why and "offload" in rows[1].why
    alone = ranked([SettingRow(setting=TrainSetting(), fits=False, max_micro_batch=0, why="does not fit: 9 GiB"),
                    SettingRow(setting=offload, fits=True, max_micro_batch=8, micro_batch=8, accumulation_steps=1,
                               samples_per_second=40.0)])
    assert alone[0].setting == offload and "the only setting that fits" in alone[0].why


def test_the_ranking_puts_what_fits_first_and_says_why_each_lost() -> None:
    fast = SettingRow(setting=TrainSetting(), fits=True, max_micro_batch=8, micro_batch=8, accumulation_steps=2,
                      samples_per_second=100.0)
    slow = SettingRow(setting=TrainSetting(blocks="b.*", checkpoint_every=1), fits=True, max_micro_batch=16,
                      micro_batch=16, accumulation_steps=1, samples_per_second=80.0)
    out = SettingRow(setting=TrainSetting(parallel="fsdp", fsdp_sync="last"), fits=False, max_micro_batch=0,
                     why="does not fit: micro-batch 1 needs 3 GiB")
    rows = ranked([out, slow, fast])
    assert [r.setting for r in rows] == [fast.setting, slow.setting, out.setting]
    assert rows[0].why.startswith("fastest") and rows[1].why == "slower by 25%" and rows[2].why == out.why
