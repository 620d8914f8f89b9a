"""Planning a job whose ranks differ from one process: a device or memory budget per rank, each rank probed, a
mixed plan (or the smallest-for-all one), the command line's flags and errors, the store."""

from __future__ import annotations

import json

import pytest

import autotune
from autotune import options
from autotune.cli import main
from autotune.errors import BadInput
from autotune.planning.planner import make_plan

MiB = 2**20
MLP = ["--probe", "mlp", "--device", "cpu", "--quiet"]


@pytest.mark.parametrize("value, items", [
    ("cpu", ("cpu",)),
    ("estimate:A100-80GB,estimate:T4-16GB", ("estimate:A100-80GB", "estimate:T4-16GB")),
    ("estimate:H100-80GB*2, estimate:A10G-24GB*1", ("estimate:H100-80GB",) * 2 + ("estimate:A10G-24GB",)),
    (["cpu", "cpu"], ("cpu", "cpu")),
    (None, (None,)),
])
def test_a_value_per_rank(value, items):
    assert options.per_rank(value, "device") == items


@pytest.mark.parametrize("value, match", [
    ("cpu,,cpu", "device 'cpu,,cpu' has an empty item"),
    ("cpu*0", "device count after '\\*' in 'cpu\\*0' must be at least 1"),
    ("estimate:T4-16GB*-1", r"device count after '\*' in 'estimate:T4-16GB\*-1' must be at least 1: give how many "
                            r"ranks, e\.g\. estimate:T4-16GB\*4$"),
    ("cpu*x", "is not a whole number"),
    ("cpu*", r"device count after '\*' in 'cpu\*' is not a whole number: give how many ranks, e.g. cpu\*4"),
    ("cpu*+2", "is not a whole number"),
    ("cpu*1_000", "is not a whole number"),
])
def test_a_bad_value_per_rank_names_the_parameter(value, match):
    with pytest.raises(BadInput, match=match) as info:
        options.per_rank(value, "device")
    assert info.value.field == "device"


@pytest.mark.parametrize("value", ["estimate:T4-16GB*10000000000,estimate:A100-80GB", ["cpu"] * 1_000_001])
def test_more_ranks_than_a_plan_holds_are_refused_before_a_list_is_made(value):
    with pytest.raises(BadInput, match=r"^device names 1[0-9,]+ ranks: at most 1,000,000: a larger job") as info:
        options.per_rank(value, "device")
    assert (info.value.field, info.value.limit) == ("device", 1_000_000)
    assert len(options.per_rank("cpu*999999,cpu", "device")) == 1_000_000


def test_main_refuses_ten_billion_ranks_in_one_line(capsys):
    assert main(["plan", "--target-batch", "1024", *MLP[:2], "--device", "estimate:T4-16GB*10000000000"]) == 2
    assert capsys.readouterr().err.strip() == ("autotune plan: error: --device names 10,000,000,000 ranks: at most "
                                               "1,000,000: a larger job of ranks alike: one device and --world-size")


def test_an_empty_budget_item_is_shown_with_a_budget_example():
    with pytest.raises(BadInput, match=r"'8MiB,,3MiB' has an empty item: give one per rank, e\.g\. 8MiB,3MiB$"):
        options.memory_budgets("8MiB,,3MiB")


def test_memory_budgets_per_rank():
    assert options.memory_budgets("8MiB,3MiB") == (8 * MiB, 3 * MiB)
    assert options.memory_budgets(None) == (None,) and options.memory_budgets(5) == (5,)


def test_a_plan_for_an_a100_and_a_t4_gives_the_a100_the_larger_share():
    plan = autotune.plan(1024, probe="mlp", device="estimate:A100-80GB,estimate:T4-16GB")
    assert plan.world_size == 2 and plan.world_size_source == "the device list"
    assert sum(plan.per_rank_batch) == 1024 and plan.per_rank_batch[0] > 2 * plan.per_rank_batch[1]
    assert plan.mixed is not None and plan.mixed.balanced_by == "time"
    a100, t4 = plan.mixed.ranks
    assert (a100.device, t4.device) == ("estimate:A100-80GB", "estimate:T4-16GB")
    assert a100.timed_by == t4.timed_by == "roofline" and a100.seconds_per_sample < t4.seconds_per_sample
    assert a100.usable_bytes > 5 * t4.usable_bytes
    assert all(r.peak_bytes is not None and r.peak_bytes <= r.usable_bytes for r in plan.mixed.ranks)
    assert plan.mixed.step_seconds < plan.mixed.uniform_step_seconds
    assert plan.probe is not None and plan.probe.device.name == "estimate:A100-80GB"  # rank 0's


