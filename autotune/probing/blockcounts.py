"""The roofline's op counts of a micro-step of a model with N identical blocks, through the model cut to 2, 3 and 4.

A micro-step's counts (FLOPs by precision, bytes moved, ops: see
:mod:`autotune.devices.roofline`) add up op by op, and each identical block
(:mod:`autotune.probing.blocks`) runs the same ops. So the counts of the model
cut to k blocks are a line in k: where the 4-block counts are the 3-block ones
plus the step from 2 to 3, to the unit, the whole model's counts are on that
line too, and they are taken from it; otherwise the whole model is counted.
"""

from __future__ import annotations

from ..devices.base import Device
from ..devices.roofline import OpCounts, count_micro_step
from ..workload import Workload
from .blocks import blocks_of

CUTS = (2, 3, 4)


def counted_micro_step(workload: Workload, device: Device, batch: int) -> OpCounts:
    """:func:`~autotune.devices.roofline.count_micro_step` of ``workload`` at ``batch``, through the model cut to
    2, 3 and 4 of its identical blocks where their counts are a line (see the module)."""
    blocks = blocks_of(device.estimator(), workload)
    if blocks is None:
        return count_micro_step(workload, device, batch)
    cut = {k: count_micro_step(blocks.cut(workload, k), device, batch) for k in CUTS}
    whole = _on_the_line(cut, blocks.groups)
    return whole if whole is not None else count_micro_step(workload, device, batch)


def _on_the_line(cut: dict[int, OpCounts], n: int) -> OpCounts | None:
    """The counts at ``n`` blocks on the line through those at 2 and 3, where the 4-block counts are on it."""
    def at(k: int, a: int, b: int) -> int:
        return b + (k - 3) * (b - a)

    two, three, four = cut[2], cut[3], cut[4]
    kinds = set(two.flops) | set(three.flops) | set(four.flops)
    pairs = {kind: (two.flops.get(kind, 0), three.flops.get(kind, 0)) for kind in kinds}
    if any(at(4, *pairs[kind]) != four.flops.get(kind, 0) for kind in kinds) or \
            at(4, two.bytes, three.bytes) != four.bytes or at(4, two.ops, three.ops) != four.ops:
        return None
    return OpCounts(flops={kind: at(n, *pairs[kind]) for kind in sorted(kinds) if at(n, *pairs[kind])},
                    bytes=at(n, two.bytes, three.bytes), ops=at(n, two.ops, three.ops))
