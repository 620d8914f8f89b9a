"""Memory snapshots in torch's format: rendered by torch's own _memory_viz, the reserved peak to the byte, frames
into the user's file, the peak's parts, allocator advice on a fragmenting workload, and a real GPU's snapshot
recorded beside the prediction (with fakes of torch.cuda.memory)."""

from __future__ import annotations

import base64
import pickle
import re
from pathlib import Path

import pytest
from torch.cuda import _memory_viz as viz

from autotune import api
from autotune.devices import EstimateDevice, get_device
from autotune.devices import snapshot as snap
from autotune.devices.history import RecordingDevice
from autotune.probing import timeline as tl
from autotune.probing.memory import compare_real
from autotune.workload import load_workload

HERE = Path(__file__).parent
H100 = "estimate:H100-80GB"


def viewer_walk(snapshot: dict) -> tuple[int, int]:
    """What MemoryViz.js's segment view does (torch/utils/viz/MemoryViz.js, ``simulate_memory`` then ``draw``):
    from the end state, walk the trace backwards; at every entry each live block must lie in a segment (the
    viewer draws it there, and fails without one). Returns (highest reserved, entries walked)."""
    segments = {s["address"]: s["total_size"] for s in snapshot["segments"] if s["device"] == 0}
    blocks = {}
    for s in snapshot["segments"]:
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                blocks[addr] = b["size"]
            addr += b["size"]
    trace = snapshot["device_traces"][0]
    top = 0
    for e in reversed(trace):
        for addr in blocks:
            assert any(a <= addr < a + n for a, n in segments.items()), f"block {addr:#x} outside every segment at {e}"
        top = max(top, sum(segments.values()))
        action = e["action"]
        if action == "free_completed":
            blocks[e["addr"]] = e["size"]
        elif action == "alloc":
            del blocks[e["addr"]]
        elif action in ("segment_free", "segment_unmap"):
            segments[e["addr"]] = e["size"]
        elif action in ("segment_alloc", "segment_map"):
            del segments[e["addr"]]
    assert not blocks and not segments, "the trace does not start from an empty allocator"
    return top, len(trace)


def rendered(snapshot: dict) -> None:
    """Render with torch's _memory_viz as its CLI does: trace_plot (allocations and segments), segment_plot,
    stats (segsum checks its own accounting) and trace; the pages carry the pickled snapshot unchanged."""
    for html in (viz.trace_plot(snapshot), viz.trace_plot(snapshot, plot_segments=True), viz.segment_plot(snapshot)):
        payload = re.search(r'"base64": "([A-Za-z0-9+/=]+)"', html).group(1)
        assert pickle.loads(base64.b64decode(payload).rstrip(b"\x00")) == snapshot
    assert "total_reserved" in viz.segsum(snapshot)
    assert "entries" in viz.trace(snapshot)


def recorded(device: str, probe: str, batch: int):
    dev = get_device(device, memory_budget=None if device.startswith("estimate:") else 2**31)
    return tl.analyse(tl.record(load_workload(probe), dev, batch))


@pytest.mark.slow  # the process's first estimate loads torch's dispatch machinery (~2 s)
def test_mlp_snapshot_renders_and_the_viewer_finds_every_block():
    walk = recorded(H100, "mlp", 64)
    rendered(walk.snapshot)
    top, entries = viewer_walk(walk.snapshot)
    assert top == walk.reserved_peak == snap.peaks(walk.snapshot)[0]
    assert entries == len(walk.snapshot["device_traces"][0])


@pytest.mark.slow
@pytest.mark.parametrize("device", [H100, "cpu"])
@pytest.mark.parametrize("probe,batch", [("mlp", 256), ("gpt", 8), ("convnet", 16)])
def test_builtin_probes_render_with_memory_viz(device, probe, batch, tmp_path):
    walk = recorded(device, probe, batch)
    rendered(walk.snapshot)
    top, _ = viewer_walk(walk.snapshot)
    assert top == walk.reserved_peak
    snap.write(walk.snapshot, tmp_path / "s.pickle")
    assert snap.read(tmp_path / "s.pickle") == walk.snapshot
    assert pickle.load(open(tmp_path / "s.pickle", "rb")) == walk.snapshot  # as _memory_viz's CLI reads it
    assert open(tmp_path / "s.pickle", "rb").read(2) == b"\x80\x04"  # protocol 4: pytorch.org/memory_viz reads it


