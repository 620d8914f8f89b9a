"""Two CPU processes with gloo under torchrun: exact, synchronised once per step, in sync, and a clean end;
ranks with uneven batches; ranks that differ (each its own micro-batch and micro-steps); the noise scale under
DDP and FSDP; the batch ramp's one decision; FSDP: the estimate from one process, the runner's checks, probing
with a rank that runs out of memory, and a rank that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..torchrun import torchrun

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
BUDGET = "2.6MB"  # max micro-batch ~112 with DDP's buckets: 255 -> 2 micro-steps per rank


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("cli_run") / "result.json"
    done = torchrun("-m", "autotune", "run", "--target-batch", "255", "--probe", "mlp", "--device", "cpu",
                    "--memory-budget", BUDGET, "--steps", "3", "--json", "--quiet", "--output", str(output))
    return done, output


@pytest.mark.slow
def test_two_ranks_match_the_single_process_gradient(cli_run):
    cli_run, output = cli_run
    assert cli_run.returncode == 0, cli_run.stderr[-2000:]
    assert "terminate called" not in cli_run.stderr
    result = json.loads(cli_run.stdout)
    assert json.loads(output.read_text()) == result  # written in full before the ranks ended
    plan = result["plan"]
    assert plan["world_size"] == 2 and plan["world_size_source"] == "process group"
    assert plan["per_rank_batch"] == [127, 128]  # a target not divisible by the world size, exactly
    assert plan["accumulation_steps"] == 2
    checks = {c["name"]: c for c in result["verification"]["checks"]}
    assert checks["gradient_equivalence"]["value"] <= 1e-5
    assert checks["parameters_in_sync"]["passed"] and checks["parameters_in_sync"]["value"] == 3
    assert checks["allreduce_rounds"]["details"]["rounds_per_step"] == [1, 1, 1]
    assert len(plan["probe"]["ranks"]) == 2 and plan["probe"]["data_parallel"]


@pytest.fixture(scope="module")
def offload_plan(tmp_path_factory):
    """A plan whose chosen setting is FSDP with CPU offload, and the file ``autotune run --settings`` reads it from."""
    from dataclasses import replace

    from autotune import api
    from autotune.results.search import TrainSetting
    from autotune.serial import dumps

    plan = api.plan(1020, probe="mlp", device="cpu", memory_budget="2.6MB", parallel="fsdp", world_size=2,
                    fsdp_sync="every")
    path = tmp_path_factory.mktemp("offload") / "plan.json"
    path.write_text(dumps(replace(plan, setting=TrainSetting(parallel="fsdp", fsdp_sync="every", offload=True))
                          .to_dict()))
    return plan, path


RAMP_UNDER_FSDP = ("run --target-batch 2048 --probe mlp --device cpu --memory-budget 4MiB --steps 25 --ramp "
                   "--parallel fsdp --json --quiet")


@pytest.fixture(scope="module")
def cases(offload_plan):
    """The library's cases under torchrun (tests/training/torchrun_cases.py), and two ``autotune run`` commands
    inside the same process group, in one job."""
    _, settings = offload_plan
    done = torchrun("-m", "tests.training.torchrun_cases", "ddp_faults", "uneven_batches", "noise_scale", "fsdp",
                    "ramp", "mixed_ranks", "batch_kinds", f"ramp_under_fsdp=cli:{RAMP_UNDER_FSDP}",
                    f"offload=cli:run --settings {settings} --steps 2 --json --quiet", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def command_result(case: dict) -> dict:
    """The RunResult an ``autotune run`` case printed, once every rank ended it with exit code 0."""
    assert case["codes"] == [0, 0], case["stderr"]
    return json.loads(case["stdout"])


@pytest.mark.slow
def test_the_batch_ramp_decides_the_same_next_batch_on_every_rank(cases):
    out = cases["ramp"]
    agree, differs, fault = out["agree"], out["rank_1_differs"], out["no_broadcast"]
    grown = [phase[1] for phase in agree[0]["phases"]]
    assert len(grown) >= 3 and grown == sorted(grown)
    assert agree[0]["phases"] == agree[1]["phases"]
    assert differs[1]["differed"] and differs[0]["phases"] == differs[1]["phases"]  # rank 1 follows rank 0
    assert fault[1]["differed"] and fault[0]["phases"] != fault[1]["phases"]  # the planted fault: no broadcast


@pytest.mark.slow
def test_graph_and_packed_batches_split_over_ranks(cases):
    """Each rank's share of a graph or packed global batch taken by the workload's split: the synchronised
    gradient is the one-pass gradient over all 31 samples, every check holds."""
    for name, out in cases["batch_kinds"].items():
        assert out["per_rank_batch"] == [15, 16] and out["micro_steps"] > 1, name
        assert out["error"] < 1e-5 and out["failed"] == [], (name, out)


@pytest.mark.slow
def test_planted_ddp_faults_are_reported(cases):
    out = cases["ddp_faults"]
    assert out["correct"]["passed"]
    nosync = out["no_sync_missing"]
    assert nosync["gradient_equivalence"]["passed"]  # the right gradient ...
    assert not nosync["allreduce_rounds"]["passed"] and nosync["allreduce_rounds"]["value"] == 2  # ... k rounds
    assert "no_sync" in nosync["allreduce_rounds"]["message"]
    factor = out["no_world_factor"]
    assert not factor["gradient_equivalence"]["passed"] and factor["gradient_equivalence"]["value"] > 0.4


@pytest.mark.slow
def test_ranks_with_uneven_batches_run_the_same_micro_steps_and_the_exact_gradient(cases):
    reports = cases["uneven_batches"]
    assert [r["micro_steps"] for r in reports] == [3, 3]  # the most any rank needs
    assert [r["samples"] for r in reports] == [37, 5] and {r["total_items"] for r in reports} == {42}
    assert max(r["error"] for r in reports) < 1e-6


@pytest.mark.slow
def test_ranks_with_their_own_budgets_train_their_own_shares_exactly(cases):
    out = cases["mixed_ranks"]
    schedule, mixed = out["schedule"], out["mixed"]
    assert mixed is not None and mixed["balanced_by"] == "memory"  # CPU budgets emulate memory, not speed
    assert sum(map(sum, schedule)) == 1800  # the global batch, exactly
    assert sum(schedule[0]) > sum(schedule[1])  # the rank with 8 MiB trains more samples per step ...
    assert len(schedule[0]) < len(schedule[1])  # ... in fewer micro-steps than the rank with 3 MiB
    assert [r["budget_bytes"] for r in mixed["ranks"]] == [8 * 2**20, 3 * 2**20]
    for rank, checks in enumerate(out["correct"]):
        assert checks["passed"], (rank, checks)
        assert checks["gradient_equivalence"]["value"] <= 1e-5  # the full-batch gradient over both ranks' samples
        assert checks["count"]["passed"] and checks["allreduce_rounds"]["value"] == 1  # one synchronising backward
        assert checks["parameters_in_sync"]["value"] == 2
        memory = checks["memory"]
        assert memory["passed"] and memory["limit"] == mixed["ranks"][rank]["usable_bytes"]  # its own budget
        assert memory["value"] <= memory["limit"]
    assert out["correct"][0]["memory"]["limit"] > 2 * out["correct"][1]["memory"]["limit"]


@pytest.mark.slow
def test_ranks_that_differ_run_in_step_under_fsdp_with_the_exact_gradient(cases):
    out = cases["mixed_ranks"]
    schedule = out["fsdp_schedule"]
    assert len(schedule[0]) == len(schedule[1]) and sum(schedule[0]) > sum(schedule[1])  # in step, own sizes
    assert sum(map(sum, schedule)) == 500
    for checks in out["fsdp"]:
        assert checks["passed"], checks
        assert checks["gradient_equivalence"]["value"] <= 1e-5 and checks["reduce_scatter_rounds"]["value"] == 1


@pytest.mark.slow
def test_planted_faults_of_ranks_that_differ_are_caught(cases):
    out = cases["mixed_ranks"]
    for rank, checks in enumerate(out["local_items"]):  # rank 1 weights by its own items
        assert not checks["passed"] and not checks["gradient_equivalence"]["passed"], rank
        assert checks["gradient_equivalence"]["value"] > 0.05
    skipped, other = out["skips_its_sync"]  # rank 0 never synchronises, standing in with zeros as join() does
    assert not skipped["allreduce_rounds"]["passed"] and skipped["allreduce_rounds"]["value"] == 0
    assert "0 gradient all-reduce rounds in an optimizer step, expected 1" in skipped["allreduce_rounds"]["message"]
    for checks in (skipped, other):
        assert not checks["passed"] and not checks["gradient_equivalence"]["passed"]
        assert not checks["parameters_in_sync"]["passed"]


@pytest.mark.slow
def test_ddp_and_fsdp_noise_scale_estimates_equal_the_single_process_one_on_the_same_samples(cases):
    for name, case in cases["noise_scale"].items():
        single, ranks = case["single"], case["ranks"]
        assert len(single) == 4 and all(r == ranks[0] for r in ranks)  # every rank holds the same estimate
        assert ranks[0] == [pytest.approx(s, rel=1e-4, abs=1e-9) for s in single], name
        assert all(r == case["fsdp"][0] for r in case["fsdp"])  # FSDP: sharded gradients, the same estimate
        assert case["fsdp"][0] == [pytest.approx(s, rel=1e-4, abs=1e-9) for s in single], name
        # the planted fault: ranks that do not pool their micro-batch norms (each sees k of k·W)
        assert case["unpooled"] != [pytest.approx(s, rel=0.05) for s in single], name
    assert set(cases["noise_scale"]) == {"accumulating", "one_micro_step_per_rank"}


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    probe = tmp_path / "rank_probe.py"
    probe.write_text(
        "import os\n"
        "from autotune.probes.mlp import build as mlp\n"
        "def build():\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        raise ValueError('no data shard for this rank')\n"
        "    return mlp()\n")
    start = time.monotonic()
    done = torchrun("-m", "autotune", "run", "--target-batch", "64", "--probe", str(probe), "--device", "cpu",
                    "--memory-budget", BUDGET, "--steps", "1", "--dist-timeout", "30", timeout=120)
    assert done.returncode != 0
    assert "[rank 1] autotune run: error: probe" in done.stderr and "no data shard for this rank" in done.stderr
    assert time.monotonic() - start < 90


@pytest.mark.slow
def test_ranks_leave_the_group_with_no_thread_left_behind():
    # The GIL handed over every 0.5 s: a communication thread left alive after the group is gone
    # would still wait for it at finalization and abort the rank (SIGABRT, torchrun exit 1).
    # bench/torchrun_teardown.py repeats this 20 times beside CPU hogs.
    done = torchrun(str(HERE / "ddp_teardown.py"), "0.5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["threads_inside"] > r["threads_before"]  # the group's threads ran ...
        assert r["threads_after"] == r["threads_before"], r  # ... and are joined when it is left
        assert r["rounds"] == [1, 1, 1]  # one all-reduce round per step, however many micro-steps


@pytest.mark.slow
def test_a_rank_that_fails_at_the_end_is_named_by_the_ranks_waiting_to_leave():
    start = time.monotonic()
    done = torchrun(str(HERE / "ddp_teardown.py"), "0.005", "--rank0-fails", timeout=120)
    assert done.returncode != 0
    errors = {r["rank"]: r["error"] for r in map(json.loads, filter(None, done.stdout.splitlines()))}
    assert errors[0] == "ValueError: planted failure after the last collective"
    assert errors[1].startswith("AutotuneError: rank 1 finished its work but another rank stopped before the end; "
                                "that rank's error says why (")
    assert "\n" not in errors[1] and "terminate called" not in done.stderr
    assert time.monotonic() - start < 90  # no rank waits for its timeout


@pytest.mark.slow
def test_the_one_process_fsdp_estimate_matches_each_rank_measured_under_torchrun(cases, gpt):
    from autotune.devices import get_device
    from autotune.probing.fitrule import fit_rule_work
    from autotune.probing.fsdp import Sharding, fake_engine

    worker = cases["fsdp"]
    for estimate in (fake_engine(get_device("cpu").estimator()), get_device("cpu").estimator()):  # meta's too
        for every, measured in ((False, worker["peaks"]), (True, worker["peaks_sync_every"])):
            _, m = estimate.measure(fit_rule_work(gpt, worker["batch"], sharding=Sharding(2, 0, sync_every=every)))
            for peak in measured:
                assert abs(m.peak_bytes - peak) / peak <= 0.03, (estimate.engine, every, m.peak_bytes, measured)
        assert estimate.fallback is None


@pytest.mark.slow
def test_fsdp_peaks_do_not_depend_on_when_the_transport_lets_go_of_its_buffers(cases):
    # gloo's threads keep a finished collective's tensors until they next run (late, on a loaded machine): the
    # planted transport keeps them all until the end, and the measured peak must not see it
    worker = cases["fsdp"]
    assert worker["peaks_transport_keeps"] == worker["peaks"], worker


@pytest.mark.slow
def test_two_ranks_verify_under_fsdp(cases):
    worker = cases["fsdp"]
    correct = worker["correct"]
    assert correct["passed"]
    assert correct["gradient_equivalence"]["value"] <= 1e-5
    assert correct["reduce_scatter_rounds"]["value"] == 1
    assert correct["parameters_in_sync"]["passed"] and correct["parameters_in_sync"]["value"] == 2
    ratio = correct["memory"]["message"].split("measured/predicted ")[1].split()[0]
    assert abs(float(ratio) - 1) <= 0.03
    assert sum(map(sum, worker["schedule"])) == worker["target"] and len(worker["schedule"]) == 2
    assert worker["parallel"] == "fsdp"
    assert max(map(max, worker["schedule"])) == worker["limit"]  # planned from the probe, where rank 1 held the least


@pytest.mark.slow
def test_planted_fsdp_faults_are_caught(cases):
    worker = cases["fsdp"]
    every = worker["syncs_every_micro_step"]
    assert every["gradient_equivalence"]["passed"]  # the right gradient ...
    rounds = every["reduce_scatter_rounds"]
    assert not rounds["passed"] and rounds["value"] == len(worker["schedule"][0])  # ... one round per micro-step
    assert "set_requires_gradient_sync(False)" in rounds["message"]
    factor = worker["no_world_factor"]
    assert not factor["passed"] and factor["gradient_equivalence"]["value"] > 0.4


@pytest.mark.slow
def test_two_ranks_verify_under_fsdp_syncing_every_micro_step_and_a_deferred_sync_is_caught(cases):
    worker = cases["fsdp"]
    k = len(worker["schedule"][0])
    correct, deferred = worker["sync_every"]["correct"], worker["sync_every"]["defers_sync"]
    assert correct["passed"] and correct["gradient_equivalence"]["value"] <= 1e-5, correct
    assert k > 1 and correct["reduce_scatter_rounds"]["value"] == k  # one round a micro-step
    assert correct["parameters_in_sync"]["passed"]
    assert deferred["gradient_equivalence"]["passed"]  # the right gradient, but ...
    assert not deferred["passed"] and not deferred["reduce_scatter_rounds"]["passed"]  # ... one round a step
    assert f"expected {k} (one a micro-step)" in deferred["reduce_scatter_rounds"]["message"]


@pytest.mark.slow
def test_fsdp_ranks_agree_on_the_smallest_max_and_an_oom_leaves_nothing_sharded_behind(cases):
    probe, limit = cases["fsdp"]["probe"], cases["fsdp"]["limit"]
    assert probe["max"] == [limit, limit]  # rank 1 ran out of memory above the limit; rank 0 fits more
    assert probe["ranks"][1] == limit and probe["ranks"][0] > limit
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


CLI_UNDER_TORCHRUN = """
import atexit, sys
atexit.register(lambda: print("interpreter finalized", file=sys.stderr, flush=True))
from autotune.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv, code, out, err", [
    (["--version"], 0, "autotune ", ""),
    (["run", "--target-batch", "8", "--max-norm", "-1"], 2, "", "[rank 1] autotune run: error: --max-norm"),
    (["run", "--steps", "0"], 2, "", "--steps 0"),
])
def test_a_torchrun_rank_ends_with_its_exit_code_without_finalizing(argv, code, out, err):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-c", CLI_UNDER_TORCHRUN, *argv], check=False, capture_output=True,
                          text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == code, done.stderr
    assert done.stdout.startswith(out) and err in done.stderr  # written out before the end
    assert "interpreter finalized" not in done.stderr


