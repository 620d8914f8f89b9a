"""Models and functions ``torch.compile`` wrapped: run compiled on a real device, as their eager program in an estimate.

A real device's run lets compiled code run compiled
(:class:`~autotune.devices.tracker.LiveStorageTracker` with ``compiled_runs``).
The tracker sees the ops around compiled code and those it dispatches, but
not the buffers Inductor's generated code allocates itself (it calls the CPU
allocator directly): on the CPU, from a compiled model's first use on, the
CPU allocator's own count decides (:class:`AllocatorCount`: torch.profiler's
memory events; it also counts what the host allocates meanwhile, such as the
batch before it is copied to the device). On CUDA the caching allocator's
reserved peak decides anyway.

An estimate runs on shape-only tensors, where Inductor's kernels cannot run:
inside :func:`eager_compiled` compiled code runs as its eager program (without
dynamo marking the frames it would have compiled as skipped, so a real run
after the estimate still compiles), and :func:`eager_note` says so, with the
figure a compiled run may change (the activations and temporaries at the
peak); the confirm run measures the compiled program.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..compat import allocator_events, compiled_module
from ..units import format_bytes


def compiled_parts(model: nn.Module) -> list[str]:
    """The compiled modules of ``model``, by name ("the model" for the model itself)."""
    return [name or "the model" for name, module in model.named_modules() if compiled_module(module)]


@contextlib.contextmanager
def eager_compiled() -> Iterator[None]:
    """Inside, compiled code runs as its eager program (``torch.compiler.set_stance("force_eager")``)."""
    with torch.compiler.set_stance("force_eager"):
        yield


class AllocatorCount:
    """The CPU allocator's count of bytes from :meth:`start` to :meth:`stop`; ``peak`` adds ``base``, the bytes
    live at the start."""

    def __init__(self) -> None:
        self._profile: Any = None
        self.base = 0
        self.peak = 0

    @property
    def started(self) -> bool:
        return self._profile is not None

    def start(self, base: int) -> None:
        if self._profile is not None:
            return
        self.base = self.peak = base
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with _native_stderr_silenced():  # the profiler's C++ side prints a line as it starts and stops
            self._profile.__enter__()

    def stop(self) -> None:
        if self._profile is None or self.peak != self.base:
            return
        with _native_stderr_silenced():
            self._profile.__exit__(None, None, None)
        live = high = 0
        for n in allocator_events(self._profile):
            live += n
            high = max(high, live)
        self.peak = self.base + high


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null while inside (what C++ code writes there), then back."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def compiled_note(parts: list[str], tracked_peak: int, peak: int) -> str:
    """What a real CPU run of compiled code measured, and how."""
    return (f"{_what(parts)} ran compiled (torch.compile): its peak, {format_bytes(peak)}, is the CPU allocator's "
            f"own count from the model's first use (Inductor's buffers are not ops the tracker sees; it counted "
            f"{format_bytes(tracked_peak)})")


def eager_note(parts: list[str], activations: int, peak: int) -> str:
    """What an estimate of compiled code measured instead, and by how much the compiled run may differ."""
    return (f"{_what(parts)} is compiled (torch.compile): estimated as its eager program, since Inductor's kernels "
            f"do not run on shape-only tensors. Compiled, AOTAutograd keeps for backward what its partitioner "
            f"chooses and Inductor reuses buffers: the activations and temporaries at the peak, "
            f"{format_bytes(activations)} of {format_bytes(peak)} ({activations / max(peak, 1):.0%}), are what the "
            f"compiled run may change (fusion "
            f"usually lowers them); a real run measures it compiled")


def _what(parts: list[str]) -> str:
    return ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
