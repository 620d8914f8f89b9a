"""Who made each allocation of the fit rule: Python frames, module, phase. Only while asked for.

A :class:`Recorder`, while active (``with recorder:``), binds every
:class:`~autotune.devices.tracker.LiveStorageTracker` that starts: the tracker
keeps its allocation trace and, for each allocation in it, the recorder notes

- the Python frames of the code that made it, innermost first, as
  ``torch.cuda.memory._record_memory_history(stacks="python")`` records them
  (``{"filename", "line", "name"}``; autotune's own dispatch frames left out);
- the module whose forward made it (its path in the model, ``blocks.3.attn``,
  through global module forward hooks) or, in the backward, the module whose
  forward made the autograd node that runs (autograd's sequence numbers: a
  node's number falls in the range its module's forward handed out);
- the phase of the fit rule (``micro-step 2 backward``), as the fit rule marks it.

Nothing here runs unless a recorder is active: trackers check one attribute.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compat import current_autograd_node, next_sequence_nr, node_sequence_nr
from .session import recording

SETUP = "setup"
_SKIP = (str(Path(__file__).resolve().parent) + "/", "torch/utils/_python_dispatch.py", "torch/_subclasses/",
         "torch/_ops.py")
#: Wrappers PyTorch puts around its dispatch (``torch._dynamo.disable``): innermost, they are the estimate's own
#: calls (a real allocation's trace starts at the op); further out they are the caller's and are kept.
_WRAPPERS = ("torch/_dynamo/eval_frame.py", "torch/_compile.py")
MAX_FRAMES = 64


@dataclass
class Made:
    """One allocation of the trace: who made it."""

    serial: int  # the tracker's storage serial (its category is looked up by it)
    frames: tuple[dict[str, Any], ...]
    module: str  # module path, "" outside every module
    node: int | None  # in the backward: the sequence number of the autograd node running
    phase: str
    label: str | None  # what a device allocation no tensor holds is (cuBLAS workspace, kernel scratch)


@dataclass
class Recording:
    """What one recorded run of the fit rule left: the tracker's trace and who made each allocation."""

    trace: list[tuple[int, int, int]]
    made: dict[int, Made]
    categories: dict[int, str]  # storage serial -> parameters, gradients, optimizer_state
    phases: list[tuple[int, str]]  # (index in the trace where the phase starts, its name)
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # (first, end) sequence numbers of a module
    _sorted: bool = False

    def module_of(self, made: Made) -> str:
        """The module path of an allocation: the forward's, else the one whose forward made the backward node."""
        if made.node is None or made.module:
            return made.module
        if not self._sorted:
            self.spans.sort(key=lambda s: s[0])
            self._sorted = True
        return _innermost(self.spans, made.node)


def _innermost(spans: list[tuple[int, int, str]], seq: int) -> str:
    """The path of the innermost module span holding ``seq``: spans nest, the latest-starting one that still
    holds it is the innermost."""
    starts = [s for s, _, _ in spans]
    i = bisect_right(starts, seq)
    while i > 0:
        i -= 1
        start, end, path = spans[i]
        if start <= seq < end:
            return path
    return ""


