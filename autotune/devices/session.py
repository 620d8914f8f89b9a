"""The estimate session: every change autotune makes to torch's global state, made and undone here, one
measurement at a time.

A measurement changes torch's process-wide state while it runs, and only then:

- :func:`watch`: ``UntypedStorage.resize_``, which no dispatch mode sees (FSDP frees and refills its
  unsharded parameters with it), tells the active trackers; and a
  :class:`~autotune.devices.recorder.Recorder` active on this thread binds the tracker and hooks every
  module's forward (to name the module of each allocation);
- :func:`aten_kernels`: kernels registered for aten's operators (the CPU's and CUDA's kernel choices on
  ``meta`` tensors, the recurrent stand-ins, oneDNN's ``meta`` kernels, the shape rules);
- :func:`fake_mesh`: a fake process group registered with c10d for FSDP's device mesh;
- :func:`shape_propagation_uncounted`: DTensor's shape propagation run outside the trackers' count;
- ``EstimateSession(quiet=True)``: torch's fake-tensor logger silenced (:mod:`autotune.devices.quiet`);
- :func:`cuda_stand_in`: the CUDA GPU an estimate stands in for, as the user's code sees it
  (:mod:`autotune.devices.cudastandin`): ``torch.cuda``'s answers, ``"cuda"`` devices, the optimizers' device
  lists, the device type activation checkpointing reads, ``torch.clear_autocast_cache``, CUDA's autocast key on
  every dispatch of the thread and its kernels (:mod:`autotune.devices.cudaamp`), and torch's autocast state as
  it was, after.

Each of these is a context manager that takes :class:`EstimateSession`, and every measurement of every
device runs in one (:func:`~autotune.devices.base.timed_measure`). Sessions hold one process-wide lock,
re-entrant on its thread: measurements in several threads run one after the other, never interleaved
(two estimates would otherwise register kernels for the same operator, and each tracker would count the
other's resizes). When the outermost session of a measurement ends, nothing of autotune's is left in
torch (:func:`leftovers`); anything that is left is removed and reported as a bug (:class:`LeftBehind`).

Nothing here runs at import: importing autotune changes nothing in torch.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from .. import compat
from ..errors import undo_on_failure
from .quiet import quiet_torch_logs


class LeftBehind(RuntimeError):
    """A measurement ended with something of autotune's still installed in torch (a bug of autotune's)."""


_LOCK = threading.RLock()
_local = threading.local()


def _sessions() -> list[EstimateSession]:
    """This thread's open sessions, outermost first."""
    found = getattr(_local, "sessions", None)
    if found is None:
        found = _local.sessions = []
    return found


def _recorders() -> list[Any]:
    """This thread's active recorders, innermost last."""
    found = getattr(_local, "recorders", None)
    if found is None:
        found = _local.recorders = []
    return found


class EstimateSession:
    """One measurement's hold on torch's global state: the process-wide lock while it is open, torch as it
    was when the outermost one closes. ``quiet``: torch's fake-tensor logger is silenced meanwhile."""

    def __init__(self, *, quiet: bool = False):
        self.quiet = quiet
        self._quiet: contextlib.ExitStack | None = None

    def __enter__(self) -> EstimateSession:
        _LOCK.acquire()
        with undo_on_failure(_LOCK.release):
            if self.quiet:
                self._quiet = contextlib.ExitStack()
                self._quiet.enter_context(quiet_torch_logs())
            _sessions().append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            if self._quiet is not None:
                self._quiet.close()
                self._quiet = None
            sessions = _sessions()
            sessions.remove(self)
            if not sessions:
                _check_clean(raising=kind is None)
        finally:
            _LOCK.release()


def active() -> bool:
    """Is a session open on this thread?"""
    return bool(_sessions())


# -- the resize watcher and the recorder's binding ---------------------------------------------------------

_RESIZE = torch.UntypedStorage.resize_  # torch's own (inherited from torch._C.StorageBase)
_WATCHING: list[Any] = []
_HOOKS: list[Any] = []


