"""The report of a run with a batch ramp: its phases, the plot of loss, effective batch and noise scale."""

from __future__ import annotations

import pytest

from autotune.devices import get_device
from autotune.report import load_result, write_report
from autotune.report.ramp import readings
from autotune.training.runner import run_plan

from ..heavy import watch
from ..training.ramp_workload import FAST, PLAN, regression

pytestmark = pytest.mark.slow  # a real run of 22 steps, then its report


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    result = run_plan(PLAN, regression(100.0), get_device("cpu", memory_budget=512 * 2**20), steps=22, ramp=FAST,
                      verify=False)
    assert len(result.batch_schedule) >= 3
    return result, write_report(result, tmp_path_factory.mktemp("ramp") / "report")


def test_the_report_shows_every_phase_and_the_plot(ramped):
    result, folder = ramped
    md = (folder / "report.md").read_text().replace("\\_", "_")
    section = md.split("\n## Batch ramp\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| from")]
    assert len(rows) == len(result.batch_schedule)
    for row, phase in zip(rows, result.batch_schedule):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == str(phase.first_step + 1) and cells[2] == str(phase.effective_batch)
        assert cells[6] == f"{phase.lr_scale:.3g}"
    assert "(batch_ramp.png)" in section and (folder / "batch_ramp.png").read_bytes()[:4] == b"\x89PNG"
    assert "batch_ramp.png: the loss, effective batch and noise scale" in md


def test_the_plotted_noise_scale_is_what_the_ramp_decided_from(ramped):
    result, _ = ramped
    seen = {step: (b, low) for step, b, low, _ in readings(result)}
    for phase in result.batch_schedule[1:]:  # decided after step first_step (1-based), from that reading
        assert seen[phase.first_step] == (pytest.approx(phase.b_simple), pytest.approx(phase.low))


def test_the_report_of_a_ramp_needs_no_torch(ramped, tmp_path):
    _, folder = ramped
    code = ("from autotune.report import load_result, write_report\n"
            f"write_report(load_result({str(folder / 'result.json')!r}), {str(tmp_path / 'x')!r})\n")
    watched = watch(code)
    assert watched.returncode == 0, watched.stderr[-2000:]
    assert watched.loaded == {}, f"writing the report of a ramp loaded {watched.chains()}"
    assert (tmp_path / "x" / "batch_ramp.png").is_file()
    assert load_result(tmp_path / "x" / "result.json") == load_result(folder / "result.json")