def test_outside_torchrun_the_command_ends_the_ordinary_way():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", CLI_UNDER_TORCHRUN, "--version"], check=False, capture_output=True,
                          text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 0 and "interpreter finalized" in done.stderr


@pytest.mark.slow
def test_a_batch_ramp_under_fsdp_grows_and_verifies_every_phase(cases):
    """``autotune run --ramp --parallel fsdp`` on two ranks: the ramp starts below the target, grows on the
    measured noise scale, and every phase's sharded, accumulated gradient is the full-batch one."""
    result = command_result(cases["ramp_under_fsdp"])
    phases = [p["effective_batch"] for p in result["batch_schedule"]]
    assert len(phases) >= 2 and phases == sorted(phases) and phases[0] < 2048 == phases[-1], phases
    assert result["plan"]["parallel"] == "fsdp"
    checks = {c["name"]: c for c in result["verification"]["checks"]}
    assert result["verification"]["passed"], checks
    assert checks["phase_gradients"]["value"] <= 1e-5 and checks["batch_schedule"]["passed"]


@pytest.mark.slow
def test_two_gloo_ranks_train_under_fsdp2s_cpu_offload_and_verify(offload_plan, cases):
    """``autotune run --settings FILE`` of a plan whose chosen setting is FSDP with CPU offload, on two CPU ranks:
    FSDP2 runs with CPUOffloadPolicy (the CPU is its own host) and the verification holds."""
    plan, _ = offload_plan
    assert plan.accumulation_steps >= 2
    result = command_result(cases["offload"])
    checks = {c["name"]: c for c in result["verification"]["checks"]}
    assert result["verification"]["passed"], [c["message"] for c in checks.values() if not c["passed"]]
    assert checks["gradient_equivalence"]["value"] <= 1e-5
    assert checks["reduce_scatter_rounds"]["value"] == plan.accumulation_steps  # one a micro-step
    assert any("CPU offload" in n for n in result["notes"])
