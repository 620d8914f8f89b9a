"""Progress through the autotune logger: status lines in place on a terminal, plain lines when piped."""

from __future__ import annotations

import io
import logging

from autotune import log
from autotune.cli import main
from autotune.cli.progress import StderrProgress, progress_on_stderr


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _emit(handler: StderrProgress, message: str, transient: bool = False) -> None:
    record = logging.LogRecord("autotune", logging.INFO, __file__, 0, message, (), None)
    setattr(record, log.TRANSIENT, transient)
    handler.handle(record)


def test_a_terminal_sees_status_lines_overwritten_in_place(monkeypatch):
    stream = Tty()
    monkeypatch.setattr("sys.stderr", stream)
    handler = StderrProgress(logging.INFO)
    _emit(handler, "real run at micro-batch 1024: micro-step 1/4", transient=True)
    _emit(handler, "real run at micro-batch 1024: micro-step 2/4", transient=True)
    _emit(handler, "real at micro-batch 1024: peak 2.0 MiB, fits")
    text = stream.getvalue()
    assert text.count("\r\x1b[2K") == 3 and text.count("\n") == 1  # two status updates, cleared, one line
    assert text.endswith("  real at micro-batch 1024: peak 2.0 MiB, fits\n")


def test_piped_output_gets_plain_lines_no_more_than_every_few_seconds(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    now = [100.0]
    handler = StderrProgress(logging.INFO, clock=lambda: now[0])
    _emit(handler, "real run at micro-batch 1024 ...")
    for step in range(1, 5):
        now[0] += 1.5
        _emit(handler, f"micro-step {step}/4", transient=True)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == ["  real run at micro-batch 1024 ...", "  micro-step 2/4", "  micro-step 4/4"]


def test_a_real_run_reports_its_micro_steps_to_the_logger(caplog):
    import autotune

    with caplog.at_level(logging.INFO, logger="autotune"):
        autotune.probe("mlp", device="cpu", memory_budget="4MB", max_batch=512)
    messages = [r.getMessage() for r in caplog.records]
    assert any("micro-step 4/4" in m for m in messages), messages
    assert any(getattr(r, log.TRANSIENT, False) for r in caplog.records)


def test_quiet_shows_warnings_only_and_verbose_shows_detail(capsys):
    logger = logging.getLogger("autotune")
    with progress_on_stderr(quiet=True):
        log.progress("hidden")
        logger.warning("shown")
    with progress_on_stderr(verbose=True):
        log.detail("detail shown")
    with progress_on_stderr():
        log.detail("detail hidden")
    err = capsys.readouterr().err
    assert "hidden" not in err.replace("detail hidden", "") and "warning: shown" in err
    assert "detail shown" in err and "detail hidden" not in err
    assert logger.handlers == [h for h in logger.handlers if not isinstance(h, StderrProgress)]


def test_the_cli_shows_progress_unless_quiet(capsys):
    argv = ["probe", "--probe", "mlp", "--device", "cpu", "--memory-budget", "4MB", "--max-batch", "64"]
    assert main(argv) == 0
    assert "real run at micro-batch" in capsys.readouterr().err
    assert main([*argv, "-q"]) == 0
    assert capsys.readouterr().err == ""
