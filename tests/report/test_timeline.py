"""The report's memory timeline: the parts table and the stacked plot over the fit rule's phases, real vs predicted
on a GPU, read back from the JSON, and seen in a real headless browser."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest

from autotune import api
from autotune.report import load_result, write_report
from autotune.results.timeline import RealTimeline
from autotune.units import format_bytes

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def plan():
    return api.plan(512, probe="mlp", device="estimate:H100-80GB", memory_snapshot=True)


@pytest.mark.slow  # one plan with a memory timeline (three estimates and replays)
def test_the_report_shows_the_parts_table_and_the_timeline_plot(plan, tmp_path):
    memory = plan.probe.memory
    assert memory is not None and memory.batch == plan.micro_batch
    folder = write_report(plan, tmp_path / "r")
    page = (folder / "report.html").read_text()
    section = page[page.index('<section id="timeline">'):]
    assert "What is live at the peak" in section and 'data-file="memory_timeline.png"' in section
    for part in memory.top(3):
        assert part.label.split(":")[0] in section
    assert (folder / "memory_timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "![Memory over the fit rule's phases](memory_timeline.png)" in (folder / "report.md").read_text()
    assert load_result(folder / "plan.json").probe.memory == memory  # the report is made from the JSON alone


def test_a_real_gpus_timeline_is_drawn_beside_the_prediction(plan, tmp_path):
    memory = plan.probe.memory
    real = RealTimeline(reserved_peak_bytes=memory.reserved_peak_bytes + 2**21, requested_peak_bytes=1,
                        predicted_reserved_peak_bytes=memory.reserved_peak_bytes, real=((1, 2**21, 1), (2, 2**22, 2)),
                        predicted=((1, 2**21, 1), (2, 2**21, 2)), snapshot_file="m.real.pickle")
    probe = dataclasses.replace(plan.probe, memory=dataclasses.replace(memory, real=real))
    folder = write_report(dataclasses.replace(plan, probe=probe), tmp_path / "r")
    page = (folder / "report.html").read_text()
    assert 'data-file="memory_real_vs_predicted.png"' in page and "+2,097,152 bytes at the peak" in page


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium)")
def test_a_headless_browser_shows_the_table_and_the_plot(plan, tmp_path):
    from matplotlib.image import imread

    folder = write_report(plan, tmp_path / "r")
    page = (folder / "report.html").read_text()
    start = page.index('<section id="timeline">')
    only = page[:page.index("<h1>")] + page[start:page.index("</section>", start)] + "</section></body></html>"
    (folder / "timeline.html").write_text(only)
    shot = tmp_path / "shot.png"
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                           "--window-size=1000,1600", (folder / "timeline.html").as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.exists(), done.stderr[-500:]
    pixels = imread(shot)
    red = ((abs(pixels[..., 0] - 0xc4 / 255) < 0.03) & (abs(pixels[..., 1] - 0x4e / 255) < 0.03)).sum()
    assert red > 500, "the stacked plot's activations (red) are not on the page"
    grid = (pixels[..., :3].sum(axis=2) < 2.4).sum()
    assert grid > 5000, "nothing drawn: the table and the plot are missing"


@pytest.mark.slow  # the plan fixture's first use in a run
def test_the_report_names_fragmentation_and_the_cached_free_blocks_apart(plan, tmp_path):
    """Fragmentation is the reserved peak minus the allocated peak wherever the report says it; the cache at the
    reserved peak is the cached free blocks."""
    folder = write_report(plan, tmp_path / "r")
    markdown = (folder / "report.md").read_text()
    cache = next(p for p in plan.probe.memory.parts if p.kind == "cache")
    (row,) = [line for line in markdown.splitlines() if line.startswith("| cached free blocks |")]
    assert format_bytes(cache.bytes) in row and "fragmentation" not in row
    assert "fragmentation: the reserved peak minus the allocated peak" in markdown
    said = [line for line in markdown.splitlines() if "fragmentation " in line and "MiB" in line]
    assert said and all(f"fragmentation {format_bytes(plan.probe.fragmentation_bytes)}" in line for line in said)


@pytest.mark.slow  # a probe and a timeline past the capacity, a report with its plot
def test_a_size_past_the_capacity_is_reported_as_not_fitting_with_the_demand_at_the_error(tmp_path):
    result = api.probe("mlp", device="estimate", memory_budget="1GiB", max_batch=512, memory_snapshot=True,
                       at=400_000)
    oom = result.memory.out_of_memory
    folder = write_report(result, tmp_path / "r")
    markdown = (folder / "report.md").read_text()
    section = markdown[markdown.index("Memory timeline"):]
    assert "Micro-batch 400000 does not fit: the simulated GPU (capacity 384.0 MiB) runs out of memory" in section
    assert "What is live at the out-of-memory error" in section and "What is live at the peak" not in section
    request = next(line for line in section.splitlines() if line.startswith("| the request, activations of"))
    assert format_bytes(oom.requested_bytes) in request
    assert "| out of memory |" in section  # the settings compared: none reserves a figure past the error
    assert load_result(folder / "probe.json").memory == result.memory
