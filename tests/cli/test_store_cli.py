"""--store on the command line, and autotune store ls|show|rm|gc."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.cli import main

ESTIMATE = ["--probe", "mlp", "--device", "estimate", "--memory-budget", "1GiB"]
CPU = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'plans.db'}"


@pytest.mark.slow
def test_plan_twice_answers_the_second_from_the_store_without_estimating(capsys, url):
    code, first, err = run(capsys, "plan", "--target-batch", "512", *ESTIMATE, "--store", url)
    assert code == 0, err
    assert "estimate at micro-batch" in err and "from the store" not in first
    code, second, err = run(capsys, "plan", "--target-batch", "512", *ESTIMATE, "--store", url)
    assert code == 0, err
    assert "estimate at micro-batch" not in err, "the second plan estimated again"
    assert "from the store (fingerprint " in second and " measured " in second
    assert first.splitlines()[0] == second.splitlines()[0]  # the same plan


@pytest.mark.slow
def test_two_jobs_at_once_probe_once(url):
    argv = [sys.executable, "-m", "autotune", "plan", "--target-batch", "512", *ESTIMATE, "--store", url]
    jobs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [job.communicate(timeout=300) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [err for _, err in outs]
    probed = [err.count("estimate at micro-batch 2:") for _, err in outs]
    assert sorted(probed) == [0, 1], outs
    assert sum("from the store" in out for out, _ in outs) == 1


def test_probe_json_says_where_the_answer_came_from(capsys, url):
    code, out, _ = run(capsys, "probe", *CPU, "--store", url, "--json")
    first = json.loads(out)
    assert code == 0 and first["from_store"] is False and len(first["fingerprint"]) == 64
    code, out, _ = run(capsys, "probe", *CPU, "--store", url, "--json")
    second = json.loads(out)
    assert code == 0 and second["from_store"] is True and second["fingerprint"] == first["fingerprint"]
    assert second["notes"][0].startswith("from the store")


def test_the_environment_names_the_store(capsys, url, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_STORE", url)
    run(capsys, "plan", "--target-batch", "64", *CPU, "--quiet")
    code, out, _ = run(capsys, "store", "ls")
    assert code == 0 and "mlp" in out and "cpu" in out


def test_store_ls_show_rm_gc(capsys, url):
    run(capsys, "plan", "--target-batch", "1021", *CPU, "--store", url, "--quiet")
    run(capsys, "run", "--target-batch", "1021", *CPU, "--store", url, "--steps", "2", "--no-verify", "--quiet")
    code, out, _ = run(capsys, "store", "ls", "--store", url, "--json")
    (entry,) = json.loads(out)
    assert code == 0 and entry["max_micro_batch"] == 307 and entry["hits"] == 1 and entry["valid"]
    short = entry["fingerprint"][:12]
    code, out, _ = run(capsys, "store", "ls", "--store", url)
    assert short in out and "served" in out
    code, out, _ = run(capsys, "store", "show", short, "--store", url)
    assert code == 0 and f"fingerprint {entry['fingerprint']}" in out
    assert "ops:" in out and "1021 = " in out and "confirm" in out and " run " in out
    code, out, _ = run(capsys, "store", "show", "--store", url)
    assert code == 0 and "measured vs estimated peak, per device" in out and "cpu" in out
    code, out, _ = run(capsys, "store", "show", "--store", url, "--json")
    summary = json.loads(out)
    assert summary["entries"] == 1 and summary["accuracy"][0]["measurements"] >= 3
    code, out, _ = run(capsys, "store", "gc", "--dry-run", "--older-than", "0", "--store", url)
    assert code == 0 and "would remove 1 entries" in out
    code, out, _ = run(capsys, "store", "rm", short, "--store", url)
    assert code == 0 and f"removed 1 entry: {short}" in out
    code, out, _ = run(capsys, "store", "ls", "--store", url)
    assert "holds no entries" in out


@pytest.mark.parametrize("argv,code,words", [
    (["store", "ls"], 2, "autotune store needs --store URL"),
    (["store", "show", "zz", "--store", "sqlite://"], 2, "at least 6 hex digits"),
    (["store", "rm", "abcdef", "--store", "sqlite://"], 2, "no entry with fingerprint abcdef"),
    (["store", "gc", "--older-than", "-3", "--store", "sqlite://"], 2, "--older-than -3 must be a number of days"),
    (["plan", "--target-batch", "64", *CPU, "--store", "sqlite:////no/such/dir/p.db"], 2, "--store .* does not exist"),
    (["serve"], 2, "autotune serve needs --store URL"),
    (["serve", "--store", "sqlite://", "--host", "0.0.0.0"], 2, "--host 0.0.0.0 is reachable from other machines"),
    (["serve", "--store", "sqlite://", "--port", "70000"], 2, "--port 70000 must be a port number"),
])
def test_bad_store_commands_are_one_line_errors(capsys, monkeypatch, argv, code, words):
    import re

    monkeypatch.delenv("AUTOTUNE_STORE", raising=False)
    got, _, err = run(capsys, *argv)
    assert got == code and re.search(words, err), err
    assert len(err.strip().splitlines()) == 1


def test_a_short_token_is_refused(capsys, tmp_path):
    token = tmp_path / "token"
    token.write_text("short\n")
    got, _, err = run(capsys, "serve", "--store", "sqlite://", "--token-file", str(token))
    assert got == 2 and "at least 16 characters" in err


_HEAVY = """
import json, sys
from autotune.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "fastapi", "uvicorn", "pandas")
                                                if m in sys.modules)}), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["store", "--help"], ["serve", "--help"], ["store", "ls", "--store",
                                                                                          "sqlite://"]])
def test_the_store_commands_load_no_heavy_library(argv):
    done = subprocess.run([sys.executable, "-c", _HEAVY, *argv], capture_output=True, text=True, timeout=120)
    seen = json.loads(done.stderr.strip().splitlines()[-1])
    assert seen == {"code": 0, "heavy": []}, done.stderr
