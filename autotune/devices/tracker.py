"""The live-storage tracker: exact, repeatable device memory for the fit rule.

A ``TorchDispatchMode`` that sees every aten op, counts the bytes of every
tensor storage an op creates and subtracts them when the storage dies. Storages
are keyed by the identity of their (preserved) Python storage object and watched
through weak references, so the count works under ``FakeTensorMode`` too, where
``data_ptr()`` is 0. Ops on wrapper subclasses (DTensor) are counted as the
plain tensors they run on, and storages resized in place outside any op
(``UntypedStorage.resize_``, as FSDP frees and refills its unsharded
parameters) are counted at their new size. Outputs that alias an input (views, in-place and out= ops,
as the op's schema says) share the input's storage: never counted again, and
never counted at all when the input lives outside the device (a host batch).

It keeps the peak, a timeline of live bytes (one entry per allocation or free),
and at the peak a breakdown into parameters, gradients, optimizer state and the
rest (activations and temporaries, the input batch included). Storages that die
together, with no allocation between them, are counted off in the order they
were allocated, whatever order their deaths were reported in (clearing
autocast's cache frees its casts in the order of their addresses): the same
step gives the same timeline every time.

With ``capacity`` set it emulates a device of that size: an allocation that would
take live bytes past it raises ``torch.OutOfMemoryError`` instead.

With ``record=True`` it also keeps the allocation trace a CUDA caching allocator
would see (:attr:`LiveStorageTracker.trace`): one ``(key, nbytes, stream)`` per
storage created (its exact byte count, unrounded), ``(key, -1, 0)`` when it dies,
and the device memory kernels take that no tensor shows (a library's workspace,
a kernel's scratch buffers), which :mod:`autotune.devices.cudakernels` adds
through :meth:`LiveStorageTracker.device_alloc` and :meth:`LiveStorageTracker.scratch`.
Those are in the trace only: the live bytes count tensors.

While a :class:`~autotune.devices.recorder.Recorder` is active (only when a memory
snapshot or a breakdown of the peak is asked for), every tracker that starts
records the trace and tells the recorder about each allocation (its Python
frames, module and phase) and each phase the fit rule marks; otherwise the
recorder costs one attribute check per recorded allocation.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..compat import (
    DataDependentOutputException,
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
    op_schema,
    tree_flatten,
)
from ..units import format_bytes
from .session import watch

if TYPE_CHECKING:
    from .values import KnownValues

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
_PRECEDENCE = {name: rank for rank, name in enumerate(CATEGORIES)}

_SCALAR = torch.ops.aten._local_scalar_dense.default
_TO_COPY = torch.ops.aten._to_copy.default
_IGNORED = {torch.ops.prim.device.default, torch.ops.prim.layout.default}


_ALIASED: dict = {}
_WRAPPER: dict[type, bool] = {}
_CREATES = {torch.ops.aten.lift_fresh.default}  # torch.tensor(...) data enters through it


def _aliased_returns(func) -> tuple[bool, ...]:
    """Per return of ``func``: does its schema say it aliases an input?"""
    flags = _ALIASED.get(func)
    if flags is None:
        returns = op_schema(func).returns
        flags = tuple(r.alias_info is not None and func not in _CREATES for r in returns) or (False,)
        _ALIASED[func] = flags
    return flags


def _wraps(types: Any) -> bool:
    """Is one of ``types`` a wrapper subclass (DTensor), which runs its op on plain tensors inside?"""
    for t in types:
        flag = _WRAPPER.get(t)
        if flag is None:
            flag = _WRAPPER[t] = is_traceable_wrapper_subclass_type(t)
        if flag:
            return True
    return False


def plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s data: ``t`` itself, or a wrapper subclass's inner tensors."""
    if is_traceable_wrapper_subclass(t):
        for attr in t.__tensor_flatten__()[0]:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):  # DTensor also names its device mesh
                yield from plain_tensors(inner)
    else:
        yield t