def test_counts_give_the_world_size_and_each_distinct_device_is_probed_once(monkeypatch):
    from autotune import api

    probed = []
    real = api._probe_one
    monkeypatch.setattr(api, "_probe_one", lambda request, wl, dev, *a: probed.append(dev.name) or
                        real(request, wl, dev, *a))
    plan = autotune.plan(4096, probe="mlp", device="estimate:H100-80GB*3,estimate:A10G-24GB*2")
    assert plan.world_size == 5 and probed == ["estimate:H100-80GB", "estimate:A10G-24GB"]
    assert [r.device for r in plan.mixed.ranks] == ["estimate:H100-80GB"] * 3 + ["estimate:A10G-24GB"] * 2
    assert sum(plan.per_rank_batch) == 4096


def test_ranks_alike_are_matched_by_one_look_each_not_against_every_earlier_rank(monkeypatch):
    from autotune.devices.estimate import EstimateDevice

    looks = []
    real = EstimateDevice.describe
    monkeypatch.setattr(EstimateDevice, "describe", lambda self: looks.append(1) or real(self))
    plan = autotune.plan(10**5, probe="mlp", device="estimate:H100-80GB*200,estimate:A10G-24GB*200")
    assert plan.world_size == 400 and sum(plan.per_rank_batch) == 10**5
    # a few looks per rank (matching it, naming it in the plan): a scan of the earlier ranks made 81,202
    assert len(looks) < 5 * 400, len(looks)


def test_budgets_per_rank_on_a_cpu_split_by_memory():
    plan = autotune.plan(1800, probe="mlp", device="cpu", memory_budget="8MiB,3MiB")
    assert plan.mixed is not None and plan.mixed.balanced_by == "memory"  # a CPU budget emulates memory, not speed
    assert plan.per_rank_batch[0] > plan.per_rank_batch[1] and sum(plan.per_rank_batch) == 1800
    assert [r.budget_bytes for r in plan.mixed.ranks] == [8 * MiB, 3 * MiB]
    assert len(plan.schedule[0]) < len(plan.schedule[1])  # rank 0's one micro-step holds what rank 1 needs two for
    assert plan.mixed.uniform_steps > len(plan.schedule[1])


def test_uniform_ranks_keeps_the_smallest_for_all_plan():
    plan = autotune.plan(1300, probe="mlp", device="cpu", memory_budget="8MiB,3MiB", uniform_ranks=True)
    assert plan.mixed is None and plan.probe is not None and plan.probe.capacity_bytes == 3 * MiB
    plain = make_plan(1300, plan.probe.max_micro_batch, world_size=2)
    assert plan.schedule == plain.schedule and plan.per_rank_batch == (650, 650)
    low = plan.probe.max_micro_batch
    # M12: rank 0 was probed only up to the per-rank target 650, so 650 is a floor of its max, not its max
    assert f"uniform ranks: every rank at rank 1's max micro-batch {low} (max micro-batch per rank: at least 650 " \
           f"(probed only up to the per-rank target), {low})" in plan.notes, plan.notes


def test_alike_devices_in_a_list_get_the_ordinary_plan():
    plan = autotune.plan(2048, probe="mlp", device="estimate:A100-80GB*2")
    assert plan.mixed is None and plan.world_size == 2 and plan.per_rank_batch == (1024, 1024)


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "cpu,cpu", "world_size": 3}, "world_size 3 but the device or memory_budget list names 2 ranks"),
    ({"device": "cpu,cpu,cpu", "memory_budget": "8MiB,3MiB"}, "device lists 3 ranks and memory_budget 2"),
    ({"device": "cpu", "memory_budget": "8MiB,3MiB", "tune": True}, "tuning times one device"),
])
def test_lists_that_disagree_are_refused_before_any_probe(kwargs, match):
    with pytest.raises(BadInput, match=match):
        autotune.plan(1024, probe="mlp", **kwargs)


def test_a_probe_or_a_run_of_one_process_takes_one_device():
    with pytest.raises(BadInput, match="a device or memory_budget per rank \\(2 given\\) is for a plan"):
        autotune.probe("mlp", device="cpu", memory_budget="8MiB,3MiB")
    with pytest.raises(BadInput, match="a device or memory_budget per rank"):
        autotune.run(target_batch=64, probe="mlp", device="cpu,cpu")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_line_plans_mixed_ranks_and_says_what_it_gains(capsys):
    code, out, _ = run(capsys, "plan", "--target-batch", "1300", *MLP, "--memory-budget", "8MiB,3MiB")
    assert code == 0
    assert "over 2 ranks, each its own micro-batch and micro-steps" in out
    assert "rank 0 (cpu):" in out and "rank 1 (cpu):" in out
    assert "against the smallest-for-all plan (uniform ranks:" in out and "the slowest rank runs" in out
    code, out, _ = run(capsys, "plan", "--target-batch", "1300", *MLP, "--memory-budget", "8MiB,3MiB", "--json")
    data = json.loads(out)
    assert code == 0 and data["mixed"]["balanced_by"] == "memory" and len(data["mixed"]["ranks"]) == 2


