"""The command line as users meet it: outputs, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autotune.cli import main
from autotune.errors import BadInput

MLP = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB", "--quiet"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_devices_says_there_is_no_gpu(capsys):
    code, out, _ = run(capsys, "devices")
    assert code == 0 and "cpu" in out and "no NVIDIA driver or GPU found" in out
    code, out, _ = run(capsys, "devices", "--json")
    data = json.loads(out)
    assert code == 0 and data["gpus"] == [] and data["cpu"]["ram_total_bytes"] > 0


@pytest.mark.parametrize("argv,words", [
    (["probe", "--memory-budget", "12XB"], "is not a size"),
    (["probe", "--memory-budget=-1GiB"], "negative"),
    (["probe", "--device", "tpu"], "unknown device 'tpu'"),
    (["probe", "--device", "cuda"], "cuda:0 is not available"),
    (["probe", "--device", "estimate"], "needs --memory-budget"),
    (["probe", "--margin", "1.5"], "--margin"),
    (["plan", "--target-batch", "0"], "--target-batch 0 must be at least 1"),
    (["plan", "--target-batch", "-4"], "must be at least 1"),
    (["plan", "--target-batch", "12.5"], "not a whole number"),
    (["plan", "--target-batch", "4", "--world-size", "8", *MLP], "smaller than the world size"),
    (["plan", "--target-batch", "1021", "--world-size", "2", "--uniform", *MLP],
     "--uniform: target 1021 does not split into equal micro-batches on 2 ranks"),
    (["plan", "--target-batch", "1021", "--format", "hf", *MLP], "use target 1020 (1020 = 255 x 4 steps x 1 rank) or "
     "1022 (1022 = 146 x 7 steps x 1 rank), or --uniform to force equal micro-batches: 1021 = 1 x 1021 steps"),
    (["plan", "--target-batch", "64", "--multiple-of", "0"], "--multiple-of 0 must be at least 1"),
    (["plan", "--target-batch", "64", "--format", "keras"], "invalid choice: 'keras'"),
    (["plan", "--target-batch", "64", "--probe", "no_such_probe.py"], "does not exist"),
    (["plan", "--target-batch", "64", "--output", "/no/such/folder/plan.json"], "does not exist"),
    (["run", "--target-batch", "64", "--plan", "x.json"], "either --plan FILE or --target-batch N"),
    (["run", "--plan", "missing.json"], "missing.json does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("argv,error", [
    (["probe", "--steps", "3"], "autotune probe: error: unrecognized arguments: --steps 3 (see autotune probe --help)"),
    (["store", "ls", "--bogus"],
     "autotune store ls: error: unrecognized arguments: --bogus (see autotune store ls --help)"),
    (["--bogus", "devices"], "autotune: error: unrecognized arguments: --bogus (see autotune --help)"),
])
def test_an_unknown_argument_is_the_error_of_the_command_that_does_not_know_it(capsys, argv, error):
    assert run(capsys, *argv) == (2, "", error + "\n")


def test_a_bad_estimate_engine_in_the_environment_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_ESTIMATE_ENGINE", "jit")
    code, out, err = run(capsys, "probe", *MLP)
    assert code == 2 and out == ""
    assert err.strip() == ("autotune probe: error: AUTOTUNE_ESTIMATE_ENGINE='jit' is not an estimate engine; "
                           "use one of meta, fake")


def test_plan_table_and_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", "--target-batch", "1021", *MLP, "--output", str(path))
    assert code == 0 and "1021 = 3 x 255 + 1 x 256 over 4 steps x 1 rank" in out and "headroom" in out
    saved = json.loads(path.read_text())
    assert saved["kind"] == "autotune.Plan" and saved["schema_version"] == 2
    code, out, _ = run(capsys, "plan", "--target-batch", "1024", *MLP, "--json")
    assert json.loads(out)["accumulation_steps"] == 4


@pytest.mark.parametrize("fmt,expected", [
    ("hf", {"per_device_train_batch_size": 256, "gradient_accumulation_steps": 4}),
    ("lightning", {"trainer": {"accumulate_grad_batches": 4}, "datamodule": {"batch_size": 256}}),
    ("deepspeed", {"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 256, "gradient_accumulation_steps": 4}),
    ("accelerate", {"accelerator": {"gradient_accumulation_steps": 4}, "dataloader": {"batch_size": 256}}),
])
def test_framework_exports_print_only_their_settings(capsys, fmt, expected):
    code, out, err = run(capsys, "plan", "--target-batch", "1024", *MLP, "--format", fmt)
    assert code == 0 and json.loads(out) == expected and err == ""
    code, out, err = run(capsys, "plan", "--target-batch", "1024", *MLP, "--format", fmt, "--json")
    assert code == 0 and json.loads(out) == expected and err == ""


def test_the_plan_itself_prints_as_json_or_as_a_table(capsys):
    # --format's other two choices (the four frameworks': above; anything else is refused: see the bad input table)
    code, out, err = run(capsys, "plan", "--target-batch", "1024", *MLP, "--format", "json")
    assert code == 0 and json.loads(out)["arithmetic"] == "1024 = 256 x 4 steps x 1 rank" and err == ""
    code, out, err = run(capsys, "plan", "--target-batch", "1024", *MLP, "--format", "table")
    assert code == 0 and "1024 = 256 x 4 steps x 1 rank" in out and not out.startswith("{") and err == ""


def test_framework_exports_plan_equal_micro_batches(capsys):
    # 1020 has no uneven rival; 1022 needs 7 steps of 146 instead of 4 uneven ones (micro-batches up to 307 fit)
    code, out, _ = run(capsys, "plan", "--target-batch", "1022", *MLP, "--format", "hf")
    assert code == 0 and json.loads(out) == {"per_device_train_batch_size": 146, "gradient_accumulation_steps": 7}
    code, out, _ = run(capsys, "plan", "--target-batch", "1021", *MLP, "--format", "hf", "--uniform")
    assert code == 0 and json.loads(out) == {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1021}
    code, out, _ = run(capsys, "plan", "--target-batch", "1021", *MLP, "--uniform", "--json")
    assert code == 0 and json.loads(out)["arithmetic"] == "1021 = 1 x 1021 steps x 1 rank"


def test_estimate_marks_output(capsys):
    code, out, _ = run(capsys, "plan", "--target-batch", "64", "--probe", "mlp", "--device", "estimate",
                       "--memory-budget", "1GiB", "--quiet")
    assert code == 0 and "estimated" in out and "not confirmed" in out


@pytest.mark.slow
def test_run_passes_and_exit_code_1_on_failed_verification(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert run(capsys, "plan", "--target-batch", "1021", *MLP, "--output", str(plan))[0] == 0
    code, out, _ = run(capsys, "run", "--plan", str(plan), "--steps", "2", "--quiet")
    assert code == 0 and "verification PASSED" in out and "relative error" in out
    code, out, _ = run(capsys, "run", "--target-batch", "16", "--probe", "convnet", "--device", "cpu",
                       "--memory-budget", "3MB", "--steps", "1", "--json", "--quiet")
    data = json.loads(out)
    assert code == 1 and data["passed"] is False
    grad = next(c for c in data["verification"]["checks"] if c["name"] == "gradient_equivalence")
    assert "BatchNorm2d" in grad["message"]


@pytest.mark.parametrize("how,argv,env,words", [
    ("fsdp", ["--parallel", "fsdp", "--world-size", "2", "--target-batch", "64"], {},
     "--world-size 2 but 1 process is running: launch with torchrun --nproc-per-node 2 (or plan for 2 ranks "
     "without training them: plan, not run)"),
    ("ddp", ["--world-size", "2", "--target-batch", "64"], {}, "--world-size 2 but 1 process is running"),
    ("WORLD_SIZE", ["--target-batch", "64"], {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but 1 process is running"),
    ("plan", ["--plan", "PLAN"], {}, "the plan is for 2 ranks but 1 process is running: launch with torchrun "
     "--nproc-per-node 2 (or plan for --world-size 1)"),
])
def test_a_run_for_more_ranks_than_processes_stops_before_any_work(capsys, monkeypatch, tmp_path, how, argv, env,
                                                                   words):
    """Without torchrun one process runs: the run refuses before it loads the workload or probes."""
    import autotune.api
    from autotune.planning import make_plan
    from autotune.serial import dumps

    path = tmp_path / "plan.json"
    path.write_text(dumps(make_plan(64, 32, world_size=2).to_dict()))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    loaded = []
    resolve = autotune.api.resolve
    monkeypatch.setattr(autotune.api, "resolve", lambda *a, **k: loaded.append(a) or resolve(*a, **k))
    code, out, err = run(capsys, "run", *[str(path) if a == "PLAN" else a for a in argv], *MLP)
    assert (code, out, loaded) == (2, "", [])
    assert len(err.strip().splitlines()) == 1 and f"autotune run: error: {words}" in err


def test_debug_shows_the_traceback(capsys):
    code, _, err = run(capsys, "probe", "--device", "tpu", "--debug")
    assert code == 2 and "Traceback" in err


def test_help_has_examples():
    for command in ("plan", "probe", "run", "devices"):
        out = subprocess.run([sys.executable, "-m", "autotune", command, "--help"], capture_output=True, text=True,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 0 and "examples:" in out.stdout, command
        assert "(default: None)" not in out.stdout and "(default: False)" not in out.stdout, command


def _no_work(monkeypatch):
    """Any probe or device set-up fails the test: what follows must be refused before that work."""
    def refuse(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    from autotune import api

    monkeypatch.setattr(api, "resolve", refuse)
    monkeypatch.setattr(api, "probe", refuse)


def refused_before_any_work(capsys, monkeypatch, argv, words):
    _no_work(monkeypatch)
    code, out, err = run(capsys, "plan", *argv, *MLP)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err and "secret" not in err


@pytest.mark.parametrize("argv,words", [
    (["--target-batch", "1000000000000000"], "--target-batch 1000000000000000 is more than the 1,000,000,000 samples"),
    (["--world-size", "1000000000", "--target-batch", "1000000000"],
     "1,000,000,000 micro-batches per optimizer step (1000000000 ranks x 1 step), more than the 1,000,000"),
])
def test_plans_past_the_limits_are_refused_before_any_work(capsys, monkeypatch, argv, words):
    refused_before_any_work(capsys, monkeypatch, argv, words)


@pytest.mark.parametrize("argv,words", [
    (["--target-batch", "64", "--tune", "--storage", "bogus://"], "--storage 'bogus://' names no database driver"),
    (["--target-batch", "64", "--tune", "--storage", "sqlite:////no/such/folder/tune.db"],
     "folder /no/such/folder does not exist"),
    (["--target-batch", "64", "--tune", "--storage", "postgresql+pg8000://me:secret@db.example/tune"],
     "--storage 'postgresql+pg8000://me:***@db.example/tune' needs the Python driver pg8000, which is not installed"),
    (["--target-batch", "64", "--storage", "sqlite:///tune.db"], "--storage needs --tune"),
])
def test_bad_storage_is_refused_before_any_work(capsys, monkeypatch, argv, words):
    refused_before_any_work(capsys, monkeypatch, argv, words)


@pytest.mark.parametrize("error,line", [
    (BadInput("is not a size", field="memory_budget", value="12XB", fix="e.g. 512MiB"),
     "--memory-budget '12XB' is not a size, e.g. 512MiB"),
    (BadInput("target 1021 is not a multiple of {multiple_of} 4", field="target_batch",
              fix="use a {multiple_of} that divides it"),
     "target 1021 is not a multiple of --multiple-of 4: use a --multiple-of that divides it"),
    (BadInput("{uniform=True}: target 1021 does not split", fix="drop {uniform='force'}"),
     "--uniform: target 1021 does not split: drop --uniform"),
    (BadInput("{device='estimate'} needs {memory_budget}"), "--device estimate needs --memory-budget"),
    (BadInput("{workload} and {tune=False}"), "--probe and no --tune"),
    (BadInput("unknown device 'tpu': use {x y} or {'a': 1}"), "unknown device 'tpu': use {x y} or {'a': 1}"),
])
def test_library_errors_are_said_in_flags_on_the_command_line(error, line):
    """An error's data said in the command line's terms: its field as a flag, mentions of settings as flags."""
    from autotune.cli.terms import CLI

    assert error.say(CLI) == line


@pytest.mark.parametrize("argv,flag,words", [
    (["--target-batch", "0"], "--target-batch", "--target-batch 0 must be at least 1"),
    (["--target-batch", "64", "--memory-budget", "12XB"], "--memory-budget", "--memory-budget '12XB' is not a size"),
    (["--target-batch", "64", "--margin", "1.5"], "--margin", "--margin '1.5' must be a fraction in [0, 1)"),
    (["--target-batch", "64", "--world-size", "x"], "--world-size", "--world-size 'x' is not a whole number"),
    (["--target-batch", "64", "--device", "cpu*0"], "--device",
     "--device count after '*' in 'cpu*0' must be at least 1"),
    (["--target-batch", "64", "--fsdp-sync", "every"], "--fsdp-sync",
     "--fsdp-sync 'every' is FSDP's gradient sync and --parallel is ddp: add --parallel fsdp, or drop --fsdp-sync"),
    (["--target-batch", "1021", "--multiple-of", "4"], "--multiple-of",
     "--target-batch 1021 is not a multiple of --multiple-of 4"),
    (["--target-batch", "64", "--storage", "sqlite:///x.db"], "--storage", "--storage needs --tune: add --tune"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag_exit_2(capsys, monkeypatch, argv, flag, words):
    """A bad value on the command line: exit 2, one line on stderr that names the flag, no traceback, no work."""
    import autotune.api

    monkeypatch.setattr(autotune.api, "resolve", lambda *a, **k: pytest.fail("a bad flag must stop before any work"))
    code, out, err = run(capsys, "plan", "--probe", "mlp", "--device", "cpu", *argv)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and "Traceback" not in err and flag in err and words in err, err
    assert "_" not in err.split(": error: ")[1].split(" ")[0]  # the flag, never the library's name


@pytest.mark.slow
def test_the_estimate_runs_under_the_generic_allocator_variable(capsys, monkeypatch):
    """PYTORCH_ALLOC_CONF, torch's device-generic name, sets the simulated allocator as PYTORCH_CUDA_ALLOC_CONF
    does, and the output says which variable it came from."""
    def probe(**env):
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code, out, _ = run(capsys, "probe", "--probe", "mlp", "--device", "estimate", "--memory-budget", "1GiB",
                           "--json", "--quiet")
        assert code == 0
        data = json.loads(out)
        return data["device"], [(t["batch"], t["peak_bytes"]) for t in data["trials"]]

    plain, old, generic = probe(), probe(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"), \
        probe(PYTORCH_ALLOC_CONF="expandable_segments:True")
    assert generic[1] == old[1] != plain[1]  # expandable segments reserve otherwise
    assert (generic[0]["allocator_conf"], generic[0]["allocator_conf_variable"]) == (
        "expandable_segments:True", "PYTORCH_ALLOC_CONF")
    assert (old[0]["allocator_conf_variable"], plain[0]["allocator_conf_variable"]) == ("PYTORCH_CUDA_ALLOC_CONF", None)
    assert generic[0]["summary"].endswith("(PYTORCH_ALLOC_CONF=expandable_segments:True)")


def test_an_error_is_one_write_of_one_line_so_ranks_sharing_a_terminal_never_run_together(monkeypatch):
    import io
    import sys

    from autotune.cli import main

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return super().write(text)

    err = Writes()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["plan", "--target-batch", "1024", "--probe", "mlp", "--device", "cpu*"]) == 2
    assert err.writes == [err.getvalue()] and err.getvalue().count("\n") == 1, err.writes
    assert err.getvalue().startswith("autotune plan: error: --device count after '*' in 'cpu*' is not a whole number")


def test_the_hosts_memory_running_out_outside_the_probes_bound_is_said_in_words(monkeypatch, capsys):
    """A MemoryError where the probe does not bound the host's memory (an import, the user's own code) is one
    line with what this process may still have and the fix, exit 1, not an internal error."""
    from autotune.cli import devices_cmd

    def out_of_memory(args):
        raise MemoryError

    monkeypatch.setattr(devices_cmd, "run", out_of_memory)
    assert main(["devices"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autotune devices: error: the host ran out of memory for this process (") and \
        "available to it): raise its limit (ulimit -v, the memory cgroup's memory.max)" in err, err
    assert "internal error" not in err and err.count("\n") == 1