def _watched_resize(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_``, which no dispatch mode sees, told to every active tracker (from any thread:
    autograd's device threads resize too)."""
    out = _RESIZE(storage, size)
    for tracker in _WATCHING:
        tracker.resized(storage)
    return out


def _watch_resizes() -> None:
    setattr(torch.UntypedStorage, "resize_", _watched_resize)  # noqa: B010


def _unwatch_resizes() -> None:
    if "resize_" in vars(torch.UntypedStorage):
        delattr(torch.UntypedStorage, "resize_")


@contextlib.contextmanager
def watch(tracker: Any) -> Iterator[None]:
    """While ``tracker`` counts: storages resized in place are told to it, and the innermost recorder active
    on this thread (if any) binds it."""
    with EstimateSession():
        if not _WATCHING:
            _watch_resizes()
        _WATCHING.append(tracker)
        recorders = _recorders()
        recorder = recorders[-1] if recorders and tracker.recorder is None else None
        try:
            if recorder is not None:
                recorder.bind(tracker)
                _HOOKS.extend(module_hooks(recorder.enter_module, recorder.leave_module))
            yield
        finally:
            if recorder is not None:
                _unhook()
                recorder.unbind(tracker)
            _WATCHING.remove(tracker)
            if not _WATCHING:
                _unwatch_resizes()


def _unhook() -> None:
    while _HOOKS:
        _HOOKS.pop().remove()


@contextlib.contextmanager
def recording(recorder: Any) -> Iterator[None]:
    """``recorder`` binds the trackers that start on this thread while inside (see :func:`watch`)."""
    recorders = _recorders()
    recorders.append(recorder)
    try:
        yield
    finally:
        recorders.remove(recorder)


def module_hooks(enter: Any, leave: Any) -> list[Any]:
    """Global forward hooks on every module (``enter(module, args)`` before, ``leave(module, args, output)``
    after, also when the forward raises); the handles remove them."""
    return [nn_module.register_module_forward_pre_hook(enter),
            nn_module.register_module_forward_hook(leave, always_call=True)]


# -- kernels for aten's operators ---------------------------------------------------------------------------

_LIBRARIES: list[torch.library.Library] = []


@contextlib.contextmanager
def aten_kernels() -> Iterator[torch.library.Library]:
    """A library to register kernels for aten's operators in, while inside; its kernels are removed after."""
    with EstimateSession():
        library = compat.aten_library()
        _LIBRARIES.append(library)
        try:
            yield library
        finally:
            compat.destroy_library(library)
            if not compat.library_alive(library):
                _LIBRARIES.remove(library)


# -- FSDP: fake process groups, DTensor's shape propagation ---------------------------------------------------

_FAKE_GROUPS: dict[str, list[Any]] = {}  # name -> [group, blocks using it]
_QUIET: list[Any] = []  # trackers that do not count DTensor's shape propagation


@contextlib.contextmanager
def fake_mesh(world_size: int, rank: int = 0, device_type: str = "cpu") -> Iterator[Any]:
    """A one-dimensional DeviceMesh of ``world_size`` ranks on a private fake process group.

    The group is registered (DTensor finds groups by name) for as long as the
    block runs, under a name of its own per world size, rank and device type,
    and never becomes the default group. The mesh's dimension is named
    ``autotune_fake``, so DTensor's caches never confuse it with a real mesh
    of the same ranks, and a later fake mesh of the same shape, which shares
    those caches, finds its own group under the same name.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    name = f"autotune-fake-{world_size}-{rank}-{device_type}"
    with EstimateSession():
        entry = _FAKE_GROUPS.get(name)
        if entry is None:
            group = compat.fake_process_group(name, rank, world_size, {"cpu", "meta", device_type})
            compat.register_process_group(name, group)
            entry = _FAKE_GROUPS[name] = [group, 0]
        entry[1] += 1
        try:
            yield compat.device_mesh_on(entry[0], name, device_type, world_size, rank)
        finally:
            entry[1] -= 1
            if not entry[1]:
                _unregister_group(name)


def _unregister_group(name: str) -> None:
    del _FAKE_GROUPS[name]
    compat.unregister_process_group(name)


@contextlib.contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """While inside, ``fully_shard`` places its units on ``meta`` (the meta engine's device tensors): its
    buffers are ``meta`` tensors, its streams and events the CPU's (which wait for nothing), as FSDP runs on
    the CPU, and its check that no parameter is left on ``meta`` is off."""
    def meta_handle(device_type: str = "cuda") -> Any:
        return torch.cpu if device_type == "meta" else compat.device_handle(device_type)

    replacements = {"_get_device_handle": meta_handle, "_get_device_from_mesh": lambda mesh: torch.device("meta"),
                    "_validate_no_meta_params": lambda group: None}
    places = compat.fsdp_device_lookups()
    with EstimateSession():
        saved = [(owner, name, getattr(owner, name)) for owner, name in places]
        for owner, name in places:
            setattr(owner, name, replacements[name])
        try:
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


@contextlib.contextmanager
def strided_flag_read_once() -> Iterator[None]:
    """While inside, DTensor reads an op's inputs for ``_StridedShard``'s flag once per op, not once per
    output: a foreach op over N parameters took N x N reads (most of an optimizer step's first run on an
    LLM's shards). Where no input carries one the flag's function does nothing, so skipping it is exact. A torch
    without the flag reads nothing: nothing to change."""
    flag = compat.strided_shard_flag()
    if flag is None:
        yield
        return
    owner, name, strided = flag
    original = getattr(owner, name)
    plain: list[Any] = [None]  # the last op schema seen without a _StridedShard (kept alive: ids stay unique)

    def propagate(op_strategy: Any, op_schema: Any) -> None:
        if op_schema is plain[0]:
            return
        if strided(op_schema):
            original(op_strategy, op_schema)
            return
        plain[0] = op_schema

    with EstimateSession():
        setattr(owner, name, propagate)
        try:
            yield
        finally:
            setattr(owner, name, original)


@contextlib.contextmanager
def shape_propagation_uncounted(tracker: Any) -> Iterator[None]:
    """While the block runs, ``tracker`` does not count the fake tensors DTensor makes to work out
    an op's output shape (once per op and shapes): they are no device memory.

    DTensor runs each new op once on fake global-shape tensors, inside whatever
    ``FakeTensorMode`` is active (an estimate's own) or a fresh one, and every
    dispatch mode sees those ops.
    """
    owner, method = compat.shape_propagation()
    with EstimateSession():
        if not _QUIET:
            original = getattr(owner, method)

            def quiet(self: Any, op_schema: Any) -> Any:
                with contextlib.ExitStack() as stack:
                    for t in _QUIET:
                        stack.enter_context(t.paused())
                    return original(self, op_schema)

            quiet.original = original  # type: ignore[attr-defined]
            setattr(owner, method, quiet)
        _QUIET.append(tracker)
        try:
            yield
        finally:
            _QUIET.remove(tracker)
            if not _QUIET:
                _restore_shape_propagation()


def _restore_shape_propagation() -> None:
    owner, method = compat.shape_propagation()
    patched = getattr(owner, method)
    if hasattr(patched, "original"):
        setattr(owner, method, patched.original)


# -- the CUDA stand-in ------------------------------------------------------------------------------------------

_PATCHED: dict[tuple[Any, str], Any] = {}  # (owner, attribute) -> torch's own, while a stand-in is installed
_DEVICE_MODES: list[Any] = []


def _patch(owner: Any, name: str, value: Any) -> None:
    _PATCHED.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def _unpatch() -> None:
    while _PATCHED:
        (owner, name), original = _PATCHED.popitem()
        setattr(owner, name, original)


def _autocast_state() -> tuple[bool, torch.dtype, bool]:
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled()


def _restore_autocast(state: tuple[bool, torch.dtype, bool]) -> None:
    torch.set_autocast_enabled("cuda", state[0])
    torch.set_autocast_dtype("cuda", state[1])
    torch.set_autocast_cache_enabled(state[2])


def _clearing(clear: Any, amp: Any) -> Any:
    def clear_autocast_cache() -> None:
        clear()
        amp.clear_cache()

    return clear_autocast_cache


@contextlib.contextmanager
def cuda_stand_in(devices: Any, answers: Any, amp: Any, lists: Any) -> Iterator[Any]:
    """While inside, the user's code runs as on the CUDA GPU an estimate stands in for: ``answers``
    (:class:`~autotune.devices.cudastandin.GpuAnswers`, None: torch's own, a real GPU's) answer ``torch.cuda``'s
    questions, the mode ``devices`` puts ``"cuda"`` tensors on the estimate's device, ``lists`` adds it to the
    optimizers' device lists and ``amp`` (:class:`~autotune.devices.cudaamp.CudaAutocast`) is
    ``autocast("cuda")``'s policy. All of it, and torch's autocast state, is as before after the block, also
    when it raised."""
    with EstimateSession():
        if _PATCHED or _DEVICE_MODES or compat.autocast_cuda_included():
            raise RuntimeError("a CUDA stand-in is installed already: estimates do not nest")
        state = _autocast_state()
        try:
            with aten_kernels() as library:
                amp.register(library)
                for name, fn in (answers.functions() if answers is not None else {}).items():
                    _patch(torch.cuda, name, fn)
                for name, fn in (answers.accelerator_functions() if answers is not None else {}).items():
                    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, name):
                        _patch(torch.accelerator, name, fn)
                _patch_device_lists(lists)
                module, name = compat.checkpoint_device_type()
                _patch(module, name, devices.device_type_of(getattr(module, name)))
                _patch(torch, "clear_autocast_cache", _clearing(torch.clear_autocast_cache, amp))
                compat.include_autocast_cuda(True)
                _DEVICE_MODES.append(devices)
                with devices:
                    yield devices
        finally:
            _DEVICE_MODES.clear()
            compat.include_autocast_cuda(False)
            _unpatch()
            amp.clear_cache()
            _restore_autocast(state)


@contextlib.contextmanager
def fakes_not_traced() -> Iterator[None]:
    """While inside, Hugging Face transformers takes FakeTensorMode's tensors for the tensors they stand for:
    its ``is_tracing`` counts a FakeTensor as tracing (compile, export), and tracing builds the explicit causal
    mask that the real run skips for SDPA's ``is_causal`` (a mask, and attention over it, the real run does not
    hold). The real run is not traced; the estimate runs its code. transformers' own function after the block,
    also when it raised; nothing where transformers is not imported."""
    module: Any = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_fake_tensor", None)
    if original is None:
        yield
        return
    module.is_fake_tensor = _not_fake
    try:
        yield
    finally:
        module.is_fake_tensor = original


def _not_fake(x: Any) -> bool:
    return False


@contextlib.contextmanager
def optimizer_lists(lists: Any) -> Iterator[None]:
    """While inside, ``lists`` (:class:`~autotune.devices.cudastandin.DeviceLists`) adds the estimate's device to
    the optimizers' device lists (on an estimate of the CPU, ``fused=True`` then runs on its meta tensors, as the
    CPU's fused kernels run); torch's own lists after the block, also when it raised."""
    with EstimateSession():
        if _PATCHED:
            raise RuntimeError("a stand-in is installed already: estimates do not nest")
        try:
            _patch_device_lists(lists)
            yield
        finally:
            _unpatch()


def _patch_device_lists(lists: Any) -> None:
    """The optimizers' lists of devices with fused and foreach kernels, as ``lists`` wraps them."""
    for module, name, original in compat.optimizer_device_lists():
        _patch(module, name, lists.wrap(original))


# -- what is left ----------------------------------------------------------------------------------------------

def leftovers() -> list[str]:
    """What of autotune's is installed in torch now, in words (nothing, outside a measurement)."""
    found = []
    if "resize_" in vars(torch.UntypedStorage) or _WATCHING:
        found.append(f"UntypedStorage.resize_ is patched ({len(_WATCHING)} trackers watching)")
    if _HOOKS:
        found.append(f"{len(_HOOKS)} global module forward hooks of a recorder")
    for library in _LIBRARIES:
        if compat.library_alive(library):
            found.append(f"aten kernels registered: {', '.join(compat.library_kernels(library)) or 'none yet'}")
    found += [f"fake process group {name!r} registered" for name in _FAKE_GROUPS]
    if _QUIET or compat.shape_propagation_patched():
        found.append("DTensor's shape propagation is patched")
    found += [f"{getattr(owner, '__name__', owner)}.{name} is the CUDA stand-in's" for owner, name in _PATCHED]
    if compat.autocast_cuda_included():
        found.append("CUDA's autocast key is added to every dispatch")
    if _DEVICE_MODES:
        found.append("'cuda' devices are put on the estimate's device")
    return found


def _remove_leftovers() -> None:
    """Undo what :func:`leftovers` found, by the plainest means (not through the part that failed to)."""
    _WATCHING.clear()
    if "resize_" in vars(torch.UntypedStorage):
        delattr(torch.UntypedStorage, "resize_")
    _unhook()
    for library in list(_LIBRARIES):
        compat.destroy_library(library)
        if not compat.library_alive(library):
            _LIBRARIES.remove(library)
    for name in list(_FAKE_GROUPS):
        _unregister_group(name)
    _QUIET.clear()
    if compat.shape_propagation_patched():
        _restore_shape_propagation()
    for (owner, name), original in _PATCHED.items():
        setattr(owner, name, original)
    _PATCHED.clear()
    compat.include_autocast_cuda(False)
    _DEVICE_MODES.clear()


def _check_clean(*, raising: bool) -> None:
    """At the end of a measurement: anything left is removed, and reported unless an error is on its way."""
    left = leftovers()
    if not left:
        return
    _remove_leftovers()
    if raising:
        raise LeftBehind(f"a measurement left torch changed ({'; '.join(left)}): removed now; this is a bug in "
                         "autotune, please report it")
