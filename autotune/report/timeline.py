"""The memory timeline section: what is live at the peak (a table), the fit rule's memory over its phases (a
stacked plot), what would lower the peak most, allocator settings compared, and a real GPU's timeline beside the
prediction. Made from the ProbeResult's ``memory`` alone (no torch)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from ..results.timeline import SERIES, MemoryTimeline
from ..units import format_bytes
from .blocks import Block, Bullets, Image, Section, Table, Text
from .plots import COLORS, _new, _png, byte_unit

TIMELINE_PLOT = "memory_timeline.png"
COMPARE_PLOT = "memory_real_vs_predicted.png"
_COLORS = {**COLORS, "workspace": "#937860", "allocator": "#bdbdbd"}
_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
           "activations": "activations and temporaries", "workspace": "cuBLAS workspaces, kernel scratch",
           "allocator": "allocator cache and rounding"}


def timeline_plot(m: MemoryTimeline, *, usable: int, capacity: int, title: str = "") -> bytes:
    """Stacked bytes by kind over the fit rule's allocations, its phases shaded and named, the peak marked."""
    xs = [p[0] for p in m.series]
    stacks = [[p[i + 1] for p in m.series] for i in range(len(SERIES))]
    top = max([sum(p[1:]) for p in m.series] + [m.reserved_peak_bytes, 1])
    lines = [(v, label, style) for v, label, style in
             ((usable, f"usable {format_bytes(usable)}", dict(color="#ff7f0e", lw=1.3)),
              (capacity, f"capacity {format_bytes(capacity)}", dict(color="black", ls="--", lw=1.0)))
             if v <= 1.6 * top]  # the device's lines where they fit the picture
    top = max([top] + [v for v, _, _ in lines])
    unit, size = byte_unit(top)
    fig = _new(5.4)
    ax = fig.add_subplot()
    ax.stackplot(xs, *[[v / size for v in s] for s in stacks], step="post", colors=[_COLORS[k] for k in SERIES],
                 labels=[_LABELS[k] for k in SERIES], linewidth=0)
    edges = [start for start, _ in m.phases] + [m.events]
    for i, (start, name) in enumerate(m.phases):
        end = edges[i + 1]
        if i % 2:
            ax.axvspan(start, end, color="#000000", alpha=0.04, lw=0)
        short = name.replace("micro-step ", "µ").replace(" forward", " fwd").replace(" backward", " bwd") \
            .replace("optimizer step ", "step ")
        ax.text((start + end) / 2, top / size * 1.02, short, ha="center", va="bottom", fontsize=6.5, rotation=90)
    for v, label, style in lines:
        ax.axhline(v / size, label=label, **style)  # type: ignore[arg-type]
    oom = m.out_of_memory
    ax.axvline(m.peak_event, color="#d62728", ls=":", lw=1.5,
               label=f"peak {format_bytes(m.reserved_peak_bytes)} ({m.peak_phase})" if oom is None else
               f"peak {format_bytes(m.reserved_peak_bytes)}, no limit")
    if oom is not None:
        ax.axvline(oom.event, color="black", lw=1.8, label=f"out of memory ({oom.phase})")
    ax.set_xlim(0, max(m.events, 1))
    ax.set_ylim(0, top / size * 1.3)
    ax.set_xlabel("allocations and frees of the fit rule, in order")
    ax.set_ylabel(f"{'reserved' if m.simulated else 'live'} memory ({unit})")
    ax.set_title(title or f"Memory over the fit rule at micro-batch {m.batch}", fontsize=11)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=7, ncol=3, frameon=False)
    if not lines:
        ax.text(0.99, 0.02, f"usable {format_bytes(usable)}, far above", transform=ax.transAxes, ha="right",
                fontsize=7, color="#ff7f0e")
    return _png(fig)


