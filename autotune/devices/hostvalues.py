"""Host copies of shape-only storages: where an estimate keeps the values it knows.

One host storage per device storage (a ``meta`` storage, or a
``FakeTensorMode`` fake's), of the same size, held while the device storage
lives (a weak reference drops it with the storage). A tensor's value is its own
view of the host copy (its sizes, strides and offset), so every view of a
storage sees the same values and an in-place op computed on the host copy
updates all of them. A storage fresh from ``empty`` is blank: no value to
read, but known data written into it makes one (its undefined contents taken
as zeros). :mod:`autotune.devices.values` decides what is kept, and when it is
dropped.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..compat import FakeTensor, disable_current_modes

#: Elements: a value larger than this is not kept and counts as unknown.
VALUE_LIMIT = 1 << 22
#: Bytes of values held at once: past it, new values are not kept.
HOST_LIMIT = 256 << 20


class _Entry:
    """A device storage's host copy; ``host`` None: blank (fresh from ``empty``, contents undefined)."""

    __slots__ = ("host", "nbytes", "ref")

    def __init__(self, ref: weakref.ref, host: torch.UntypedStorage | None):
        self.ref = ref
        self.host = host
        self.nbytes = host.nbytes() if host is not None else 0


class HostValues:
    """The known values of shape-only tensors, per storage, bounded by ``limit`` elements per value and
    ``host_limit`` bytes in all (``dropped`` counts values not kept for either)."""

    def __init__(self, *, limit: int = VALUE_LIMIT, host_limit: int = HOST_LIMIT):
        self.limit = limit
        self.host_limit = host_limit
        self.host_bytes = 0
        self.dropped = 0
        self._store: dict[int, _Entry] = {}

    @staticmethod
    def is_device(t: torch.Tensor) -> bool:
        """Is ``t`` one of the estimate's shape-only tensors (not a real host tensor)?"""
        return t.is_meta or isinstance(t, FakeTensor)

    @staticmethod
    def host() -> contextlib.AbstractContextManager:
        """Inside, ops run on real host tensors: no dispatch mode sees them (no tracker counts them, no
        ``FakeTensorMode`` fakes them)."""
        return disable_current_modes()

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s value as a host tensor (its view of the host copy; a real host tensor is its own value), or
        None when it is unknown."""
        if not self.is_device(t):
            return t
        entry = self._entry(t)
        if entry is None or entry.host is None:
            return None
        with self.host():
            return torch.empty(0, dtype=t.dtype).set_(entry.host, t.storage_offset(), t.shape, t.stride())

    def known(self, *tensors: torch.Tensor | None) -> bool:
        """Are the values of all these tensors known (real host tensors' are)?"""
        for t in tensors:
            if t is not None and self.is_device(t):
                storage = t.untyped_storage()
                entry = self._store.get(id(storage))
                if entry is None or entry.ref() is not storage or entry.host is None:
                    return False
        return True

    def attach(self, t: torch.Tensor, host: torch.Tensor, *, own: bool = False) -> bool:
        """Keep ``host`` as the value of the shape-only tensor ``t``, which must cover its own storage.
        ``own``: nothing else will write ``host``'s storage, which is kept as it is when laid out as ``t``."""
        if not self.is_device(t) or host.shape != t.shape or host.dtype != t.dtype:
            return False
        storage = t.untyped_storage()
        old = self._store.get(id(storage))
        if old is not None and old.ref() is storage and old.host is not None:
            return False  # an op handed back an input: its storage keeps the value it has
        nbytes = storage.nbytes()
        if t.numel() > self.limit or self.host_bytes + nbytes > self.host_limit:
            self.dropped += 1
            return False
        if t.storage_offset() != 0 or nbytes != _span(t):
            return False  # part of a larger storage whose other bytes are not known
        if own and host.stride() == t.stride() and host.storage_offset() == 0 and \
                host.untyped_storage().nbytes() == nbytes and not self.is_device(host):
            self._keep(storage, host.untyped_storage())
            return True
        with self.host():
            copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            copy.copy_(host)
        self._keep(storage, copy.untyped_storage())
        return True

    def drop(self, t: torch.Tensor) -> None:
        """Unknown data was written into ``t``'s storage: no tensor on it has a known value any more."""
        if self.is_device(t):
            storage = t.untyped_storage()
            entry = self._store.get(id(storage))
            if entry is not None and entry.ref() is storage:
                self._forget(id(storage))

    def blank(self, t: torch.Tensor) -> None:
        """A fresh tensor whose contents are undefined: no value yet, but known data written into it is."""
        storage = t.untyped_storage()
        if self.is_device(t) and t.storage_offset() == 0 and storage.nbytes() == _span(t) and \
                t.numel() <= self.limit:
            self._keep(storage, None)

    def fill_blank(self, t: torch.Tensor) -> None:
        """Give a blank storage about to be written a host copy (zeros: the undefined contents of ``empty``)."""
        entry = self._entry(t)
        if entry is not None and entry.host is None:
            storage = t.untyped_storage()
            if self.host_bytes + storage.nbytes() > self.host_limit:
                self.dropped += 1
                self._forget(id(storage))
                return
            with self.host():
                self._keep(storage, torch.zeros(storage.nbytes(), dtype=torch.uint8).untyped_storage())

    def has_entry(self, t: torch.Tensor) -> bool:
        """Does ``t``'s storage have a value or a blank?"""
        return self._entry(t) is not None

    def __bool__(self) -> bool:
        return bool(self._store)

    def _entry(self, t: torch.Tensor) -> _Entry | None:
        """The entry of ``t``'s storage, when it has one still valid."""
        storage = t.untyped_storage()
        entry = self._store.get(id(storage))
        if entry is None or entry.ref() is not storage:
            return None
        if entry.host is not None and entry.nbytes != storage.nbytes() or t.is_conj() or t.is_neg() or \
                t.layout != torch.strided:
            self._forget(id(storage))  # resized in place, outside any op seen here
            return None
        return entry

    def _keep(self, storage: torch.UntypedStorage, host: torch.UntypedStorage | None) -> None:
        key = id(storage)
        me = weakref.ref(self)

        def died(ref: weakref.ref, key: int = key) -> None:
            values = me()
            if values is not None:
                entry = values._store.get(key)
                if entry is not None and entry.ref is ref:  # not a newer storage that took the same id
                    values._forget(key)

        self._forget(key)
        entry = _Entry(weakref.ref(storage, died), host)
        self._store[key] = entry
        self.host_bytes += entry.nbytes

    def _forget(self, key: int) -> None:
        entry = self._store.pop(key, None)
        if entry is not None:
            self.host_bytes -= entry.nbytes


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to its last: what a dense tensor's own storage holds."""
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()
