"""--store on the command line, and autotune store ls|show|rm|gc."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from autotune.cli import main

from ..stores import GATED, execute, rows

ESTIMATE = ["--probe", "mlp", "--device", "estimate", "--memory-budget", "1GiB"]
CPU = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def url(store_url) -> str:
    """A new store's URL, on SQLite and on PostgreSQL."""
    return store_url


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
def test_four_jobs_at_once_probe_once_and_print_the_same_plan(url, tmp_path):
    """Four jobs (each a Python process importing torch) are enough for three to wait on the one that probes;
    more would repeat the same waits."""
    import threading
    import time

    (tmp_path / "gated.py").write_text(GATED)
    gate = tmp_path / "go"
    argv = [sys.executable, "-m", "autotune", "plan", "--target-batch", "512", "--probe", str(tmp_path / "gated.py"),
            "--device", "estimate", "--memory-budget", "1GiB", "--store", url]
    env = {**os.environ, "AUTOTUNE_TEST_GATE": str(gate)}
    env.pop("AUTOTUNE_STORE", None)
    jobs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(4)]
    errs: list[list[str]] = [[] for _ in jobs]
    readers = [threading.Thread(target=lambda job=job, lines=lines: lines.extend(job.stderr), daemon=True)
               for job, lines in zip(jobs, errs)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 280  # within the gate's 300 s
    while sum(any("waiting for process" in line for line in lines) for lines in errs) < 3:  # all wait for one
        assert time.monotonic() < deadline and all(job.poll() is None for job in jobs), errs
        time.sleep(0.1)
    gate.touch()
    outs = [job.stdout.read() for job in jobs]
    assert [job.wait(240) for job in jobs] == [0] * 4, errs
    for reader in readers:
        reader.join(30)
    probed = ["".join(lines).count("estimate at micro-batch 2:") for lines in errs]
    assert sorted(probed) == [0] * 3 + [1], errs
    assert sum("from the store (fingerprint " in out for out in outs) == 3, outs
    assert len({out.splitlines()[0] for out in outs}) == 1 and outs[0].startswith("plan: 512 = "), outs
    (hits,) = rows(url, "autotune_entries", "hits")
    assert hits == (3,) and rows(url, "autotune_claims") == []


def test_probe_json_says_where_the_answer_came_from(capsys, url):
    code, out, _ = run(capsys, "probe", *CPU, "--store", url, "--json")
    first = json.loads(out)
    assert code == 0 and first["from_store"] is False and len(first["fingerprint"]) == 64
    code, out, _ = run(capsys, "probe", *CPU, "--store", url, "--json")
    second = json.loads(out)
    assert code == 0 and second["from_store"] is True and second["fingerprint"] == first["fingerprint"]
    assert second["notes"][0].startswith("from the store")


def test_a_smaller_target_is_answered_from_the_memory_limit_found_before(capsys, url):
    argv = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "8MiB", "--store", url, "--json"]
    plans = [json.loads(run(capsys, "plan", "--target-batch", str(t), *argv)[1]) for t in (2048, 100)]
    assert [p["probe"]["from_store"] for p in plans] == [False, True]
    assert plans[0]["probe"]["limited_by"] == "memory" and plans[1]["micro_batch"] == 100
    code, out, _ = run(capsys, "store", "ls", "--store", url, "--json")
    assert [(e["max_micro_batch"], e["limited_by"], e["hits"]) for e in json.loads(out)] == [(1419, "memory", 1)]


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
    assert code == 0 and f"fingerprint {entry['fingerprint']}" in out and "; served 1 time, last " in out
    assert "ops:" in out and "1021 = " in out and "confirm" in out and " run " in out
    code, out, _ = run(capsys, "store", "show", "--store", url)
    assert code == 0 and "measured vs estimated peak, per device" in out and "cpu" in out
    assert f"{url}: 1 entry, 1 plan, " in out
    code, out, _ = run(capsys, "store", "show", "--store", url, "--json")
    summary = json.loads(out)
    assert summary["entries"] == 1 and summary["accuracy"][0]["measurements"] >= 3
    code, out, _ = run(capsys, "store", "gc", "--dry-run", "--older-than", "0", "--store", url)
    assert code == 0 and out.startswith("would remove 1 entry, 1 plan, ") and out.endswith(", 0 claims\n")
    code, out, _ = run(capsys, "store", "rm", short, short, entry["fingerprint"], "--store", url)
    assert code == 0 and out == f"removed 1 entry: {short}\n"  # named three times, listed once
    code, out, _ = run(capsys, "store", "ls", "--store", url)
    assert "holds no entries" in out


