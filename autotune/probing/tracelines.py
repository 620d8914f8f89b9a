"""The estimate's allocation trace as lines in the batch size: the simulated allocator's answer without a run.

Standing in for a GPU, the estimate's peak is the reserved peak of the caching-
allocator simulation replaying the fit rule's allocation trace (one ``(key,
nbytes, stream)`` per allocation, ``nbytes`` -1 per free). When the fit rule
takes the same steps at every size, its traces at two sizes differ only in the
sizes of the allocations, each of them affine in the batch size (a storage's
bytes are). Through the traces at two sizes every event is then a line, and the
trace at any size follows from them; replaying it gives what an evaluation
there would measure, at the cost of the replay alone.

Lines are trusted only where an evaluated trace checked them to the byte: a
trace that lines through two smaller sizes predict, every event of it, makes
the next size's replayed trace as good as an evaluation there (the rule the
estimate's live-bytes lines follow on exact engines).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Trace = Sequence[tuple[int, int, int]]


class TraceLines:
    """Every event of the trace as ``n(b) = n0 + slope * (b - b0)``, through the traces at two sizes."""

    def __init__(self, b0: int, base: np.ndarray, slope: np.ndarray):
        self.b0, self.base, self.slope = b0, base, slope

    @classmethod
    def through(cls, b0: int, t0: Trace, b1: int, t1: Trace) -> TraceLines | None:
        """The lines through the traces at ``b0`` < ``b1``, or None when they are not lines: the traces
        differ in length, in an event's key, stream or kind (allocation or free), or an allocation grows by
        bytes that are not a whole number per sample."""
        if b0 >= b1 or not t0 or len(t0) != len(t1):
            return None
        a0, a1 = np.asarray(t0, dtype=np.int64), np.asarray(t1, dtype=np.int64)
        if not (np.array_equal(a0[:, 0], a1[:, 0]) and np.array_equal(a0[:, 2], a1[:, 2])):
            return None
        frees0, frees1 = a0[:, 1] < 0, a1[:, 1] < 0
        if not np.array_equal(frees0, frees1):
            return None
        grow = a1[:, 1] - a0[:, 1]
        if np.any(grow % (b1 - b0)):
            return None
        return cls(b0, a0, grow // (b1 - b0))

    def at(self, batch: int) -> list[tuple[int, int, int]] | None:
        """The trace at ``batch`` (None where an allocation would shrink to nothing: not lines there)."""
        events = self.base.copy()
        events[:, 1] += self.slope * (batch - self.b0)
        grows = (self.base[:, 1] >= 0) & (self.slope != 0)  # (some allocations are of 0 bytes at every size)
        if np.any(events[grows, 1] <= 0):
            return None
        return [(int(k), int(n), int(s)) for k, n, s in events.tolist()]

    def hold(self, batch: int, trace: Trace) -> bool:
        """Do the lines predict ``trace``, the one evaluated at ``batch``, to the byte in every event?"""
        predicted = self.at(batch)
        return predicted is not None and len(trace) == len(predicted) and \
            np.array_equal(np.asarray(trace, dtype=np.int64), np.asarray(predicted, dtype=np.int64))
