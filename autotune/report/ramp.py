"""The batch ramp of a run: its phases, and the effective batch and the noise scale it followed, beside the loss.

The noise scale drawn is the one the ramp decided from: ``B_simple`` of the latest ``window`` steps and its
95% interval, read again from the per-step estimates the run's JSON keeps (``noise_scale.history``) by the
ramp's own rule (:func:`autotune.planning.ramp.window_reading`, pure arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import options
from ..planning.ramp import window_reading
from ..results.plan import arithmetic_line
from ..results.ramp import BatchPhase, steps_per_phase
from ..results.run import RunResult
from ..units import plural
from .blocks import Block, Image, Section, Table, Text
from .plots import _new, _png

RAMP_PLOT = "batch_ramp.png"


def readings(run: RunResult) -> list[tuple[int, float | None, float | None, float | None]]:
    """(step, B_simple, low, high) as the ramp read them after each measured step (steps 1-based)."""
    if run.noise_scale is None:
        return []
    window = run.ramp.window if run.ramp is not None else options.RAMP_WINDOW
    history = run.noise_scale.history
    out = []
    for i, h in enumerate(history):
        r = window_reading([(s.grad_sq, s.trace_cov) for s in history[max(0, i + 1 - window):i + 1]])
        out.append((h.step + 1, r.b_simple, r.low, r.high))
    return out


def ramp_section(run: RunResult) -> Section:
    phases, ramp = run.batch_schedule, run.ramp
    first, last, target = phases[0].effective_batch, phases[-1].effective_batch, run.plan.target_batch
    rule = ramp.lr_scaling if ramp is not None else "?"
    how = ("" if ramp is None else f" It grew only when the 95% lower bound of B_simple over the latest "
           f"{ramp.window} steps was above the batch, to about B_simple (at most {ramp.growth:g}x per change, each "
           f"phase at least {plural(ramp.min_steps, 'step')}).")
    text = (f"The effective batch started at {first} samples and grew toward the target {target} with the measured "
            f"gradient noise scale (McCandlish et al. 2018: the batch that balances optimizer steps and samples is "
            f"about B_noise, and it grows as the loss falls).{how} Every phase is an exact plan with micro-batches "
            f"at most the memory limit ({run.plan.max_micro_batch}); the learning rate followed by the {rule!r} "
            f"rule. It {'reached' if last == target else 'ended at ' + str(last) + ', below'} the target.")
    lasted = steps_per_phase(phases, run.steps)
    rows = [{"from step": str(p.first_step + 1), "steps": str(n), "effective batch": str(p.effective_batch),
             "micro-batches": _arithmetic(p), "B_simple then": _num(p.b_simple), "95% low then": _num(p.low),
             "lr factor": f"{p.lr_scale:.3g}"} for p, n in zip(phases, lasted)]
    import pandas as pd

    blocks: list[Block] = [Text(text), Table(pd.DataFrame(rows),
                                             caption="The phases, as the run's batch_schedule records them")]
    png = plot(run.losses, phases, readings(run), target=target)
    blocks.append(Image(RAMP_PLOT, "Loss, effective batch and noise scale over the run", png))
    return Section("ramp", "Batch ramp", tuple(blocks))


def plot(losses: Sequence[float], phases: Sequence[BatchPhase],
         seen: Sequence[tuple[int, float | None, float | None, float | None]], *, target: int) -> bytes:
    """Two panels over the optimizer steps: the loss; the effective batch, the noise scale the ramp read (95% band)
    and the target. Phase changes are dotted lines in both."""
    fig = _new(5.4)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1.3))
    steps = list(range(1, len(losses) + 1))
    top.plot(steps, losses, color="#c44e52", lw=1.5, label="loss")
    top.set_ylabel("loss")
    if min(losses) > 0 and max(losses) / min(losses) > 20:
        top.set_yscale("log")
    batch = [p.effective_batch for p, n in zip(phases, steps_per_phase(phases, len(losses))) for _ in range(n)]
    bottom.step(steps, batch, where="post", color="#4c72b0", lw=2, label="effective batch")
    pts = [(t, b) for t, b, _, _ in seen if b is not None]
    band = [(t, lo, hi) for t, _, lo, hi in seen if lo is not None]
    ceiling = max([target] + [b for _, b in pts]) * 4
    if band:
        bottom.fill_between([t for t, _, _ in band], [lo for _, lo, _ in band],
                            [hi if hi is not None else ceiling for _, _, hi in band], step="post", color="#55a868",
                            alpha=0.2, lw=0, label="B_simple 95% interval (the ramp's window)")
    if pts:
        bottom.plot([t for t, _ in pts], [b for _, b in pts], color="#55a868", lw=1.5, label="B_simple")
    bottom.axhline(target, color="black", ls="--", lw=1.2, label=f"target {target}")
    for p in phases[1:]:
        for ax in (top, bottom):
            ax.axvline(p.first_step + 1, color="#7f7f7f", ls=":", lw=1)
    bottom.set_yscale("log")
    bottom.set_ylim(max(1.0, min(batch) / 2), ceiling)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("samples (log scale)")
    top.set_title("Batch ramp: loss, effective batch and gradient noise scale", fontsize=11)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="best", fontsize=8)
    return _png(fig)


def _arithmetic(phase: BatchPhase) -> str:
    from collections import Counter
    from itertools import chain

    counts = Counter(chain.from_iterable(phase.schedule))
    return arithmetic_line(phase.effective_batch, len(phase.schedule), len(phase.schedule[0]), counts)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
