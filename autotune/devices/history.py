"""A real GPU's own allocator history: ``torch.cuda.memory._record_memory_history`` around each real run.

:class:`RecordingDevice` wraps a CUDA device: every measured run (a real trial
of the fit rule) records the allocator's history with Python stacks and keeps
``torch.cuda.memory._snapshot()`` of it, in the order the runs happened. So
the confirm run of a probe leaves its real snapshot, to be set beside the
estimate's predicted one. ``memory`` is ``torch.cuda.memory`` by default
(injectable: the logic is tested on the CPU with fakes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Trace entries kept per run (torch's ring buffer); each is a few hundred bytes with its frames.
MAX_ENTRIES = 2_000_000


class RecordingDevice:
    """``device``, recording the allocator's history of every measured run (see the module docstring)."""

    def __init__(self, device: Any, memory: Any = None):
        if memory is None:
            import torch

            memory = torch.cuda.memory
        self.device = device
        self.memory = memory
        self.snapshots: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.device, name)

    def measure(self, work: Callable[[Any], Any], **kwargs: Any) -> Any:
        from ..compat import memory_snapshot, record_memory_history

        memory = self.memory
        record_memory_history(memory, "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES,
                              clear_history=True)
        try:
            return self.device.measure(work, **kwargs)
        finally:
            try:
                self.snapshots.append(memory_snapshot(memory))
            finally:
                record_memory_history(memory, None)

    def snapshot_of(self, trials: Any, batch: int) -> dict[str, Any] | None:
        """The snapshot of the last real trial at ``batch`` that ran to the end (``trials``: the probe's, in
        order; the real ones are the measured runs, one snapshot each)."""
        real = [t for t in trials if t.source == "real"]
        if len(real) != len(self.snapshots):
            return None
        found = [s for t, s in zip(real, self.snapshots) if t.batch == batch and not t.oom]
        return found[-1] if found else None