def test_the_viewer_check_catches_a_block_outside_every_segment():
    walk = recorded(H100, "mlp", 64)
    broken = pickle.loads(pickle.dumps(walk.snapshot))
    trace = broken["device_traces"][0]
    first = next(i for i, e in enumerate(trace) if e["action"] == "segment_alloc")
    del trace[first]  # the planted bug: an allocation in memory no segment holds
    with pytest.raises(AssertionError):
        viewer_walk(broken)


@pytest.mark.parametrize("device,budget", [(H100, None), ("cpu", 3_000_000)])
def test_highest_reserved_point_is_the_results_peak_to_the_byte(device, budget, tmp_path):
    path = tmp_path / "m.pickle"
    result = api.probe("mlp", device=device, memory_budget=budget, memory_snapshot=str(path), max_batch=4096)
    reserved, _ = snap.peaks(snap.read(path))
    assert reserved == result.peak_bytes == result.memory.reserved_peak_bytes
    assert sum(p.bytes for p in result.memory.parts if p.kind != "context") == result.peak_bytes
    assert result.memory.simulated == (device == H100)


def test_frames_point_into_the_users_file_and_line(tmp_path):
    probe = tmp_path / "mine.py"
    probe.write_text(
        "import torch, autotune\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(32, 64)\n"
        "    def forward(self, x):\n"
        "        return self.layer(x).relu()  # line 7\n"
        "def build():\n"
        "    return autotune.Workload(name='mine', model=Net, batch=lambda n, g: torch.randn(n, 32, generator=g),\n"
        "        loss=lambda m, b: m(b).pow(2).mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n")
    path = tmp_path / "mine.pickle"
    result = api.probe(str(probe), device=H100, memory_snapshot=str(path), at=16, max_batch=64)
    allocs = [e for e in snap.read(path)["device_traces"][0] if e["action"] == "alloc"]
    ours = [e for e in allocs if any(f["filename"] == str(probe) and f["line"] == 7 for f in e["frames"])]
    assert ours, "no allocation's frames point at the user's forward"
    assert all(e["frames"][0]["filename"] != tl.__file__ for e in allocs)
    assert result.memory.batch == 16


def test_the_peaks_parts_name_module_families_and_the_workspaces():
    walk = recorded(H100, "gpt", 8)
    names = {(p.kind, p.name) for p in walk.parts}
    assert ("workspace", "cuBLAS workspace") in names
    assert any(kind == "activations" and name.startswith("blocks.*") for kind, name in names)
    assert {"parameters", "gradients"} <= {kind for kind, _ in names}
    assert tl.family("blocks.11.attn.3") == "blocks.*.attn.*"
    assert tl.family("0.fc") == "layers *.fc"


@pytest.mark.slow
def test_advice_names_expandable_segments_where_fragmentation_costs_a_micro_batch_and_the_simulation_agrees():
    spec = str(HERE / "fragmenting.py")
    result = api.probe(spec, device=EstimateDevice(capacity=2**30, allowance=640 * 2**20, alloc_conf=""), margin=0.0,
                       memory_snapshot=True)
    memory = result.memory
    user, expandable = memory.options[0], next(o for o in memory.options if o.setting == "expandable_segments:True")
    assert expandable.max_micro_batch > user.max_micro_batch == result.max_micro_batch
    assert expandable.fragmentation_bytes < user.fragmentation_bytes
    assert any("expandable_segments:True the max micro-batch would be "
               f"{expandable.max_micro_batch} instead of {user.max_micro_batch}" in line for line in memory.advice)
    again = api.probe(spec, device=EstimateDevice(capacity=2**30, allowance=640 * 2**20,
                                                  alloc_conf="expandable_segments:True"), margin=0.0)
    assert again.max_micro_batch == expandable.max_micro_batch


