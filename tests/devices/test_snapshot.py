"""Memory snapshots in torch's format: rendered by torch's own _memory_viz, the reserved peak to the byte, frames
into the user's file, the peak's parts, allocator advice on a fragmenting workload, and a real GPU's snapshot
recorded beside the prediction (with fakes of torch.cuda.memory)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
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
from autotune.results.request import FitRule
from autotune.results.timeline import share
from autotune.units import format_bytes, parse_size
from autotune.workload import load_workload

from .user_probes import user_probe

HERE = Path(__file__).parent
H100 = "estimate:H100-80GB"


class _Placed:
    """The live blocks and segments of one device, each block with the segment it lies in (found again only when
    the block comes back to life or its segment goes)."""

    def __init__(self, segments: dict[int, int]):
        self.segments = segments
        self.home: dict[int, int] = {}  # block -> the segment it lies in
        self.held: dict[int, set[int]] = {}  # segment -> the blocks that lie in it
        self.outside: set[int] = set()  # blocks in no segment

    def settle(self, block: int) -> None:
        seg = next((a for a, n in self.segments.items() if a <= block < a + n), None)
        if seg is None:
            self.outside.add(block)
        else:
            self.home[block] = seg
            self.held.setdefault(seg, set()).add(block)

    def unsettle(self, block: int) -> None:
        self.outside.discard(block)
        seg = self.home.pop(block, None)
        if seg is not None:
            self.held[seg].discard(block)

    def segment_changed(self, seg: int) -> None:
        for block in [*self.held.get(seg, ()), *self.outside]:
            self.unsettle(block)
            self.settle(block)


def viewer_walk(snapshot: dict) -> tuple[int, int]:
    """What MemoryViz.js's segment view does (torch/utils/viz/MemoryViz.js, ``simulate_memory`` then ``draw``):
    from the end state, walk the trace backwards; at every entry each live block must lie in a segment (the
    viewer draws it there, and fails without one). Returns (highest reserved, entries walked)."""
    segments = {s["address"]: s["total_size"] for s in snapshot["segments"] if s["device"] == 0}
    blocks: dict[int, int] = {}
    for s in snapshot["segments"]:
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                blocks[addr] = b["size"]
            addr += b["size"]
    placed = _Placed(segments)
    for block in blocks:
        placed.settle(block)
    trace = snapshot["device_traces"][0]
    top, reserved = 0, sum(segments.values())
    for e in reversed(trace):
        assert not placed.outside, f"block {min(placed.outside):#x} outside every segment at {e}"
        top = max(top, reserved)
        action = e["action"]
        if action == "free_completed":
            placed.unsettle(e["addr"])
            blocks[e["addr"]] = e["size"]
            placed.settle(e["addr"])
        elif action == "alloc":
            del blocks[e["addr"]]
            placed.unsettle(e["addr"])
        elif action in ("segment_free", "segment_unmap"):
            reserved += e["size"] - segments.get(e["addr"], 0)
            segments[e["addr"]] = e["size"]
            placed.segment_changed(e["addr"])
        elif action in ("segment_alloc", "segment_map"):
            reserved -= segments.pop(e["addr"])
            placed.segment_changed(e["addr"])
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
    probe = user_probe(tmp_path / "mine.py", "return self.layer(x).relu()  # line 7")
    path = tmp_path / "mine.pickle"
    result = api.probe(str(probe), device=H100, memory_snapshot=str(path), at=16, max_batch=64)
    allocs = [e for e in snap.read(path)["device_traces"][0] if e["action"] == "alloc"]
    ours = [e for e in allocs if any(f["filename"] == str(probe) and f["line"] == 7 for f in e["frames"])]
    assert ours, "no allocation's frames point at the user's forward"
    assert all(e["frames"][0]["filename"] != tl.__file__ for e in allocs)
    # an op called on the user's own line (relu) starts its trace there, as a real allocation's does: no
    # wrapper of torch's dispatch (torch._dynamo.disable) comes first
    assert any(e["frames"][0]["filename"] == str(probe) and e["frames"][0]["line"] == 7 for e in allocs)
    assert not [e["frames"][0] for e in allocs
                if e["frames"][0]["filename"].endswith(("torch/_dynamo/eval_frame.py", "torch/_compile.py"))]
    assert result.memory.batch == 16


def test_activations_of_the_models_own_forward_are_named_by_its_class_not_outside_every_module(tmp_path):
    probe = user_probe(tmp_path / "rootfwd.py",
                       "h = self.layer(x)\nreturn (h @ h.T).relu()  # (B, B): made by the root's own forward")
    memory = api.probe(str(probe), device=H100, memory_snapshot=True, at=512, max_batch=1024).memory
    acts = {p.name: p.bytes for p in memory.parts if p.kind == "activations"}
    assert acts["<Net>"] >= 512 * 512 * 4 > acts["layer"], acts  # the (B, B) product's relu, saved for the backward


def test_the_peaks_parts_name_module_families_and_the_workspaces():
    walk = recorded(H100, "gpt", 8)
    names = {(p.kind, p.name) for p in walk.parts}
    assert ("workspace", "cuBLAS workspace") in names
    assert any(kind == "activations" and name.startswith("blocks.*") for kind, name in names)
    # the peak (micro-step 3's backward, with dropout keeping a boolean mask as on CUDA) holds no .grad yet
    assert {"parameters", "optimizer_state"} <= {kind for kind, _ in names}
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
    roundup = next(o for o in memory.options if o.setting == "roundup_power2_divisions:4")
    assert user.retries and roundup.out_of_memory and not roundup.retries  # it rounds past the capacity, no margin
    assert not any("roundup_power2_divisions" in line for line in memory.advice)  # its retries do not "go"
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
    sentence, saved = low.lowering(recorded, walk, workload, 64, rule=FitRule())
    assert saved is None and "could not be estimated (WorkloadError" in sentence and "no checkpointing" in sentence
    monkeypatch.setattr(low, "record", lambda *a, **k: {}["a bug of autotune's"])
    with pytest.raises(KeyError):
        low.lowering(recorded, walk, workload, 64, rule=FitRule())


# ---- a size past the capacity: what it would need at the out-of-memory error ----------------------------------


def test_a_size_past_the_capacity_says_what_it_would_need_at_the_out_of_memory_error(tmp_path):
    """mlp at 400000 on a 1 GiB estimate (384 MiB capacity): the first layer's output alone (390.6 MiB) does not
    fit. The timeline says so, with the demand there, not the state the simulation is in after it."""
    path = tmp_path / "oom.pickle"
    result = api.probe("mlp", device="estimate", memory_budget="1GiB", max_batch=512, memory_snapshot=str(path),
                       at=400_000)
    m = result.memory
    o = m.out_of_memory
    assert o is not None and o.phase == "micro-step 1 forward" and o.capacity_bytes == result.capacity_bytes
    (entry,) = [e for e in snap.read(path)["device_traces"][0] if e["action"] == "oom"]
    assert o.requested_bytes == entry["size"] == 400_000 * 256 * 4  # the first Linear's output
    assert o.reserved_bytes == o.capacity_bytes - entry["device_free"]
    assert o.segment_bytes == 392 << 20  # the request rounded up to 2 MiB: a segment of its own
    assert o.request.label == "activations of layers *"
    assert sum(p.bytes for p in o.parts) == o.reserved_bytes  # what was live, rounding and the cache then
    live = {p.kind for p in o.parts}
    assert {"parameters", "activations"} <= live and "optimizer_state" not in live  # before the first step
    batch = next(p for p in o.parts if p.kind == "activations")
    assert batch.bytes >= 400_000 * 64 * 4  # the micro-batch's features, live when the layer asks
    assert o.needed_bytes == o.allocated_bytes + o.requested_bytes > o.capacity_bytes
    lines = m.lines()
    assert lines[0].startswith("memory at micro-batch 400000: does not fit: the simulated GPU (capacity 384.0 MiB) "
                               "runs out of memory in micro-step 1 forward, asking for 390.6 MiB (activations of "
                               "layers *)")
    assert f"it would need at least {format_bytes(o.needed_bytes)} there" in lines[0]
    assert not any("(99%)" in line or "optimizer step 1" in line for line in lines)
    # the advice is about the demand at the error: the layer's output, not a smaller model state
    assert "at the out-of-memory error (micro-step 1 forward, micro-batch 400000)" in m.lowering
    assert "activations of layers *" in m.lowering and "smaller model state" not in m.lowering
    assert all("fragmentation" not in line for line in m.advice)  # no figure of the replay past the error


@pytest.mark.slow  # gpt: a probe, a timeline past the capacity and one under checkpointing
def test_where_the_allocators_new_segment_does_not_fit_and_checkpointing_avoids_the_error():
    """gpt at 128 on a 90 MiB GPU: its live blocks and the 8 MiB request would fit, the 20 MiB segment the
    allocator asks for does not; checkpointing the blocks keeps the whole fit rule under the capacity."""
    result = api.probe("gpt", device="estimate", memory_budget="730MiB", max_batch=64, memory_snapshot=True, at=128)
    m = result.memory
    o = m.out_of_memory
    assert o is not None and o.needed_bytes <= o.capacity_bytes < o.reserved_bytes + o.segment_bytes
    assert o.segment_bytes == 20 << 20 and "MiB capacity, but the allocator asks the device for a new 20.0 MiB "\
        "segment" in m.lines()[0]
    assert "activations of blocks.* and the modules in it hold" in m.lowering
    assert "activation checkpointing of these modules would avoid the error: reserved peak" in m.lowering


def test_a_size_within_the_capacity_has_no_out_of_memory_error():
    result = api.probe("mlp", device="estimate", memory_budget="1GiB", max_batch=512, memory_snapshot=True, at=100)
    assert result.memory.out_of_memory is None and result.memory.lines()[0].startswith("memory at micro-batch 100: "
                                                                                       "reserved peak")


def test_an_out_of_memory_error_within_the_capacity_is_laid_to_the_cache_the_allocator_cannot_release():
    """Live blocks and the request fit the capacity, but the allocator holds cached blocks of split segments."""
    from autotune.results.timeline import MemoryTimeline, OutOfMemory, PeakPart

    o = OutOfMemory(event=5, phase="micro-step 2 forward",
                    request=PeakPart(kind="activations", name="fc", bytes=30 << 20), allocated_bytes=60 << 20,
                    reserved_bytes=90 << 20, segment_bytes=20 << 20, capacity_bytes=100 << 20,
                    parts=(PeakPart(kind="activations", name="fc", bytes=60 << 20),
                           PeakPart(kind="cache", name="cached free blocks", bytes=30 << 20)))
    m = MemoryTimeline(batch=8, simulated=True, reserved_peak_bytes=120 << 20, allocated_peak_bytes=90 << 20,
                       peak_event=9, peak_phase="optimizer step 1", events=20, parts=o.parts, out_of_memory=o)
    first = m.lines()[0]
    assert "with 60.0 MiB live in blocks and 30.0 MiB of cached free blocks the allocator cannot release" in first
    assert first.endswith("the live blocks and the request come to 90.0 MiB, within the 100.0 MiB capacity, but the "
                          "allocator "
                          "asks the device for a new 20.0 MiB segment, and the 90.0 MiB it holds leave no room for it; "
                          "the demand there, 120.0 MiB, is the request and what the allocator holds then (live blocks, "
                          "cached free blocks):")
    assert m.lines()[1:4] == ["  the request, activations of fc: 30.0 MiB (25%)", "  live, activations of fc: 60.0 MiB "
                              "(50%)", "  held, cached free blocks: 30.0 MiB (25%)"]


def test_a_timeline_written_before_out_of_memory_was_recorded_reads_as_none():
    from autotune.results.timeline import MemoryTimeline

    written = HERE.parent / "results" / "data" / "schema2" / "probe_memory.json"
    data = MemoryTimeline.from_dict(json.loads(written.read_text())["memory"]).to_dict()
    del data["out_of_memory"]
    for option in data["options"]:
        del option["out_of_memory"]
    old = MemoryTimeline.from_dict(data)
    assert old.out_of_memory is None and not any(o.out_of_memory for o in old.options)


# ---- what would lower the peak when activation checkpointing would not -----------------------------------------


@pytest.mark.slow  # mlp at 65536: the probe, the timeline, the checkpointing estimate and one at half the size
def test_when_checkpointing_would_not_lower_the_peak_the_sentence_names_what_would():
    """mlp's layers are single ops: checkpointing each keeps its input, the peak rises. The largest part is still
    the activations, and a smaller micro-batch lowers them: the estimate's own figure at half the size."""
    result = api.probe("mlp", device=H100, memory_snapshot=True)
    m = result.memory
    assert m.batch == 65536 and "would not lower it" in m.lowering and m.lowering_bytes < 0
    half = tl.analyse(tl.record(load_workload("mlp"), get_device(H100), 32768, frames=False)).reserved_peak
    assert half < m.reserved_peak_bytes
    acts = sum(p.bytes for p in m.parts if p.kind == "activations")
    said = (f"what would lower it: the largest part, activations ({format_bytes(acts)}, "
            f"{acts / m.reserved_peak_bytes:.0%}), shrinks with a smaller micro-batch (micro-batch 32768: reserved "
            f"peak {format_bytes(half)} by the estimate; more accumulation steps keep the effective batch)")
    assert said in m.lowering