class Recorder:
    """Notes who made each allocation of the trackers that start while it is active (see the module docstring).

    ``frames``: capture the Python frames (off for the cheaper runs that need only the trace)."""

    def __init__(self, *, frames: bool = True):
        self.frames = frames
        self.recording: Recording | None = None
        self._tracker: Any = None
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._stack: list[tuple[str, int]] = []
        self._phase = SETUP
        self._frame_cache: dict[tuple[Any, int], dict[str, Any] | None] = {}
        self._active = contextlib.ExitStack()
        self._thread = threading.get_ident()
        self.leaf = 0  # which output of the op the tracker counts next

    # -- activation ----------------------------------------------------------------------

    def __enter__(self) -> Recorder:
        self._active.enter_context(recording(self))  # the estimate session binds the trackers that start
        return self

    def __exit__(self, *exc: object) -> None:
        self._active.close()

    def bind(self, tracker: Any) -> None:
        """A tracker starts: it records its trace, and a new recording begins (the last tracker's is kept)."""
        if self._tracker is not None:
            self._tracker.recorder = None
        self._tracker = tracker
        self._thread = threading.get_ident()
        tracker.recorder = self
        if tracker.trace is None:
            tracker.trace = []
        self.recording = Recording(trace=tracker.trace, made={}, categories=tracker._category, phases=[(0, SETUP)])
        self._phase = SETUP
        self._stack = []

    def unbind(self, tracker: Any) -> None:
        """``tracker`` stops: it tells this recorder nothing more (its recording is kept)."""
        tracker.recorder = None
        if self._tracker is tracker:
            self._tracker = None

    # -- what the tracker tells ---------------------------------------------------------

    def alloc(self, key: int, serial: int, label: str | None = None) -> None:
        rec = self.recording
        assert rec is not None
        node = current_autograd_node()
        module = self._stack[-1][0] if self._stack else ""
        rec.made[key] = Made(serial, self._frames() if self.frames else (), module,
                             None if node is None else node_sequence_nr(node), self._phase, label)

    def free(self, key: int) -> None:
        """The allocation ``key`` of the trace was freed (just appended to it)."""

    def op(self, func: Any, args: tuple) -> None:
        """The op whose outputs the tracker counts next (``func`` None: no op)."""

    def placing(self, model: torch.nn.Module) -> None:
        """``model``'s parameters and buffers are counted next."""

    def registering(self, tensor: torch.Tensor) -> None:
        """``tensor`` (a parameter, a buffer, a batch's tensor) is counted next."""

    def mark(self, phase: str) -> None:
        rec = self.recording
        if rec is not None and phase != self._phase:
            self._phase = phase
            rec.phases.append((len(rec.trace), phase))

    # -- modules ---------------------------------------------------------------------------

    def _path(self, module: torch.nn.Module) -> str:
        path = self._names.get(module)
        if path is not None:
            return path
        if self._stack:  # a module its parent does not hold as a child (made in the forward)
            path = f"{self._stack[-1][0]}.<{type(module).__name__}>"
            self._names[module] = path
            return path
        for name, child in module.named_modules():  # a new root: name all of its modules at once
            self._names.setdefault(child, name or f"<{type(module).__name__}>")  # the root: its own forward's
        return self._names[module]

    def enter_module(self, module: torch.nn.Module, args: Any) -> None:
        """A global forward pre-hook while a tracker is bound (another thread's modules are not the fit rule's)."""
        if self.recording is not None and threading.get_ident() == self._thread:
            self._stack.append((self._path(module), next_sequence_nr()))

    def leave_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.recording is not None and self._stack and threading.get_ident() == self._thread:
            path, start = self._stack.pop()
            end = next_sequence_nr()
            if end > start:
                self.recording.spans.append((start, end, path))  # sorted by start when read

    # -- frames ----------------------------------------------------------------------------

    def _frames(self) -> tuple[dict[str, Any], ...]:
        """The Python stack of the code that made the allocation, innermost first, without autotune's own
        dispatch machinery (the frames a real allocation's trace would show)."""
        out: list[dict[str, Any]] = []
        f: Any = sys._getframe(2)
        cache = self._frame_cache
        while f is not None and len(out) < MAX_FRAMES:
            code = f.f_code
            key = (code, f.f_lineno)
            if key in cache:
                frame = cache[key]
            else:  # one dict per place in the code, shared by every allocation made there
                name = code.co_filename
                frame = cache[key] = None if any(s in name for s in _SKIP) else \
                    {"filename": name, "line": f.f_lineno, "name": code.co_name}
            if frame is not None and (out or not frame["filename"].endswith(_WRAPPERS)):
                out.append(frame)
            f = f.f_back
        return tuple(out)


def record_with(recorder: Recorder, run: Any) -> tuple[Any, Recording]:
    """Run ``run()`` with ``recorder`` active; its result and the recording of the last tracker it started."""
    with recorder:
        result = run()
    if recorder.recording is None:
        raise RuntimeError("nothing was recorded: the work started no tracker")
    return result, recorder.recording
