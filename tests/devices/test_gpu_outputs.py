"""The estimate's reserved peak is in every output: probe and plan text, JSON, the report, trials.csv;
results without the allocator figures (a device that has none) read them as None."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.results.probe import ProbeResult, Trial


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One estimate-only probe, its JSON written by the CLI."""
    path = tmp_path_factory.mktemp("probe") / "probe.json"
    assert main(["probe", "--probe", "mlp", "--device", "estimate:L4-24GB", "--memory-budget", "1GiB",
                 "--max-batch", "4096", "--output", str(path), "-q"]) == 0
    return path


def test_probe_json_has_reserved_allocated_fragmentation_and_retries(probed):
    data = json.loads(probed.read_text())
    assert data["allocated_peak_bytes"] is not None and data["alloc_retries"] == 0
    assert data["fragmentation_bytes"] == data["peak_bytes"] - data["allocated_peak_bytes"] > 0
    assert data["predicted_allocated_peak_bytes"] == data["allocated_peak_bytes"]  # estimated: the same run
    assert all(t["allocated_bytes"] is not None and t["retries"] == 0 for t in data["trials"])
    again = ProbeResult.from_dict(data)
    assert again.to_dict() == data


def test_probe_text_shows_the_allocator_figures(capsys):
    assert main(["probe", "--probe", "mlp", "--device", "estimate:L4-24GB", "--memory-budget", "1GiB",
                 "--max-batch", "4096", "-q"]) == 0
    out = capsys.readouterr().out
    assert "reserved peak" in out
    assert "caching allocator (simulated): reserved" in out and "fragmentation" in out and "release-and-retries" in out
    assert "reserved allocated retries" in out  # the trials table


def test_plan_text_shows_the_reserved_peak(capsys):
    assert main(["plan", "--target-batch", "10000", "--probe", "mlp", "--device", "estimate:L4-24GB",
                 "--memory-budget", "1GiB", "-q"]) == 0
    out = capsys.readouterr().out
    assert "memory: reserved peak" in out and "caching allocator (simulated): reserved" in out


def test_report_shows_the_allocator_figures(probed, tmp_path):
    from autotune.report import load_result, write_report

    folder = write_report(load_result(probed), tmp_path / "report")
    markdown = (Path(folder) / "report.md").read_text()
    assert "Caching allocator" in markdown and "fragmentation" in markdown
    assert "reserved peak" in markdown and "allocated" in markdown  # the trials table's columns
    header = (Path(folder) / "trials.csv").read_text().splitlines()[0]
    assert "allocated_bytes" in header and "retries" in header


def test_results_without_the_allocator_figures_read_them_as_none(probed):
    data = json.loads(probed.read_text())
    for key in ("allocated_peak_bytes", "alloc_retries", "predicted_allocated_peak_bytes", "fragmentation_bytes"):
        del data[key]
    for trial in data["trials"]:
        del trial["allocated_bytes"], trial["retries"]
    probe = ProbeResult.from_dict(data)
    assert probe.allocated_peak_bytes is None and probe.fragmentation_bytes is None
    assert probe.allocator_line() is None and {t.retries for t in probe.trials} == {None}
    assert Trial.from_dict({"batch": 1, "source": "real", "peak_bytes": 10, "fits": True, "seconds": 0.1}).retries \
        is None