def test_text_clients_sent_reaches_the_terminal_escaped(capsys, url):
    from autotune.store import Observation, open_store

    code, out, _ = run(capsys, "plan", "--target-batch", "64", *CPU, "--store", url, "--json")
    digest = json.loads(out)["probe"]["fingerprint"]
    open_store(url).record(Observation(  # as POST /v1/measurements may send it
        fingerprint=digest, source="reported", device="\x1b[31mNVIDIA A100\x9b0m", device_kind="cuda", batch=8,
        peak_reserved_bytes=1000, note="\x1b]52;c;cm0gLXJmIC8=\x07<img src=x>\u202eRED\x1b[0m"))
    execute(url, "UPDATE autotune_entries SET workload = :name", name="mlp\x1b[2J")  # a row changed by hand
    for argv in (["show", digest[:12]], ["show"], ["ls"]):
        code, out, err = run(capsys, "store", *argv, "--store", url)
        assert code == 0 and not any(ch in out for ch in "\x1b\x07\x9b\u202e"), (argv, out)
        assert ("\\x1b[31mNVIDIA A100\\x9b0m" if argv[0] == "show" else "mlp\\x1b[2J") in out
    code, out, _ = run(capsys, "store", "show", digest[:12], "--store", url)
    assert "\\x1b]52;c;cm0gLXJmIC8=\\x07<img src=x>\\u202eRED\\x1b[0m" in out
    code, out, _ = run(capsys, "store", "show", digest[:12], "--store", url, "--json")
    assert json.loads(out)["measurements"][-1]["device"] == "\x1b[31mNVIDIA A100\x9b0m"  # JSON keeps it, escaped


@pytest.fixture
def made(url) -> str:
    """A store that exists (empty)."""
    from autotune.store.store import Store

    Store(url).close()
    return url


@pytest.mark.parametrize("argv,code,words", [
    (["store", "ls"], 2, "autotune store needs --store URL"),
    (["store", "show", "zz", "--store", "URL"], 2, "at least 6 hex digits"),
    (["store", "rm", "abcdef", "--store", "URL"], 2, "no entry with fingerprint abcdef"),
    (["store", "gc", "--older-than", "-3", "--store", "URL"], 2, "--older-than -3 must be a number of days"),
    (["store", "ls", "--store", "sqlite://"], 2, "--store 'sqlite://': no store there: an in-memory database"),
    (["plan", "--target-batch", "64", *CPU, "--store", "sqlite:////no/such/dir/p.db"], 2, "--store .* does not exist"),
    (["serve"], 2, "autotune serve needs --store URL"),
    (["serve", "--store", "URL", "--host", "0.0.0.0"], 2, "--host 0.0.0.0 is reachable from other machines"),
    (["serve", "--store", "URL", "--port", "70000"], 2, "--port 70000 must be a port number"),
    (["serve", "--store", "sqlite://"], 2, "--store 'sqlite://' is an in-memory database, private to each "
                                           "connection: .* give a file, e.g. --store sqlite:///plans.db"),
    (["serve", "--store", "sqlite:///:memory:"], 2, "is an in-memory database"),
])
def test_bad_store_commands_are_one_line_errors(capsys, monkeypatch, made, argv, code, words):
    import re

    import uvicorn

    monkeypatch.delenv("AUTOTUNE_STORE", raising=False)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: None)  # a command that would serve returns
    got, _, err = run(capsys, *[made if a == "URL" else a for a in argv])
    assert got == code and re.search(words, err), err
    assert len(err.strip().splitlines()) == 1


def test_a_short_token_is_refused(capsys, made, tmp_path):
    token = tmp_path / "token"
    token.write_text("short\n")
    got, _, err = run(capsys, "serve", "--store", made, "--token-file", str(token))
    assert got == 2 and "at least 16 characters" in err


@pytest.mark.parametrize("action", [["ls"], ["show"], ["show", "abcdef12"], ["rm", "abcdef12"], ["gc"]])
def test_store_commands_never_make_a_store(capsys, tmp_path, action):
    typo = tmp_path / "typo.db"
    got, _, err = run(capsys, "store", *action, "--store", f"sqlite:///{typo}")
    assert got == 2 and f"no store there ({typo} does not exist)" in err, err
    assert not typo.exists()


def _damage(url: str, **values) -> None:
    """Plant a fault: change every entry's row behind the store's back."""
    from sqlalchemy import update

    from autotune.store import open_store, schema

    with open_store(url).engine.begin() as conn:
        conn.execute(update(schema.entries).values(**values))


