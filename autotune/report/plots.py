"""The report's plots as PNG bytes.

Figures are made with ``matplotlib.figure.Figure`` on an Agg canvas directly:
no pyplot, no backend switch, no change to matplotlib's global state, no
display needed. Each function takes plain numbers and returns PNG bytes.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..units import format_bytes, format_margin

DPI = 90
WIDTH = 7.5  # inches: 675 px at DPI
COLORS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868", "activations": "#c44e52",
    "other": "#8c8c8c",
}
LABELS = {
    "parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
    "activations": "activations and temporaries", "other": "allocator cache and other",
}


def byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit an axis reads best in, for values up to ``largest`` bytes."""
    for name, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if largest >= size:
            return name, size
    return "B", 1


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _new(height: float) -> Figure:
    fig = Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")
    return fig


def peak_vs_batch(*, curve: Sequence[tuple[int, int]], real: Sequence[tuple[int, int | None, bool]],
                  capacity: int, usable: int, margin: float, chosen: int, max_micro_batch: int,
                  run_peak: int | None = None, title: str = "") -> bytes:
    """Estimated peak curve, real trials (batch, peak, fits), capacity and usable lines, the
    chosen micro-batch marked (and the max micro-batch, when it differs), the run's peak."""
    ys = [p for _, p in curve] + [p for _, p, _ in real if p is not None] + [capacity, run_peak or 0]
    unit, size = byte_unit(max(ys))
    fig = _new(4.4)
    ax = fig.add_subplot()
    if curve:
        xs, ps = zip(*sorted(curve))
        ax.plot(xs, [p / size for p in ps], color="#4c72b0", lw=2, label="estimated peak (fake tensors)")
    for fits, marker, color, label in ((True, "o", "#2ca02c", "real run: fits"),
                                       (False, "X", "#d62728", "real run: does not fit")):
        pts = [(b, p) for b, p, f in real if f == fits and p is not None]
        if pts:
            ax.scatter([b for b, _ in pts], [p / size for _, p in pts], s=55, zorder=5, edgecolor="black",
                       linewidth=0.6, marker=marker, color=color, label=label)
    ooms = [b for b, p, _ in real if p is None]
    if ooms:  # no peak to show: drawn on the capacity line, where the device stopped them
        ax.scatter(ooms, [capacity / size] * len(ooms), marker="X", s=70, color="#8c0000", zorder=5,
                   edgecolor="black", linewidth=0.6, label="real run: out of memory")
    if run_peak is not None:
        ax.scatter([chosen], [run_peak / size], marker="*", s=180, color="#ffbf00", edgecolor="black", zorder=6,
                   label=f"training run peak ({format_bytes(run_peak)})")
    ax.axhline(capacity / size, color="black", ls="--", lw=1.2, label=f"capacity {format_bytes(capacity)}")
    ax.axhline(usable / size, color="#ff7f0e", lw=1.5,
               label=f"usable {format_bytes(usable)} (margin {format_margin(margin)})")
    ax.axvline(chosen, color="#9467bd", ls=":", lw=2, label=f"plan: micro-batch {chosen}")
    if max_micro_batch != chosen:
        ax.axvline(max_micro_batch, color="#7f7f7f", ls="-.", lw=1.2, label=f"max micro-batch {max_micro_batch}")
    ax.set_xlim(left=0)
    ax.set_ylim(0, max(ys) / size * 1.12)
    ax.set_xlabel("micro-batch size (samples)")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title(title or "Peak memory vs micro-batch", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    return _png(fig)


def memory_breakdown(bars: Sequence[tuple[str, dict[str, int]]], *, usable: int, capacity: int) -> bytes:
    """Horizontal stacked bars, one per (label, {category: bytes}), each part and the total written out."""
    totals = [sum(parts.values()) for _, parts in bars]
    unit, size = byte_unit(max(totals + [capacity]))
    height = 2.3 + 0.6 * len(bars)
    fig = Figure(figsize=(WIDTH, height), dpi=DPI)
    fig.subplots_adjust(left=0.25, right=0.97, top=1 - 0.45 / height, bottom=1.15 / height)
    ax = fig.add_subplot()
    right = max(totals + [capacity]) / size * 1.02
    seen = set()
    for row, (_, parts) in enumerate(reversed(bars)):
        left = 0.0
        for key, value in parts.items():
            if value <= 0:
                continue
            width = value / size
            legend = LABELS.get(key, key) if key not in seen else None
            seen.add(key)
            ax.barh(row, width, left=left, color=COLORS.get(key, "#bcbd22"), edgecolor="white", height=0.6,
                    label=legend)
            if width > 0.14 * right:
                ax.text(left + width / 2, row, format_bytes(value), ha="center", va="center", fontsize=7.5,
                        color="white", fontweight="bold")
            left += width
        ax.text(left, row + 0.34, f"total {format_bytes(left * size)}", ha="right", va="bottom", fontsize=8)
    ax.axvline(usable / size, color="#ff7f0e", lw=1.5, label=f"usable {format_bytes(usable)}")
    ax.axvline(capacity / size, color="black", ls="--", lw=1.2, label=f"capacity {format_bytes(capacity)}")
    ax.set_yticks(range(len(bars)), [label for label, _ in reversed(bars)], fontsize=8.5)
    ax.set_ylim(-0.5, len(bars) - 0.2)
    ax.set_xlim(0, right)
    ax.set_xlabel(f"memory at the peak ({unit})")
    ax.set_ylabel("micro-batch", fontsize=9)
    ax.set_title("Where the memory goes at the peak", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    return _png(fig)


def throughput(points: Sequence[tuple[int, float | None, bool, bool, str]]) -> bytes:
    """Samples/s per tuning candidate (micro-batch, samples/s or None, fits, chosen, options label),
    one colour per options label; the chosen one starred."""
    fig = _new(3.8)
    ax = fig.add_subplot()
    labels = list(dict.fromkeys(label for *_, label in points))
    palette = ["#4c72b0", "#55a868", "#8172b3", "#937860", "#da8bc3", "#64b5cd"]
    for i, label in enumerate(labels):
        ok = [(b, s) for b, s, fits, _, lab in points if lab == label and fits and s is not None]
        if ok:
            name = "measured" if len(labels) == 1 else f"measured ({label})"
            xs, ys = zip(*ok)
            ax.scatter(xs, ys, s=45, color=palette[i % len(palette)], zorder=4, label=name)
    bad = [b for b, s, fits, *_ in points if not fits or s is None]
    if bad:
        ax.scatter(bad, [0] * len(bad), marker="X", s=55, color="#d62728", zorder=4, clip_on=False,
                   label="did not fit, or not measured")
    best = [(b, s) for b, s, _, chosen, _ in points if chosen and s is not None]
    if best:
        ax.scatter([best[0][0]], [best[0][1]], marker="*", s=220, color="#ffbf00", edgecolor="black", zorder=5,
                   label=f"chosen: micro-batch {best[0][0]}")
    ax.set_ylim(0, max((s for _, s, fits, *_ in points if fits and s is not None), default=1.0) * 1.15)
    ax.set_xlim(0, max((b for b, *_ in points), default=1) * 1.08)
    ax.set_xlabel("micro-batch size (samples)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title("Throughput vs micro-batch (tuning trials)", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def noise_scale(history: Sequence[tuple[int, float | None, float | None, float | None]], *, batch: float,
                unit: str) -> bytes:
    """The smoothed noise scale after each optimizer step (step, B_simple, low, high), its 95% band, and the
    effective batch it was measured at, for comparison."""
    fig = _new(3.6)
    ax = fig.add_subplot()
    pts = [(t, b) for t, b, _, _ in history if b is not None]
    band = [(t, lo, hi) for t, _, lo, hi in history if lo is not None]
    if band:
        top = max([b for _, b in pts] + [batch]) * 4
        xs = [t for t, _, _ in band]
        ax.fill_between(xs, [lo for _, lo, _ in band], [hi if hi is not None else top for _, _, hi in band],
                        color="#4c72b0", alpha=0.2, lw=0, label="95% interval")
    if pts:
        ax.plot([t for t, _ in pts], [b for _, b in pts], color="#4c72b0", lw=2, label="noise scale B_simple")
    ax.axhline(batch, color="#ff7f0e", ls="--", lw=1.5, label=f"effective batch ({batch:,.0f} {unit})")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{unit} (log scale)")
    ax.set_title("Gradient noise scale over the run", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize=8)
    return _png(fig)