def test_where_the_cublas_workspace_is_the_largest_part_the_sentence_names_its_setting(monkeypatch):
    """mlp at 1000 on an H100: two 32 MiB cuBLAS workspaces are 90% of the peak, not the model state."""
    result = api.probe("mlp", device=H100, memory_snapshot=True, max_batch=1000)
    m = result.memory
    work = sum(p.bytes for p in m.parts if p.kind == "workspace")
    assert work > 0.8 * m.reserved_peak_bytes and "smaller model state" not in m.lowering
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    smaller = api.probe("mlp", device=H100, memory_snapshot=True, max_batch=1000).memory.reserved_peak_bytes
    assert smaller < m.reserved_peak_bytes
    assert (f"the largest part, cuBLAS workspaces and kernel scratch ({format_bytes(work)}, "
            f"{work / m.reserved_peak_bytes:.0%}), shrinks with CUBLAS_WORKSPACE_CONFIG=:4096:2 (8 MiB per cuBLAS "
            f"handle and stream): reserved peak {format_bytes(smaller)} in the simulation") in m.lowering


def test_a_setting_that_would_not_lower_the_peak_is_not_offered():
    """mlp at 16 on a 1 GiB GPU: the cuBLAS workspaces are the largest part (16.25 of 24 MiB), but replayed with
    8 MiB ones the reserved peak stays 24 MiB (the segments the allocator keeps anyway): not offered."""
    m = api.plan(16, probe="mlp", device="estimate", memory_budget="1GiB", memory_snapshot=True).probe.memory
    work = sum(p.bytes for p in m.parts if p.kind == "workspace")
    assert work > m.reserved_peak_bytes / 2 and "CUBLAS_WORKSPACE_CONFIG" not in m.lowering, m.lowering