def test_the_lowering_sentence_is_the_estimates_figure():
    result = api.probe("gpt", device=H100, memory_snapshot=True, at=64, max_batch=64)
    m = result.memory
    assert "activation checkpointing" in m.lowering and m.lowering_bytes is not None
    assert m.lowering_bytes > 0 and "blocks.*" in m.lowering


# ---- a real GPU's snapshot, with fakes of torch.cuda.memory ------------------------------------------


class FakeMemory:
    """torch.cuda.memory's recording functions: what was asked, and a recorded snapshot per run."""

    def __init__(self, snapshots):
        self.calls, self.snapshots = [], list(snapshots)

    def _record_memory_history(self, enabled="all", **kwargs):
        self.calls.append((enabled, kwargs))

    def _snapshot(self):
        return self.snapshots.pop(0)


class FakeDevice:
    estimated = False

    def measure(self, work, **kwargs):
        return work(None)


REAL = {"segments": [], "device_traces": [[
    {"action": "segment_alloc", "addr": 1 << 32, "size": 20 << 20, "stream": 0, "frames": []},
    {"action": "alloc", "addr": 1 << 32, "size": 1000, "stream": 0, "frames": []},
    {"action": "free_requested", "addr": 1 << 32, "size": 1000, "stream": 0, "frames": []},
    {"action": "free_completed", "addr": 1 << 32, "size": 1000, "stream": 0, "frames": []},
    {"action": "segment_free", "addr": 1 << 32, "size": 20 << 20, "stream": 0, "frames": []}]]}


def test_a_recording_device_keeps_each_real_runs_snapshot_and_stops_recording_after():
    memory = FakeMemory([REAL, {"segments": [], "device_traces": [[]]}])
    device = RecordingDevice(FakeDevice(), memory)
    assert device.measure(lambda s: 7) == 7
    with pytest.raises(RuntimeError):
        device.measure(lambda s: (_ for _ in ()).throw(RuntimeError("out of memory")))
    assert [c[0] for c in memory.calls] == ["all", None, "all", None]
    assert memory.calls[0][1]["stacks"] == "python" and memory.calls[0][1]["clear_history"]
    from autotune.results.probe import Trial

    trials = [Trial(batch=4, source="estimate", peak_bytes=1, fits=True, seconds=0),
              Trial(batch=8, source="real", peak_bytes=1, fits=True, seconds=0),
              Trial(batch=16, source="real", peak_bytes=None, fits=False, seconds=0, oom=True)]
    assert device.snapshot_of(trials, 8) is REAL
    assert device.snapshot_of(trials, 16) is None  # it ran out of memory: no whole run to compare
    assert device.estimated is False  # everything else is the device's


def test_real_and_predicted_timelines_share_allocation_numbers_and_the_peak_difference():
    walk = recorded(H100, "mlp", 64)
    r = compare_real(REAL, walk.snapshot, snapshot_file="x.real.pickle")
    assert r.reserved_peak_bytes == 20 << 20 and r.requested_peak_bytes == 1000
    assert r.predicted_reserved_peak_bytes == walk.reserved_peak
    assert r.difference_bytes == (20 << 20) - walk.reserved_peak
    assert r.real == ((1, 20 << 20, 1000),)
    assert r.predicted[0][0] == 1


@pytest.mark.slow
def test_a_workload_that_fails_under_checkpointing_gets_no_figure_and_a_bug_of_ours_surfaces(monkeypatch):
    from dataclasses import replace

    from autotune.probing import lowering as low

    workload = load_workload("gpt")
    recorded = tl.record(workload, get_device(H100), 64, frames=False)
    walk = tl.analyse(recorded)

    def fails(*args):
        raise ValueError("no checkpointing here")

    monkeypatch.setattr(low, "checkpointed", lambda w, name: replace(w, loss=fails))
    sentence, saved = low.lowering(recorded, walk, workload, 64, rule={})
    assert saved is None and "could not be estimated (WorkloadError" in sentence and "no checkpointing" in sentence
    monkeypatch.setattr(low, "record", lambda *a, **k: {}["a bug of autotune's"])
    with pytest.raises(KeyError):
        low.lowering(recorded, walk, workload, 64, rule={})
