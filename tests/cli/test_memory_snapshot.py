"""``--memory-snapshot FILE`` and ``--at N`` on the command line: the file torch's viewer opens, the lines printed,
a size that fits and one that does not, and bad input (one line, exit 2, before any work)."""

from __future__ import annotations

import json
import pickle

import pytest
from torch.cuda import _memory_viz as viz

from autotune.cli import main
from autotune.devices import snapshot as snap
from autotune.units import format_bytes

H100 = ["--probe", "mlp", "--device", "estimate:H100-80GB", "--quiet"]
SMALL = ["--probe", "mlp", "--device", "estimate", "--memory-budget", "1GiB", "--max-batch", "512", "--quiet"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def opened(path) -> dict:
    """The file as torch's _memory_viz CLI reads it (pickle.load), checked by the viewer's own accounting."""
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert set(data) >= {"segments", "device_traces"}
    assert "total_reserved" in viz.segsum(data) and "entries" in viz.trace(data)
    return data


def memory_lines(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("memory at micro-batch"))
    return lines[start:]


@pytest.mark.slow  # the process's first estimate loads torch's dispatch machinery (~2 s); a timeline, 5 estimates
def test_probe_writes_the_snapshot_and_prints_where_the_peak_comes_from(capsys, tmp_path):
    path, result = tmp_path / "mlp.pickle", tmp_path / "probe.json"
    code, out, err = run(capsys, "probe", *H100, "--max-batch", "512", "--memory-snapshot", path, "--output", result)
    assert (code, err) == (0, "")
    data = json.loads(result.read_text())
    reserved, _ = snap.peaks(opened(path))
    assert reserved == data["peak_bytes"] == data["memory"]["reserved_peak_bytes"]
    assert data["memory"]["snapshot_file"] == str(path) and data["memory"]["batch"] == data["max_micro_batch"] == 512
    lines = memory_lines(out)
    assert lines[0].startswith(f"memory at micro-batch 512: reserved peak {format_bytes(reserved)} in ")
    assert lines[0].endswith("largest parts:") and lines[1].startswith("  ")
    assert any(line.startswith("allocator settings: ") or line.startswith("with PYTORCH_ALLOC_CONF=")
               for line in lines)
    assert lines[-1] == (f"memory snapshot: {path} (python -m torch.cuda._memory_viz trace_plot {path} -o "
                         "memory.html, or pytorch.org/memory_viz)")


@pytest.mark.slow
def test_one_name_per_quantity_fragmentation_is_reserved_peak_minus_allocated_peak(capsys, tmp_path):
    """Two figures, two names: fragmentation (the reserved peak minus the allocated peak, two moments) and the
    cached free blocks at the moment the breakdown is of (a part of it). That moment is the most allocated while
    the reserved peak is held: where the allocated peak lies inside that plateau, as here, the figures agree."""
    result = tmp_path / "probe.json"
    code, out, _ = run(capsys, "probe", *H100, "--max-batch", "512", "--memory-snapshot", tmp_path / "m.pickle",
                       "--output", result)
    data = json.loads(result.read_text())
    fragmentation = format_bytes(data["fragmentation_bytes"])
    (cache,) = [p for p in data["memory"]["parts"] if p["kind"] == "cache"]
    assert cache["bytes"] == data["fragmentation_bytes"] == data["memory"]["reserved_peak_bytes"] - \
        data["memory"]["allocated_peak_bytes"]
    said = [line for line in out.splitlines() if "fragmentation" in line]
    assert len(said) >= 2 and all(f"fragmentation {fragmentation}" in line for line in said), said
    assert f"fragmentation {fragmentation} (reserved peak minus allocated peak" in out
    (part,) = [line for line in out.splitlines() if line.startswith("  ") and format_bytes(cache["bytes"]) in line]
    assert part.startswith("  cached free blocks: ")


@pytest.mark.slow
def test_plan_writes_the_snapshot_at_its_micro_batch_and_at_n(capsys, tmp_path):
    path = tmp_path / "plan.pickle"
    code, out, err = run(capsys, "plan", "--target-batch", "1000", *H100, "--memory-snapshot", path)
    assert (code, err) == (0, "")
    assert "1000 = 1000 x 1 step x 1 rank" in out
    reserved, _ = snap.peaks(opened(path))
    assert memory_lines(out)[0].startswith(f"memory at micro-batch 1000: reserved peak {format_bytes(reserved)} in ")
    code, out, err = run(capsys, "plan", "--target-batch", "1000", *H100, "--memory-snapshot", path, "--at", "64",
                         "--json")
    assert (code, err) == (0, "")
    memory = json.loads(out)["probe"]["memory"]
    assert memory["batch"] == 64 and memory["reserved_peak_bytes"] == snap.peaks(opened(path))[0]
    assert memory["out_of_memory"] is None


@pytest.mark.slow
def test_at_a_size_that_fits_records_that_size(capsys, tmp_path):
    path = tmp_path / "at.pickle"
    code, out, err = run(capsys, "probe", *SMALL, "--memory-snapshot", path, "--at", "100")
    assert (code, err) == (0, "")
    reserved, _ = snap.peaks(opened(path))
    lines = memory_lines(out)
    assert lines[0].startswith(f"memory at micro-batch 100: reserved peak {format_bytes(reserved)} in ")
    assert not any("out of memory" in line for line in lines)
    # the probe's own figures are the max's (512), not --at's: they say so
    (live,) = [line for line in out.splitlines() if line.startswith("live tensors")]
    assert live.startswith("live tensors at the allocated peak of micro-batch 512 (the max; micro-batch 100's memory "
                           "is below): ")
    (cache,) = [line for line in out.splitlines() if "caching allocator (simulated)" in line]
    assert cache.startswith("at micro-batch 512 (the max), caching allocator (simulated): reserved peak ")


@pytest.mark.slow
def test_at_a_size_past_the_capacity_says_it_does_not_fit_and_what_it_would_need(capsys, tmp_path):
    path = tmp_path / "oom.pickle"
    code, out, err = run(capsys, "probe", *SMALL, "--memory-snapshot", path, "--at", "400000")
    assert (code, err) == (0, "")
    data = opened(path)
    (oom,) = [e for e in data["device_traces"][0] if e["action"] == "oom"]
    lines = memory_lines(out)
    assert lines[0].startswith("memory at micro-batch 400000: does not fit: the simulated GPU (capacity 384.0 MiB) "
                               "runs out of memory in micro-step 1 forward")
    assert f"asking for {format_bytes(oom['size'])}" in lines[0]
    assert "it would need at least" in lines[0]
    assert not any("cached free blocks" in line and "(99%)" in line for line in lines)
    assert not any("optimizer step 1" in line for line in lines[:2])
    assert not any("a smaller model state would" in line for line in lines)
    code, out, err = run(capsys, "plan", "--target-batch", "1000", *SMALL[:-3], "--quiet", "--memory-snapshot", path,
                         "--at", "400000", "--json")
    assert (code, err) == (0, "")
    failed = json.loads(out)["probe"]["memory"]["out_of_memory"]
    assert failed["requested_bytes"] == oom["size"] and failed["phase"] == "micro-step 1 forward"
    assert failed["needed_bytes"] > failed["capacity_bytes"] == 384 << 20


def test_on_the_cpu_a_size_past_the_budget_says_it_does_not_fit_and_names_the_probes_max(capsys, tmp_path):
    """The CPU's timeline is the tracker's (no allocator simulated): a live peak above the budget does not fit,
    and what lowers it is the probe's max, not half of a size that is still over."""
    code, out, err = run(capsys, "probe", "--probe", "mlp", "--device", "cpu", "--memory-budget", "8MiB", "--quiet",
                         "--memory-snapshot", tmp_path / "cpu.pickle", "--at", "20000")
    assert (code, err) == (0, "")
    lines = memory_lines(out)
    assert lines[0].startswith("memory at micro-batch 20000: does not fit: the 8.0 MiB capacity runs out before it "
                               "(the device stops the fit rule with its out-of-memory error there), live peak ")
    assert any(", the probe's max: peak " in line for line in lines) and "micro-batch 10000" not in out


@pytest.mark.parametrize("command", [["probe"], ["plan", "--target-batch", "64"]])
@pytest.mark.parametrize("flags,words", [
    (["--memory-snapshot", "m.pickle", "--at", "0"], "--at 0 must be at least 1"),
    (["--memory-snapshot", "m.pickle", "--at", "x"], "--at 'x' is not a whole number"),
    (["--at", "4"], "--at N is the micro-batch of --memory-snapshot: add --memory-snapshot FILE, or drop --at"),
    (["--memory-snapshot", "/no/such/folder/m.pickle"],
     "cannot write the --memory-snapshot file /no/such/folder/m.pickle: folder /no/such/folder does not exist"),
    (["--memory-snapshot", "DIR"], "it is a folder; give a file path, e.g. DIR/memory.pickle"),
])
def test_bad_snapshot_flags_are_one_line_and_exit_2(capsys, tmp_path, command, flags, words):
    code, out, err = run(capsys, *command, *H100, *[tmp_path if f == "DIR" else f for f in flags])
    lines = err.strip().splitlines()
    assert (code, out) == (2, "") and len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith(f"autotune {command[0]}: error: ") and words.replace("DIR", str(tmp_path)) in lines[0]