def test_past_the_capacity_what_would_lower_the_demand_is_the_probes_max_micro_batch():
    result = api.probe("mlp", device="estimate", memory_budget="1GiB", max_batch=512, memory_snapshot=True,
                       at=400_000)
    assert result.memory.lowering.endswith(
        "what would lower it: the largest part, activations (491.3 MiB, 96%), shrinks with a smaller micro-batch "
        f"(micro-batch 512, the probe's max: reserved peak {format_bytes(result.peak_bytes)}; more accumulation steps "
        "keep the effective batch).")
    # checkpointing is said not to help in figures that say why: over the capacity, or no room for a segment
    still = re.search(r"would still run out of memory \(in [^,]+, the live blocks and the request coming to "
                      r"(at least [\d.]+ [KMG]iB, [\d.]+ [KMG]iB over the [\d.]+ [KMG]iB capacity|"
                      r"[\d.]+ [KMG]iB, within the [\d.]+ [KMG]iB capacity, but the allocator asks)",
                      result.memory.lowering)
    assert still is not None, result.memory.lowering


def test_where_the_cache_is_the_largest_part_the_sentence_names_the_setting_that_reserves_least():
    from types import SimpleNamespace

    from autotune.probing.lowering import Levers, Moment, _Instead
    from autotune.results.timeline import PeakPart

    parts = (PeakPart(kind="cache", name="cached free blocks", bytes=60 << 20),
             PeakPart(kind="activations", name="fc", bytes=30 << 20),
             PeakPart(kind="parameters", name="", bytes=10 << 20))
    at = Moment("at the peak (micro-step 1 forward, micro-batch 8)", 100 << 20, parts, {})
    simulated = SimpleNamespace(simulation=object())
    levers = Levers(allocator=("PYTORCH_ALLOC_CONF=expandable_segments:True", 50 << 20))
    assert _Instead(simulated, None, at, None, 8, {}, levers).clause() == (
        "; what would lower it: the largest part, the allocator's cached free blocks and rounding (60.0 MiB, 60%), "
        "shrinks with PYTORCH_ALLOC_CONF=expandable_segments:True: reserved peak 50.0 MiB in the simulation")
    # no setting reserves less: the next part a change lowers
    walk = SimpleNamespace(out_of_memory=None)
    assert _Instead(simulated, walk, at, None, 1, {}, Levers()).clause() == (
        "; what would lower it: the largest part a change lowers, parameters, gradients and optimizer state "
        "(10.0 MiB, 10%), shrinks with a smaller model state (fewer or lower-precision parameters, an optimizer "
        "with less state, or sharding with --parallel fsdp)")


