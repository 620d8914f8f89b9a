"""Files autotune writes (--output, --report): checked before any work, written like any other file
(umask, an existing file's mode, a symlink kept), never left half-written by SIGTERM or a racing writer."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from autotune import api as pipeline
from autotune.cli import main
from autotune.errors import BadInput
from autotune.report.folder import write_folder
from autotune.serial import write_atomic

MLP = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB", "--quiet"]
NO_PROBE = ["--probe", "no_such_probe_file.py", "--device", "cpu", "--memory-budget", "3MB", "--quiet"]
COMMANDS = {"plan": ["plan", "--target-batch", "64"], "probe": ["probe"], "run": ["run", "--target-batch", "64"]}


def _outputs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """--output values that cannot be written, and the words their error must hold."""
    (tmp_path / "a-folder").mkdir()
    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0o444)
    return {
        "missing folder": (str(tmp_path / "no" / "plan.json"), "does not exist"),
        "a folder": (str(tmp_path / "a-folder"), "is a folder"),
        "unwritable folder": ("/proc/plan.json", "is not writable"),
        "read-only file": (str(locked), "is read-only"),
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc as a folder no one can write")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unwritable_output_is_found_before_any_work(capsys, tmp_path, command):
    for case, (path, words) in _outputs(tmp_path).items():
        # a probe that cannot load: any work before the check would fail on it first
        code = main([*COMMANDS[command], *NO_PROBE, "--output", path])
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1, (case, err)
        assert f"--output {path}" in lines[0] and words in lines[0], (case, lines[0])


def test_a_written_file_gets_the_umask_mode_and_an_existing_file_keeps_its_own(tmp_path):
    old = os.umask(0o027)
    try:
        fresh = write_atomic(tmp_path / "fresh.json", "{}\n")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o640
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        kept.chmod(0o604)
        write_atomic(kept, "new")
        assert kept.read_text() == "new" and stat.S_IMODE(kept.stat().st_mode) == 0o604
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_at_the_output_path_stays_a_link_and_its_target_is_replaced(tmp_path, dangling):
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "plan.json"
    if not dangling:
        target.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(os.path.relpath(target, tmp_path))
    write_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == os.path.relpath(target, tmp_path)
    assert target.read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["plan.json"]


def test_an_output_that_fails_at_the_end_still_prints_the_result_first(capsys, tmp_path, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    real = pipeline.plan_for

    def plan_then_folder_vanishes(*args, **kwargs):
        made = real(*args, **kwargs)
        shutil.rmtree(folder)  # another process removed it while autotune worked
        return made

    monkeypatch.setattr(pipeline, "plan_for", plan_then_folder_vanishes)
    code = main(["plan", "--target-batch", "1021", *MLP, "--output", str(folder / "plan.json")])
    out, err = capsys.readouterr()
    assert code == 2 and "1021 = 3 x 255 + 1 x 256" in out
    assert err.count("\n") == 1 and f"--output {folder / 'plan.json'}" in err


_SLOW_REPORT = """
import sys, time
from pathlib import Path
from autotune.report.folder import write_folder

def fill(tmp):
    (tmp / "report.html").write_text("half")
    print("writing", flush=True)
    time.sleep(60)

write_folder(Path(sys.argv[1]), fill, force=True)
"""


@pytest.mark.parametrize("existing", [False, True])
def test_sigterm_while_a_report_is_written_leaves_no_temporary_folder(tmp_path, existing):
    out = tmp_path / "rep"
    if existing:
        out.mkdir()
        (out / "report.html").write_text("the old report")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_REPORT, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "writing\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # still ends as SIGTERM ends a process
    assert sorted(p.name for p in tmp_path.iterdir()) == (["rep"] if existing else [])
    if existing:
        assert (out / "report.html").read_text() == "the old report"


@pytest.mark.slow
def test_concurrent_forced_swaps_leave_one_whole_report_and_nothing_else(tmp_path):
    out = tmp_path / "rep"
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        def fill(tmp: Path) -> None:
            for name in ("report.html", "report.md", "plan.json"):
                (tmp / name).write_text(f"writer {n}")
        for _ in range(40):
            try:
                write_folder(out, fill, force=True)
            except BaseException as exc:  # noqa: BLE001 - every failure is what this test counts
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]
    texts = {(out / name).read_text() for name in ("report.html", "report.md", "plan.json")}
    assert len(texts) == 1  # all three files from one writer


def test_write_atomic_refuses_a_folder(tmp_path):
    with pytest.raises(BadInput, match="is a folder"):
        write_atomic(tmp_path, "x")
