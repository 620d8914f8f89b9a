"""A command that trains or estimates imports torch with the cyclic garbage collector paused; as the process's own
command it then freezes what the imports made, called as a function it leaves the collector as it was."""

from __future__ import annotations

import gc
import sys

import pytest

from autotune.cli import main

PROBE = ["probe", "--probe", "mlp", "--device", "estimate", "--memory-budget", "1GiB", "--quiet"]


@pytest.fixture
def freezes(monkeypatch) -> list[int]:
    """Each gc.freeze() call, with how many objects it froze."""
    calls: list[int] = []
    real = gc.freeze

    def freeze() -> None:
        before = gc.get_freeze_count()
        real()
        calls.append(gc.get_freeze_count() - before)

    monkeypatch.setattr(gc, "freeze", freeze)
    return calls


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_a_command_called_as_a_function_leaves_the_collector_as_it_was(capsys, freezes, enabled):
    if not enabled:
        gc.disable()
    try:
        assert main(PROBE) == 0
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert freezes == []
    capsys.readouterr()


def test_the_processs_own_command_freezes_what_its_imports_made(capsys, monkeypatch, freezes):
    # main() without argv takes the process as its own (here: this test worker, whose survivors the suite
    # freezes after each file anyway).
    monkeypatch.setattr(sys, "argv", ["autotune", *PROBE])
    assert main() == 0
    assert gc.isenabled() and len(freezes) == 1 and freezes[0] > 0
    capsys.readouterr()