# ---- garbage_collection_threshold among the allocator settings compared ------------------------------------------

GC = "garbage_collection_threshold:0.6"


def test_garbage_collection_threshold_is_compared_and_not_advised_where_it_does_nothing():
    """Without per_process_memory_fraction the threshold has no limit to act on (as in PyTorch's allocator): the
    same replay as the user's, so it is compared but not advised."""
    memory = api.probe("mlp", device=H100, memory_snapshot=True, max_batch=1000).memory
    user, gc = memory.options[0], next(o for o in memory.options if o.setting == GC)
    assert (gc.reserved_bytes, gc.allocated_bytes, gc.retries) == (user.reserved_bytes, user.allocated_bytes,
                                                                   user.retries)
    assert gc.max_micro_batch is None
    (line,) = memory.advice
    # 1000 fits: the probe stopped at the largest size asked for, so no setting was searched past it
    assert line.startswith("allocator settings: 1000 is already the largest micro-batch asked for, so no setting (")
    assert GC in line and "was searched for a larger one" in line


@pytest.mark.slow  # the fragmenting workload's probe and its comparison
def test_garbage_collection_threshold_is_advised_where_it_removes_a_release_and_retry():
    """Under per_process_memory_fraction:0.5 the fragmenting workload's max micro-batch costs one release-and-retry;
    releasing old cached blocks past 60% of the allowed memory avoids it, and the simulation says so."""
    spec = str(HERE / "fragmenting.py")
    conf = "per_process_memory_fraction:0.5"
    result = api.probe(spec, device=EstimateDevice(capacity=2**30, allowance=640 * 2**20, alloc_conf=conf),
                       margin=0.0, memory_snapshot=True)
    memory = result.memory
    user, gc = memory.options[0], next(o for o in memory.options if o.setting == GC)
    assert user.retries == 1 and gc.retries == 0 and not gc.out_of_memory
    assert any(f"with PYTORCH_ALLOC_CONF={conf},{GC} the 1 release-and-retries at micro-batch "
               f"{result.max_micro_batch} would go" in line for line in memory.advice)


