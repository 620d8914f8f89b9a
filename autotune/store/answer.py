"""What a stored entry answers, with nothing run: its probe result as a probe limited to ``max_batch``
gives it. No torch here: ``autotune serve`` answers a stored plan for an estimate in its own process.

A stored result answers a probe whose limit it answers (:meth:`~autotune.store.schema.Entry.answers`);
a stored max above the probe's limit is cut to the limit (:func:`narrowed`), as the probe would have
stopped there. On an estimate that is the answer (:func:`for_estimate`); on a real device one confirm
run comes first (:mod:`autotune.store.cached`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from .. import log
from ..units import format_bytes
from .schema import Entry, when

if TYPE_CHECKING:
    from ..results.probe import ProbeResult

#: How a result served from the store begins its notes.
FROM_STORE = "from the store"


def note(entry: Entry) -> str:
    """The note a result served from ``entry`` begins with."""
    return f"{FROM_STORE} (fingerprint {entry.short}, measured {when(entry.created_at)} on {entry.device})"


def stored(entry: Entry) -> ProbeResult:
    """The entry's probe result, marked as served from the store (DamagedEntry when it cannot be read)."""
    return replace(entry.probe(), fingerprint=entry.fingerprint, from_store=True)


def for_estimate(entry: Entry, max_batch: int) -> ProbeResult:
    """The stored answer to a probe on an estimate limited to ``max_batch`` (per rank): nothing to confirm."""
    start = time.perf_counter()
    said = note(entry)
    log.progress(said)
    served = stored(entry)
    served = replace(served, notes=(said,) + served.notes)
    return replace(narrowed(served, max_batch), seconds=time.perf_counter() - start)


def narrowed(result: ProbeResult, max_batch: int) -> ProbeResult:
    """A stored ``result`` as a probe limited to ``max_batch`` (per rank) gives it. Up to its max it
    stands as it is; below it the probe stops at ``max_batch``: its peak is the stored curve's
    prediction there (what a plan of that micro-batch from the stored result predicts; standing in for
    a GPU, with the allocator's overhead at the stored max, so on the high side far below it), its
    breakdown the same parameters, gradients and optimizer state with the rest of that peak as
    activations, and the caching allocator's figures (known at the stored max only) go."""
    m = result.max_micro_batch
    if m <= max_batch:
        return replace(result, max_batch=max_batch, limited_by="max_batch" if m == max_batch else
                       "memory" if result.limited_by == "max_batch" else result.limited_by)
    predicted = result.predicted_peak_at(max_batch)
    peak = predicted if predicted is not None else result.peak_bytes  # memory only grows with the batch
    fixed = {k: v for k, v in result.breakdown.items() if k not in ("activations", "other")}
    breakdown = {**fixed, "activations": max(0, peak - sum(fixed.values()))} if result.breakdown else {}
    why = {"memory": "memory", "host_memory": "the host's memory for its batch"}.get(
        result.limited_by, f"its own limit, {result.max_batch}")
    said = (f"the stored probe found micro-batch {m} fits ({why} set it); this probe stops at {max_batch}, "
            + ("whose peak is the stored curve's prediction" if predicted is not None
               else f"whose peak is at most the {format_bytes(result.peak_bytes)} at {m}"))
    return replace(result, max_micro_batch=max_batch, max_batch=max_batch, limited_by="max_batch",
                   peak_bytes=peak, predicted_peak_bytes=peak, breakdown=breakdown, allocated_peak_bytes=None,
                   alloc_retries=None, predicted_allocated_peak_bytes=None,
                   notes=result.notes[:1] + (said,) + result.notes[1:])
