"""FSDP on two CPU processes with gloo under torchrun: the estimate from one process, the runner's checks,
probing with a rank that runs out of memory, and a rank that fails."""

from __future__ import annotations

import json
import time

import pytest

from tests.test_distributed import HERE, torchrun

BATCH, BUDGET, TARGET, LIMIT = 6, 8_000_000, 61, 5


@pytest.fixture(scope="module")
def worker():
    done = torchrun(str(HERE / "fsdp_worker.py"), str(BATCH), str(BUDGET), str(TARGET), str(LIMIT), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_the_one_process_estimate_matches_each_rank_measured_under_torchrun(worker, gpt):
    from autotune.devices import get_device
    from autotune.probing.fitrule import fit_rule_work
    from autotune.probing.fsdp import FsdpRule, fake_engine

    estimate = fake_engine(get_device("cpu").estimator())
    _, m = estimate.measure(fit_rule_work(gpt, BATCH, sharding=FsdpRule(2, 0)))
    for peak in worker["peaks"]:
        assert abs(m.peak_bytes - peak) / peak <= 0.03, (m.peak_bytes, worker["peaks"])


@pytest.mark.slow
def test_two_ranks_verify_under_fsdp(worker):
    correct = worker["correct"]
    assert correct["passed"]
    assert correct["gradient_equivalence"]["value"] <= 1e-5
    assert correct["reduce_scatter_rounds"]["value"] == 1
    assert correct["parameters_in_sync"]["passed"] and correct["parameters_in_sync"]["value"] == 2
    ratio = correct["memory"]["message"].split("measured/predicted ")[1].split()[0]
    assert abs(float(ratio) - 1) <= 0.03
    assert sum(map(sum, worker["schedule"])) == TARGET and len(worker["schedule"]) == 2
    assert worker["parallel"] == "fsdp" and max(map(max, worker["schedule"])) == LIMIT  # planned from the probe


@pytest.mark.slow
def test_planted_fsdp_faults_are_caught(worker):
    every = worker["syncs_every_micro_step"]
    assert every["gradient_equivalence"]["passed"]  # the right gradient ...
    rounds = every["reduce_scatter_rounds"]
    assert not rounds["passed"] and rounds["value"] == len(worker["schedule"][0])  # ... one round per micro-step
    assert "set_requires_gradient_sync(False)" in rounds["message"]
    factor = worker["no_world_factor"]
    assert not factor["passed"] and factor["gradient_equivalence"]["value"] > 0.4


@pytest.mark.slow
def test_ranks_agree_on_the_smallest_max_and_an_oom_leaves_nothing_sharded_behind(worker):
    probe = worker["probe"]
    assert probe["max"] == [LIMIT, LIMIT]  # rank 1 ran out of memory above LIMIT; rank 0 fits more
    assert probe["ranks"][1] == LIMIT and probe["ranks"][0] > LIMIT
    assert probe["real_ooms"][1] >= 1 and probe["real_ooms"][0] == 0
    assert probe["live_fsdp_params_after"] == [0, 0]
    assert probe["fake_groups_after"] == [0, 0]


@pytest.mark.slow
def test_a_rank_failing_inside_fsdp_collectives_ends_the_job(tmp_path):
    probe = tmp_path / "rank_probe.py"
    probe.write_text(
        "import os\n"
        "from dataclasses import replace\n"
        "from autotune.probes.gpt import build as gpt, loss\n"
        "def failing(model, batch):\n"
        "    mesh = next(model.parameters()).device_mesh\n"
        "    if os.environ.get('RANK') == '1' and mesh.mesh_dim_names is None:  # sharded over the real group\n"
        "        raise ValueError('no data shard for this rank')\n"
        "    return loss(model, batch)\n"
        "def build():\n"
        "    return replace(gpt(), loss=failing)\n")
    from autotune.results.plan import Plan
    from autotune.serial import dumps

    plan = tmp_path / "plan.json"  # made by hand: the job goes straight to training, no probe
    plan.write_text(dumps(Plan(target_batch=16, world_size=2, micro_batch=4, accumulation_steps=2,
                               schedule=((4, 4), (4, 4)), uniform=True, max_micro_batch=4,
                               parallel="fsdp").to_dict()))
    start = time.monotonic()
    done = torchrun("-m", "autotune", "run", "--plan", str(plan), "--probe", str(probe), "--device", "cpu",
                    "--steps", "1", "--dist-timeout", "30", timeout=150)
    assert done.returncode != 0
    assert "[rank 1] autotune run: error: workload" in done.stderr and "no data shard for this rank" in done.stderr
    assert time.monotonic() - start < 120
