"""What people read: counts agree with their nouns, every flag has help, the probe flag says what it takes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from autotune.cli import main

MLP = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB"]
NOUNS = (r"(?:optimizer )?(?:steps|ranks|samples|items|checks|runs|trials|candidates|layers|rounds|micro-steps"
         r"|processes)")
ONE_PLURAL = re.compile(rf"(?<![\d.,])1 {NOUNS}\b|\b1 \w+\(s\)|\b1 \w+\(es\)")


@pytest.mark.parametrize("n,word,many,text", [
    (0, "step", None, "0 steps"), (1, "step", None, "1 step"), (2, "step", None, "2 steps"),
    (1, "process", "processes", "1 process"), (3, "process", "processes", "3 processes"),
    (1_000, "sample", None, "1000 samples"),
])
def test_plural(n, word, many, text):
    from autotune.units import plural

    assert plural(n, word, many) == text


@pytest.mark.slow  # a run and its report with plots
def test_one_of_anything_is_singular_in_every_output(capsys, tmp_path):
    folder = tmp_path / "report"
    code = main(["run", "--target-batch", "1", *MLP, "--steps", "1", "--report", str(folder)])
    out, err = capsys.readouterr()
    assert code == 0 and "for 1 step " in out
    texts = {"stdout": out, "stderr": err,
             **{name: (folder / name).read_text() for name in ("report.md", "report.html")}}
    for where, text in texts.items():
        assert ONE_PLURAL.findall(text) == [], where


def test_every_flag_has_help_and_probe_says_built_in_names_work():
    for command in ("plan", "probe", "run"):
        out = subprocess.run([sys.executable, "-m", "autotune", command, "--help"], capture_output=True, text=True,
                             check=True).stdout
        assert "--probe PROBE" in out and "--probe FILE" not in out, command
        assert re.search(r"--probe PROBE\s+.*built-in", out), command
    from autotune.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"autotune {name} {'/'.join(action.option_strings)} has no help"