# ---- every figure the advice states is what an estimate under that change gives ------------------------------

SIZE = r"([\d.]+ [KMGT]?i?B)"


def estimated(probe: str, preset: str, batch: int, *, checkpointing: str | None = None) -> tuple[int, int, int]:
    """(reserved peak, allocated peak, release-and-retries) of the fit rule at ``batch``, as the probe estimates a
    size, on a device made now (it reads the environment's allocator and cuBLAS settings); ``checkpointing``: the
    module family run under activation checkpointing (gpt: its own ``checkpointing=True``)."""
    from autotune.probing.fitrule import run_trial
    from autotune.probing.lowering import checkpointed

    workload = load_workload(probe)
    if checkpointing is not None:
        workload = dataclasses.replace(workload, model=functools.partial(workload.model, checkpointing=True)) \
            if probe == "gpt" else checkpointed(workload, checkpointing)
    m = run_trial(get_device(f"estimate:{preset}").estimator(), workload, batch, 1 << 62, source="estimate",
                  capacity_guard=False).measurement
    return m.peak_bytes, m.allocated_peak_bytes, m.alloc_retries


def close(stated: str, actual: int, what: str) -> None:
    figure = 0 if float(stated.split()[0]) == 0 else parse_size(stated.replace(" ", ""))
    assert abs(figure - actual) <= 0.05 * max(actual, 1) + 0.05 * 2**20, \
        f"{what}: the sentence says {stated}, the estimate under that change gives {format_bytes(actual)}"