def compare_plot(m: MemoryTimeline) -> bytes:
    """The real GPU's reserved memory and the prediction's, by allocation number, the peaks' difference named."""
    r = m.real
    assert r is not None
    top = max([p[1] for p in (*r.real, *r.predicted)] + [1])
    unit, size = byte_unit(top)
    fig = _new(3.8)
    ax = fig.add_subplot()
    for points, label, color in ((r.predicted, "predicted (estimate, simulated allocator)", "#4c72b0"),
                                 (r.real, "real GPU (torch.cuda.memory._snapshot)", "#d62728")):
        if points:
            ax.step([p[0] for p in points], [p[1] / size for p in points], where="post", color=color, lw=1.5,
                    label=label)
    ax.set_xlabel("allocation number")
    ax.set_ylabel(f"reserved memory ({unit})")
    ax.set_title(f"Real vs predicted reserved memory at micro-batch {m.batch}: peaks differ by "
                 f"{format_bytes(abs(r.difference_bytes))} ({'+' if r.difference_bytes >= 0 else '-'}"
                 f"{abs(r.difference_bytes) / max(r.predicted_reserved_peak_bytes, 1):.1%})", fontsize=10)
    ax.set_ylim(0, top / size * 1.12)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def parts_table(m: MemoryTimeline) -> pd.DataFrame:
    """What is live at the peak, largest first: kind, holder, bytes, share of the peak; where the size runs out
    of memory, the allocation that fails and what is live then, shares of that demand."""
    oom = m.out_of_memory
    parts = sorted(m.parts if oom is None else oom.parts, key=lambda p: -p.bytes)
    total = m.reserved_peak_bytes if oom is None else oom.reserved_bytes + oom.requested_bytes
    named = [(p.label, p) for p in parts]
    if oom is not None:
        named.insert(0, (f"the request, {oom.request.label}", oom.request))
    rows = [{"part": label, "kind": p.kind.replace("_", " "), "bytes": format_bytes(p.bytes),
             "share": "" if p.kind == "context" or not total else f"{p.bytes / total:.1%}"} for label, p in named]
    return pd.DataFrame(rows, columns=["part", "kind", "bytes", "share"])


def options_table(m: MemoryTimeline) -> pd.DataFrame:
    rows = [{"setting": o.setting or "yours: " + (o.conf or "(not set)"),
             "reserved": "out of memory" if o.out_of_memory else format_bytes(o.reserved_bytes),
             "allocated": "-" if o.out_of_memory else format_bytes(o.allocated_bytes),
             "fragmentation": "-" if o.out_of_memory else format_bytes(o.fragmentation_bytes),
             "release-and-retries": str(o.retries),
             "max micro-batch": "" if o.max_micro_batch is None else str(o.max_micro_batch)} for o in m.options]
    return pd.DataFrame(rows, columns=["setting", "reserved", "allocated", "fragmentation", "release-and-retries",
                                       "max micro-batch"])


def section(m: MemoryTimeline, *, usable: int, capacity: int, title: str = "") -> Section:
    how = ("the estimate's allocations replayed through the simulated caching allocator" if m.simulated
           else "live tensor memory counted by the tracker")
    oom = m.out_of_memory
    where = (f"Its peak, {format_bytes(m.reserved_peak_bytes)}, comes in {m.peak_phase}; the table says what is "
             "live there" if oom is None else
             f"Micro-batch {m.batch} {oom.headline()}. The table says what is live at the error and what it asks "
             "for; past it the snapshot goes on without a limit, as on a GPU large enough, where the fit rule's "
             f"blocks peak at {format_bytes(m.allocated_peak_bytes)} (allocated peak)")
    blocks: list[Block] = [
        Text(f"The fit rule at micro-batch {m.batch}, allocation by allocation ({how}, {m.events} allocations and "
             f"frees). {where}; activations by the module family that made them (list indices as *)."),
        Table(parts_table(m), caption="What is live at the peak" if oom is None else
              "What is live at the out-of-memory error"),
        Image(TIMELINE_PLOT, "Memory over the fit rule's phases", timeline_plot(m, usable=usable, capacity=capacity,
                                                                              title=title)),
    ]
    if m.lowering:
        blocks.append(Text(m.lowering))
    if m.options:
        blocks += [Text("Allocator settings compared by the simulation at this micro-batch (the max micro-batch "
                        "where one fits more than yours; fragmentation: the reserved peak minus the allocated peak); "
                        "nothing is set for you:"), Table(options_table(m))]
    if m.advice:
        blocks.append(Bullets(tuple(m.advice)))
    if m.real is not None:
        r = m.real
        blocks += [Text(f"On the GPU: reserved peak {format_bytes(r.reserved_peak_bytes)} measured from its own "
                        f"snapshot, {format_bytes(r.predicted_reserved_peak_bytes)} predicted: "
                        f"{r.difference_bytes:+,} bytes at the peak."),
                   Image(COMPARE_PLOT, "Real vs predicted reserved memory", compare_plot(m))]
    files = [f for f in (m.snapshot_file, m.real.snapshot_file if m.real else None) if f]
    if files:
        blocks.append(Text("Open the snapshot in PyTorch's viewer: python -m torch.cuda._memory_viz trace_plot "
                           f"{files[0]} -o memory.html (add -s for reserved segments), or drop it on "
                           "pytorch.org/memory_viz. Files: " + ", ".join(files)))
    return Section("timeline", "Memory timeline", tuple(blocks))


def files(m: MemoryTimeline | None) -> Sequence[tuple[str, str]]:
    if m is None:
        return ()
    out = [(TIMELINE_PLOT, "memory over the fit rule's phases, stacked by kind")]
    if m.real is not None:
        out.append((COMPARE_PLOT, "real vs predicted reserved memory"))
    return out