@pytest.mark.parametrize("flags, words", [
    (["--format", "hf"], "the Hugging Face Trainer takes one per-device batch size, but the ranks differ"),
    (["--format", "lightning"], "Lightning takes one per-device batch size"),
    (["--uniform"], "--uniform asks for equal micro-batches on every rank, but the ranks differ"),
])
def test_framework_formats_and_uniform_refuse_a_mixed_plan_naming_uniform_ranks(capsys, flags, words):
    code, out, err = run(capsys, "plan", "--target-batch", "1300", *MLP, "--memory-budget", "8MiB,3MiB", *flags)
    assert code == 2 and out == ""
    assert words in err and "pass --uniform-ranks for the smallest-for-all plan" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_ranks_that_differ_only_in_speed_are_said_so_not_as_equal_maxima(capsys):
    code, _, err = run(capsys, "plan", "--target-batch", "1024", "--probe", "mlp", "--device",
                       "estimate:A100-80GB,estimate:T4-16GB", "--format", "hf")
    assert code == 2 and "the ranks differ (in speed: every rank's max micro-batch is 1023, and the faster ones " \
                         "get more samples)" in err, err


def test_uniform_ranks_exports_to_a_framework(capsys):
    code, out, _ = run(capsys, "plan", "--target-batch", "1300", *MLP, "--memory-budget", "8MiB,3MiB",
                       "--uniform-ranks", "--format", "deepspeed")
    data = json.loads(out)
    assert code == 0 and data["train_batch_size"] == 1300


def test_a_mixed_plan_is_kept_in_the_store_under_fingerprints_that_cover_every_rank(tmp_path):
    from autotune.store import open_store

    url = f"sqlite:///{tmp_path / 'plans.db'}"
    first = autotune.plan(1024, probe="mlp", device="estimate:A100-80GB,estimate:T4-16GB", store=url)
    again = autotune.plan(1024, probe="mlp", device="estimate:A100-80GB,estimate:T4-16GB", store=url)
    assert again.probe.from_store and again.schedule == first.schedule
    alone = autotune.plan(1024, probe="mlp", device="estimate:A100-80GB*2", store=url)
    fingerprints = [r.fingerprint for r in first.mixed.ranks]
    assert None not in fingerprints and len(set(fingerprints)) == 2
    assert alone.probe.fingerprint not in fingerprints  # the A100 of a job beside a T4 is another entry
    store = open_store(url)
    entry = store.get(fingerprints[1])
    ranks = entry.components["ranks"]
    assert [r["name"] for r in ranks] == ["estimate:A100-80GB", "estimate:T4-16GB"]
    assert "ranks" not in store.get(alone.probe.fingerprint).components  # alike ranks: fingerprints as before
    kept = [p for p in store.plans(fingerprints[1]) if p.get("mixed")]
    assert kept and kept[0]["schedule"] == [list(r) for r in first.schedule]


def test_a_rank_that_cannot_hold_one_sample_is_named_with_its_device_and_the_fixes(capsys):
    """M16: a mixed job whose rank 1 cannot hold a micro-batch of 1 says which rank, on which device and budget,
    and offers what lets the job run (FSDP over the ranks, a smaller model, more memory for that rank)."""
    import re

    code, out, err = run(capsys, "plan", "--target-batch", "1800", *MLP, "--memory-budget", "8MiB,1KiB", "-q")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert re.match(r"autotune plan: error: rank 1 of 2 \(cpu, --memory-budget 1\.0 KiB\) cannot hold a "
                    r"micro-batch of 1: micro-batch 1 needs .* usable memory is 921 B \(1\.0 KiB capacity, margin "
                    r"10%\): shard the model over the 2 ranks \(--parallel fsdp\), use a smaller model .*give rank 1 "
                    r"a device with more memory", err), err


@pytest.mark.slow
def test_a_gpu_of_a_mixed_job_too_small_for_the_model_is_named_and_fsdp_is_offered():
    """Issue item 5: gpt:build_1b on an A100 beside a T4: the T4 (rank 1) cannot hold one sample; the error names
    it and offers parallel fsdp or a smaller model, not only the one-device fixes. A target of 2 (one sample a
    rank): the A100's probe stops there, the T4's at its first size."""
    from autotune.errors import DoesNotFit

    with pytest.raises(DoesNotFit, match=r"^rank 1 of 2 \(estimate:T4-16GB\) cannot hold a micro-batch of 1: "
                                         r"micro-batch 1 needs [0-9.]+ GiB \(estimated\).*\(parallel='fsdp'\), use a "
                                         r"smaller model"):
        autotune.plan(2, probe="gpt:build_1b", device="estimate:A100-80GB,estimate:T4-16GB")
