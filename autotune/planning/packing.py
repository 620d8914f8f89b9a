"""What padding-free packing saves: a plan of a model's packed samples (``padding="packed"``) beside the same
model padded to each micro-batch's longest sample. No torch here: the two probes' figures, compared."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..results.model import PREFIX, ModelSpec
from ..units import format_bytes


def padded_twin(workload: str | None) -> str | None:
    """The spec of the same model padded to the longest, when ``workload`` is a model's packed samples."""
    if not isinstance(workload, str) or not workload.startswith(PREFIX):
        return None
    spec = ModelSpec.parse(workload)
    return replace(spec, padding="longest").spec() if spec.padding == "packed" else None


def saving_note(packed: Any, padded: Any) -> str:
    """One line: the max micro-batch of each, and their peaks at the largest micro-batch both probes measured
    (two ProbeResults: packed, then padded to the longest)."""
    both = sorted(set(dict(packed.curve)) & set(dict(padded.curve)) & set(range(1, min(
        packed.max_micro_batch, padded.max_micro_batch) + 1)))
    said = (f"packing (one row, attention kept inside each sample): micro-batches of up to "
            f"{packed.max_micro_batch} samples, against {padded.max_micro_batch} padded to the longest")
    if not both:
        return said
    b = both[-1]
    a, p = dict(packed.curve)[b], dict(padded.curve)[b]
    verdict = f"packing saves {format_bytes(p - a)}" if a <= p else f"packing takes {format_bytes(a - p)} more"
    why = "" if a <= p else " (attention over the whole row: a block-diagonal mask grows with its tokens squared)"
    return f"{said}; at {b}: peak {format_bytes(a)} packed, {format_bytes(p)} padded: {verdict}{why}"