def checked_lowering(probe: str, preset: str, m, monkeypatch) -> int:
    """Each change the lowering sentence suggests, estimated under that change; how many it suggests."""
    said, n = m.lowering, 0
    ckpt = re.search(r"activations of (.+?) and the modules in it hold .*activation checkpointing of these modules "
                     rf"would (?:lower it by about {SIZE} |not lower it )\({SIZE} -> {SIZE}\)", said)
    if ckpt is not None:
        close(ckpt.group(4), estimated(probe, preset, m.batch, checkpointing=ckpt.group(1))[0], said)
        n += 1
    if "activation checkpointing would lower it little" in said:
        acts = [p.name for p in m.top(20) if p.kind == "activations" and "*" in p.name]
        again = estimated(probe, preset, m.batch, checkpointing=acts[0] if acts else "blocks.*")[0]
        assert again > 0.9 * m.reserved_peak_bytes, f"{said}: checkpointing gives {format_bytes(again)}"
        n += 1
    smaller = re.search(rf"micro-batch (\d+)(?::|, the probe's max:) reserved peak {SIZE}", said)
    if smaller is not None:
        close(smaller.group(2), estimated(probe, preset, int(smaller.group(1)))[0], said)
        n += 1
    for variable, value, figure in re.findall(rf"((?:CUBLAS_WORKSPACE_CONFIG|PYTORCH_\w+))=(\S+?)(?: \(.*?\))?: "
                                              rf"reserved peak {SIZE} in the simulation", said):
        with monkeypatch.context() as env:
            env.setenv(variable, value)
            close(figure, estimated(probe, preset, m.batch)[0], said)
        n += 1
    return n