@pytest.mark.parametrize("damage", ["{not json", "{}"])
def test_a_damaged_entry_is_listed_shown_removed_and_probed_again(capsys, url, damage):
    code, out, _ = run(capsys, "plan", "--target-batch", "64", *CPU, "--store", url, "--json")
    digest = json.loads(out)["probe"]["fingerprint"]
    _damage(url, probe=damage)
    code, out, err = run(capsys, "store", "ls", "--store", url)
    assert code == 0 and "damaged" in out, err
    assert "1 damaged entry (cannot be read back; each is probed again when next asked for)" in out
    assert f"autotune store rm {digest[:12]}" in out
    code, out, err = run(capsys, "store", "show", digest[:8], "--store", url)
    assert code == 0 and "damaged: its probe result cannot be read" in out, err
    code, out, _ = run(capsys, "store", "show", "--store", url, "--json")
    assert json.loads(out)["damaged"] == 1
    code, out, err = run(capsys, "plan", "--target-batch", "64", *CPU, "--store", url)
    assert code == 0 and "from the store" not in out, err
    assert f"the store's entry {digest[:12]} is damaged (its probe result cannot be read" in err
    code, out, _ = run(capsys, "store", "ls", "--store", url)
    assert "damaged" not in out and "served" in out  # replaced
    _damage(url, probe=damage)
    code, out, _ = run(capsys, "store", "rm", digest[:12], "--store", url)
    assert code == 0 and f"removed 1 entry: {digest[:12]}" in out


@pytest.mark.parametrize("value", ["abc", "0"])
@pytest.mark.parametrize("argv", [["store", "ls"], ["store", "gc", "--dry-run"], ["store", "migrate"],
                                  ["plan", "--target-batch", "64", *CPU]])
def test_a_damaged_layout_row_is_a_one_line_error(capsys, made, argv, value):
    from sqlalchemy import update

    from autotune.store import open_store, schema

    store = open_store(made)
    with store.engine.begin() as conn:
        conn.execute(update(schema.info).where(schema.info.c.key == "schema").values(value=value))
    store.close()
    got, _, err = run(capsys, *argv, "--store", made)
    assert got == 2 and f"is damaged: its layout row (autotune_store_info 'schema') holds {value!r}" in err, err
    assert len(err.strip().splitlines()) == 1


@contextlib.contextmanager
def _as_another_user():
    """Run the block as a user who may read the test's files but not write them. Root may write any file,
    so root runs it as ``nobody``, who reaches no module not imported before."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_a_read_only_store_is_listed(capsys):
    folder = Path(tempfile.mkdtemp(prefix="autotune-ro-"))  # reachable by another user, unlike tmp_path
    url = f"sqlite:///{folder / 'plans.db'}"
    try:
        folder.chmod(0o755)
        run(capsys, "plan", "--target-batch", "64", *ESTIMATE, "--store", url, "--quiet")
        run(capsys, "store", "ls", "--store", url)  # the modules listing needs, imported
        run(capsys, "store", "rm", "abcdef", "--store", url)
        from autotune.store import store as module

        for opened in list(module._OPEN.values()):
            opened.close()  # the last connection gone, SQLite removes the files it shares with writers
        assert [p.name for p in folder.iterdir()] == ["plans.db"]
        (folder / "plans.db").chmod(0o444)
        folder.chmod(0o555)
        with _as_another_user():
            listed = run(capsys, "store", "ls", "--store", url)
            removed = run(capsys, "store", "gc", "--older-than", "0", "--store", url)
        assert listed[0] == 0 and "mlp" in listed[1] and "served" in listed[1], listed
        assert removed[0] == 2 and "is read-only here" in removed[2], removed
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_serve_help_shows_a_postgresql_deployment_with_two_replicas(capsys):
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0 and "pip install 'autotune[serve,postgres]'" in out
    assert "AUTOTUNE_STORE=postgresql://" in out and "/metrics" in out
    replicas = [line for line in out.splitlines() if line.strip().startswith("autotune serve --host 0.0.0.0")]
    assert len(replicas) == 2 and "replica 1" in replicas[0] and "replica 2" in replicas[1]


def test_a_postgresql_store_connects_with_psycopg_or_says_how_to_get_it(monkeypatch):
    import importlib.util

    from autotune.dburl import check_storage, store_url
    from autotune.errors import BadInput

    assert store_url("postgresql://team@db.internal/plans") == "postgresql+psycopg://team@db.internal/plans"
    assert store_url("postgresql+psycopg2://db.internal/plans") == "postgresql+psycopg2://db.internal/plans"
    check_storage("postgresql://team:secret@db.internal/plans", "--store", store=True)  # connects to nothing
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as where no driver is installed
    for driver in ("psycopg", "psycopg2"):  # SQLAlchemy 2.1's default driver, and 2.0's
        monkeypatch.setitem(sys.modules, driver, None)
    with pytest.raises(BadInput, match=r"^--store 'postgresql://team:\*\*\*@db.internal/plans' needs the Python "
                                       r"driver psycopg2?, which is not installed: pip install 'autotune\[postgres\]'"):
        check_storage("postgresql://team:secret@db.internal/plans", "--store", store=True)