def _unknown_scalar(dtype: torch.dtype, guess: int) -> bool | float | int:
    """The answer to ``.item()`` of a tensor whose value is unknown: guess 0 is False/1/1.0,
    guess 1 is True/2/2.0 (a second run with other answers shows whether they matter)."""
    if dtype == torch.bool:
        return bool(guess)
    return float(1 + guess) if dtype.is_floating_point else 1 + guess


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What the tracker saw: peak and current live bytes, the breakdown at the peak."""

    peak_bytes: int
    current_bytes: int
    breakdown: dict[str, int]
    timeline: tuple[int, ...]
    unknown_reads: int = 0


@dataclass(frozen=True)
class Replayed:
    """One event of an allocation trace to make again (:meth:`LiveStorageTracker.replay`): an allocation of
    ``nbytes`` on ``stream`` (``device``: memory no tensor holds), its ``category`` and the recorder's ``tags``
    for it; or, with ``nbytes`` -1, the free of the allocation of event number ``freed``."""

    nbytes: int
    stream: int = 0
    device: bool = False
    category: str | None = None
    tags: Any = None
    freed: int = -1


class _Entry:
    __slots__ = ("nbytes", "ref", "serial", "tkey")

    def __init__(self, serial: int, nbytes: int, ref: weakref.ref):
        self.serial = serial
        self.nbytes = nbytes
        self.ref = ref
        self.tkey = serial  # its key in the trace (a resize makes a new allocation)


class LiveStorageTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes while active (``with tracker:``).

    ``capacity``: emulated device size in bytes, or None for no limit.
    ``round_to``: round every allocation up to this many bytes (512 stands in for
    CUDA's caching allocator); 1 counts bytes exactly.
    ``fake_scalars``: answer ``.item()`` on a fake or meta tensor whose value is
    unknown (0/False for booleans, 1 otherwise) instead of raising; used by
    estimates, where optimizers read step counters. ``unknown_reads`` counts the
    answers given outside :meth:`values_do_not_shape` blocks (the forward and
    backward, where a read value may decide a shape); ``guess`` picks the
    answers (0 or 1), so that a second run shows whether they changed anything.
    ``kernel``: runs each op, ``kernel(func, args, kwargs)``; by default the op
    itself (estimates pass :class:`autotune.devices.values.KnownValues` around
    :class:`autotune.devices.meta.MetaKernels`). ``values``: where that kernel
    keeps known values, asked first for ``.item()`` of a shape-only tensor.
    ``record``: keep the allocation trace (see the module docstring); ``stream``
    is the CUDA stream its allocations are recorded on; ``after_op(func, args,
    kwargs, out)``, when set, is called after each counted op. ``compiled_runs``:
    ``torch.compile``'d code inside runs compiled (a real device's run); the
    tracker then sees the ops around it and those the compiled code dispatches,
    not the buffers Inductor allocates itself. Without it, dynamo runs such code
    as its eager program while the tracker is active (what shape-only tensors need).
    ``watched=False``: resizes outside ops are not told to it and no recorder binds it
    (a count of host-side work inside a measurement).
    """

    def __init__(self, *, capacity: int | None = None, round_to: int = 1, fake_scalars: bool = False,
                 kernel: Callable[[Any, tuple, dict], Any] | None = None, guess: int = 0, record: bool = False,
                 values: KnownValues | None = None, compiled_runs: bool = False, watched: bool = True):
        super().__init__()
        self.compiled_runs = compiled_runs
        self.watched = watched
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if round_to < 1:
            raise ValueError(f"round_to must be at least 1, got {round_to}")
        self.capacity = capacity
        self.round_to = round_to
        self.fake_scalars = fake_scalars
        self.kernel = kernel
        self.values = values
        self.guess = guess
        self.unknown_reads = 0
        self._reads_do_not_shape = 0
        self._live: dict[int, _Entry] = {}
        self._category: dict[int, str] = {}
        self._serial = 0
        self._paused = 0
        self._current = 0
        self.peak_bytes = 0
        self._timeline: list[int] = []
        self._dying: list[tuple[int, int]] = []  # (key, serial) of storages dead since the last allocation
        self._peak_live: list[tuple[int, int]] | None = []
        self._peak_pending = False
        self.trace: list[tuple[int, int, int]] | None = [] if record else None
        self.stream = 0
        self.after_op: Callable[[Any, tuple, dict, Any], None] | None = None
        self.recorder: Any = None  # told about every allocation in the trace, when set (see the module docstring)
        self.device_keys: set[int] = set()  # the keys of device memory no tensor holds (device_alloc)
        self._session = contextlib.ExitStack()  # what entering it installed in torch

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]  # per tracker, not per class
        """TorchDispatchMode's switch: off while torch.compile compiles, on while its compiled code runs."""
        return self.compiled_runs

    # -- counting -------------------------------------------------------------------

    def _size(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        if self.round_to > 1 and n:
            n = -(-n // self.round_to) * self.round_to
        return n

    @property
    def current_bytes(self) -> int:
        """Live bytes now."""
        self._settle()
        return self._current

    @property
    def timeline(self) -> list[int]:
        """Live bytes after every allocation and free so far."""
        self._settle()
        return self._timeline

    def _died(self, key: int, serial: int) -> None:
        """A storage died: counted off before the next allocation (or reading of the count)."""
        self._dying.append((key, serial))

    def _settle(self) -> None:
        """Count off the storages that died since the last allocation, in the order they were allocated."""
        while self._dying:
            dying = sorted(self._dying, key=lambda d: d[1])
            self._dying.clear()  # a death reported while counting these comes round again
            for key, serial in dying:
                entry = self._live.get(key)
                if entry is not None and entry.serial == serial:
                    self._on_death(key)

    def _on_death(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        if self._peak_pending and self._current == self.peak_bytes:
            self._take_peak_snapshot()  # before the entry leaves: it is part of the peak
        del self._live[key]
        self._current -= entry.nbytes
        self._timeline.append(self._current)
        if self.trace is not None and entry.nbytes:
            self.trace.append((entry.tkey, -1, 0))
            if self.recorder is not None:
                self.recorder.free(entry.tkey)

    def _add(self, storage: torch.UntypedStorage, category: str | None = None) -> None:
        self._settle()
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None and entry.ref() is storage:
            n = self._size(storage)
            if n != entry.nbytes:  # resized in place
                self._grow(n - entry.nbytes)
                if self.trace is not None:  # a CUDA storage grows into a new block, then frees the old one
                    self._serial += 1
                    self.trace.append((self._serial, n, self.stream))
                    if self.recorder is not None:
                        self.recorder.alloc(self._serial, entry.serial)
                    if entry.nbytes:
                        self.trace.append((entry.tkey, -1, 0))
                        if self.recorder is not None:
                            self.recorder.free(entry.tkey)
                    entry.tkey = self._serial
                entry.nbytes = n
            if category is not None:
                self._set_category(entry.serial, category)
            return
        if entry is not None:  # a dead storage whose callback has not run yet
            self._on_death(key)
        n = self._size(storage)
        self._grow(n)
        self._serial += 1
        tracker_ref = weakref.ref(self)

        def died(_ref: weakref.ref, key: int = key, serial: int = self._serial) -> None:
            tracker = tracker_ref()
            if tracker is not None:
                tracker._died(key, serial)

        self._live[key] = _Entry(self._serial, n, weakref.ref(storage, died))
        if self.trace is not None and n:
            self.trace.append((self._serial, n, self.stream))
            if self.recorder is not None:
                self.recorder.alloc(self._serial, self._serial)
        if category is not None:
            self._set_category(self._serial, category)

    def _grow(self, n: int) -> None:
        if n < 0 and self._peak_pending and self._current == self.peak_bytes:
            self._take_peak_snapshot()
        if n > 0 and self.capacity is not None and self._current + n > self.capacity:
            raise torch.OutOfMemoryError(
                f"emulated capacity exceeded: allocating {format_bytes(n)} ({n} bytes) would make "
                f"{format_bytes(self._current + n)} ({self._current + n} bytes) live, "
                f"capacity is {format_bytes(self.capacity)} ({self.capacity} bytes)"
            )
        self._current += n
        self._timeline.append(self._current)
        if self._current > self.peak_bytes:
            self.peak_bytes = self._current
            self._peak_pending = True

    def _take_peak_snapshot(self) -> None:
        self._peak_live = [(e.serial, e.nbytes) for e in self._live.values()]
        self._peak_pending = False

    def _set_category(self, serial: int, category: str) -> None:
        old = self._category.get(serial)
        if old is None or _PRECEDENCE[category] < _PRECEDENCE[old]:
            self._category[serial] = category

    def __enter__(self) -> LiveStorageTracker:
        # In the estimate session: resizes outside any op are told to it, an active recorder binds it.
        with contextlib.ExitStack() as stack:
            if self.watched:
                stack.enter_context(watch(self))
            entered = super().__enter__()
            self._session = stack.pop_all()
        return entered

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            try:
                self._settle()
            finally:
                self._session.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _IGNORED:
            return func(*args, **(kwargs or {}))
        if _wraps(types):
            return NotImplemented  # the subclass runs the op on plain tensors, which come back here
        if func is _SCALAR and self.fake_scalars:
            known = self.values.scalar(args[0]) if self.values is not None else None
            if known is not None:
                return known
            if not args[0].is_meta:
                try:
                    return func(*args, **(kwargs or {}))
                except DataDependentOutputException:
                    pass
            if not self._reads_do_not_shape:
                self.unknown_reads += 1
            return _unknown_scalar(args[0].dtype, self.guess)
        if self.kernel is not None:
            out = self.kernel(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        if not self._paused and not (func is _TO_COPY and args[0].is_meta and isinstance(out, torch.Tensor)
                                     and not out.is_meta):
            # (A device tensor's value copied to the host is host memory; on the CPU, the tensor itself.)
            aliased = _aliased_returns(func)
            recorder = self.recorder
            if recorder is not None:
                recorder.op(func, args)
            if isinstance(out, torch.Tensor):
                self._seen(out, aliased[0])
            else:
                leaves = tree_flatten(out)[0]
                flags = aliased * len(leaves) if len(aliased) == 1 else aliased
                for i, (leaf, alias) in enumerate(zip(leaves, flags)):
                    if isinstance(leaf, torch.Tensor):
                        if recorder is not None:
                            recorder.leaf = i
                        self._seen(leaf, alias)
            if recorder is not None:
                recorder.op(None, ())
            if self.after_op is not None:
                self.after_op(func, args, kwargs or {}, out)
        return out

    def _seen(self, t: torch.Tensor, alias: bool) -> None:
        """An op's output: a new storage is counted; one that aliases an input (a view,
        an in-place or out= op) was either counted already or lives outside the device."""
        storage = t.untyped_storage()
        if alias:
            self.resized(storage)  # an in-place resize_ is the only way an alias changes the count
        else:
            self._add(storage)

    # -- public ---------------------------------------------------------------------

    def register(self, tensors: Iterable[torch.Tensor], category: str | None = None, *,
                 model: torch.nn.Module | None = None) -> None:
        """Count storages that already exist (parameters, a batch moved to the device); ``model``: the model
        they are the parameters and buffers of (told to the recorder)."""
        if model is not None:
            self.placing(model)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                if self.recorder is not None:
                    self.recorder.registering(t)
                for plain in plain_tensors(t):
                    self._add(plain.untyped_storage(), category)
        if self.recorder is not None:
            self.recorder.op(None, ())

    def placing(self, model: torch.nn.Module) -> None:
        """``model``'s parameters and buffers are allocated or counted next (told to the recorder)."""
        if self.recorder is not None:
            self.recorder.placing(model)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A counted storage was resized in place: count its new size (a storage the tracker
        never counted stays uncounted)."""
        entry = self._live.get(id(storage))
        if entry is not None and entry.ref() is storage:
            self._add(storage)

    def tag(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Name what live storages are (gradients, optimizer state) for the breakdown."""
        if category not in _PRECEDENCE:
            raise ValueError(f"unknown category {category!r}; one of {CATEGORIES}")
        self._settle()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for plain in plain_tensors(t):
                    entry = self._live.get(id(plain.untyped_storage()))
                    if entry is not None:
                        self._set_category(entry.serial, category)

    def device_alloc(self, nbytes: int, label: str = "workspace") -> int:
        """Record device memory that no tensor holds (a library's workspace, named by ``label``), live from now
        on; returns its key."""
        self._settle()
        self._serial += 1
        self.device_keys.add(self._serial)
        if self.trace is not None and nbytes > 0:
            self.trace.append((self._serial, nbytes, self.stream))
            if self.recorder is not None:
                self.recorder.alloc(self._serial, self._serial, label)
        return self._serial

    def device_free(self, key: int) -> None:
        self._settle()
        if self.trace is not None:
            self.trace.append((key, -1, 0))
            if self.recorder is not None:
                self.recorder.free(key)

    def position(self) -> tuple[int, int, int]:
        """Where the counting stands: events in the trace, allocations made (serials given), live-byte changes."""
        return len(self.trace or ()), self._serial, len(self._timeline)

    def dying_keys(self) -> set[int]:
        """The trace keys of the storages that died and are not freed yet (they are, at the next allocation)."""
        out = set()
        for key, serial in self._dying:
            entry = self._live.get(key)
            if entry is not None and entry.serial == serial:
                out.add(entry.tkey)
        return out

    def category_of(self, serial: int) -> str | None:
        """The category named for allocation ``serial`` (None: none, so activations)."""
        return self._category.get(serial)

    def replay(self, events: Sequence[Replayed], owner: object) -> None:
        """Make again, in order, the allocations and frees that the same code made in another run (see
        :mod:`autotune.probing.stepreuse`), as if it ran now: each allocation counted (device memory no tensor
        holds in the trace only), with its category and, for the recorder, its recorded tags; each free of one of
        them. The tensors still live at the end die with ``owner``."""
        keys: list[int] = []
        tracker_ref = weakref.ref(self)
        for event in events:
            if event.nbytes < 0:
                key = keys[event.freed]
                keys.append(0)
                if event.device:
                    self.device_free(key)
                else:
                    self._settle()
                    self._on_death(-key)
                continue
            self._settle()
            if not event.device:
                self._grow(event.nbytes)
            self._serial += 1
            serial = self._serial
            keys.append(serial)
            if event.device:
                self.device_keys.add(serial)
            else:
                def died(_ref: weakref.ref, key: int = -serial, serial: int = serial) -> None:
                    tracker = tracker_ref()
                    if tracker is not None:
                        tracker._died(key, serial)

                self._live[-serial] = _Entry(serial, event.nbytes, weakref.ref(owner, died))
                if event.category is not None:
                    self._set_category(serial, event.category)
            if self.trace is not None:
                self.trace.append((serial, event.nbytes, event.stream))
                if self.recorder is not None:
                    self.recorder.replayed_alloc(serial, -1 if event.device else serial, event.tags)

    def scratch(self, sizes: Iterable[int]) -> None:
        """Record a kernel's scratch buffers: allocated in order, all freed when the kernel returns."""
        if self.trace is None:
            return
        keys = [self.device_alloc(n, "kernel scratch") for n in sizes if n > 0]
        for key in keys:
            self.device_free(key)

    def mark(self, phase: str) -> None:
        """The fit rule enters ``phase`` (a micro-step's forward or backward, an optimizer step): told to the
        recorder, when there is one."""
        if self.recorder is not None:
            self._settle()  # what died before the phase began is freed in the phase before
            self.recorder.mark(phase)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run but what they create is not counted (host-side work such as building a batch)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def values_do_not_shape(self) -> Iterator[None]:
        """Unknown values read inside this block decide no shape (an optimizer's step counters)."""
        self._reads_do_not_shape += 1
        try:
            yield
        finally:
            self._reads_do_not_shape -= 1

    def breakdown(self) -> dict[str, int]:
        """Bytes per category at the peak; the values sum to ``peak_bytes``."""
        self._settle()
        if self._peak_pending:
            self._take_peak_snapshot()
        out = dict.fromkeys(CATEGORIES, 0)
        for serial, nbytes in self._peak_live or ():
            out[self._category.get(serial, "activations")] += nbytes
        return out

    def snapshot(self) -> Snapshot:
        return Snapshot(
            peak_bytes=self.peak_bytes,
            current_bytes=self.current_bytes,
            breakdown=self.breakdown(),
            timeline=tuple(self.timeline),
            unknown_reads=self.unknown_reads,
        )