def checked_advice(probe: str, preset: str, m, monkeypatch) -> int:
    """Each allocator setting the advice suggests, estimated (or probed) under that setting; how many."""
    n = 0
    for line in m.advice:
        found = re.search(rf"with (PYTORCH_\w+)=(\S+) the (?:max micro-batch would be (\d+) instead|\d+ release-and-"
                          rf"retries at micro-batch \d+ would go) \(fragmentation {SIZE} -> {SIZE} at", line)
        if found is None:
            continue
        variable, value, best, fragmentation = found.group(1), found.group(2), found.group(3), found.group(5)
        with monkeypatch.context() as env:
            env.setenv(variable, value)
            reserved, allocated, retries = estimated(probe, preset, m.batch)
            close(fragmentation, reserved - allocated, line)
            if best is None:
                assert retries == 0, line
            else:
                again = api.probe(probe, device=f"estimate:{preset}").max_micro_batch
                assert abs(again - int(best)) <= 0.05 * again, f"{line}: probed under it, the max is {again}"
        n += 1
    return n


@pytest.mark.slow  # six probes with their timelines, and an estimate under each change they suggest
@pytest.mark.parametrize("probe,preset,at", [(probe, preset, None) for probe in ("mlp", "convnet", "gpt")
                                              for preset in ("T4-16GB", "H100-80GB")] + [("mlp", "H100-80GB", 1000)])
def test_each_change_the_advice_suggests_gives_the_figure_it_states(probe, preset, at, monkeypatch):
    """At each built-in probe's max (and mlp at 1000, where the cuBLAS workspaces are most of it): checkpointing,
    a smaller micro-batch, a cuBLAS workspace or an allocator setting, each estimated again under that change,
    gives the sentence's figure within 5%. gpt on the T4 reaches its reserved peak at a small segment's cudaMalloc
    while the memory is all cache: the moment that limits it is the allocated peak inside that plateau, where
    checkpointing its blocks lowers 12.9 GiB to 8.4 GiB."""
    for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(variable, raising=False)
    m = api.probe(probe, device=f"estimate:{preset}", memory_snapshot=True, at=at).memory
    suggested = checked_lowering(probe, preset, m, monkeypatch) + checked_advice(probe, preset, m, monkeypatch)
    assert suggested, (m.lowering, m.advice)
    if probe == "gpt" and preset == "T4-16GB":
        assert "activation checkpointing of these modules would lower it by about" in m.lowering


def test_past_the_capacity_the_demands_parts_and_the_sentences_figures_agree():
    """mlp at 200000 on a 1 GiB estimate: the ReLU's output is asked for while the Linear's, of the same family,
    is live. The listing tells the request from the live block, gives each its share of the demand, and the
    sentence's figures are those shares' sums (the family's with the request, all activations below 100%)."""
    m = api.probe("mlp", device="estimate", memory_budget="1GiB", max_batch=512, memory_snapshot=True,
                  at=200_000).memory
    o = m.out_of_memory
    demand = o.reserved_bytes + o.requested_bytes
    assert o.request.label == "activations of layers *"
    listed = [re.fullmatch(r"  (the request|live|held), (.+): ([\d.]+ \w+) \((\S+)\)", line) for line in m.lines()[1:]]
    listed = [x.groups() for x in listed if x is not None]
    assert ("the request", "activations of layers *", format_bytes(o.requested_bytes),
            share(o.requested_bytes, demand)) == listed[0]
    assert ("live", "activations of layers *") in [x[:2] for x in listed]
    assert len({x[:2] for x in listed}) == len(listed)  # nothing listed twice
    assert f"the demand there, {format_bytes(demand)}, is the request" in m.lines()[0]
    family = o.requested_bytes + sum(p.bytes for p in o.parts if p.label == "activations of layers *")
    assert (f"activations of layers * and the modules in it hold {share(family, demand)} of the "
            f"{format_bytes(demand)} demand ({format_bytes(family)}, the request's {format_bytes(o.requested_bytes)} "
            "included)") in m.lowering
    acts = o.requested_bytes + sum(p.bytes for p in o.parts if p.kind == "activations")
    assert acts < demand and f"activations ({format_bytes(acts)}, {share(acts, demand)})" in m.lowering
    assert share(acts, demand) != "100%" and share(1, 1000) == "<1%" and share(999, 1000) == ">99%"
