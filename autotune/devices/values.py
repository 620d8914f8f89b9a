"""Known values: the batch's real values, and what is computed from them alone, beside shape-only tensors.

An estimate builds the batch for real, on the host, with the workload's own
``batch(n, generator)`` (so its values are those the confirm run sees), and
moves it to shape-only tensors that keep each host tensor as their known
value. Every op whose tensor inputs all have known values (or are real host
tensors, or are none: ``arange``, ``full``) is then also computed on the
host, and its shape-only outputs carry the result: masks, lengths, positions,
the ``cumsum`` of a mask. Whatever depends on a parameter stays shape-only. So
``.item()``, ``.tolist()`` and truth values of such tensors are answered
exactly, ops whose output shape comes from their input's values (``nonzero``,
``masked_select``, ``unique``, a boolean index, ``_pack_padded_sequence``,
CTC's lengths) get their real shapes, and Python control flow on them takes
the branch the real run takes.

How values are kept (the design). torch's ``FakeTensorMode`` carries a real
``constant`` on a fake tensor, computes ops whose inputs are all constants on
those constants, and drops every constant aliasing a storage an op writes
unknown data into (``fake_tensor.py``: ``constant``,
``invalidate_written_to_constants``); it keeps them only up to one element
(``CONSTANT_NUMEL_LIMIT``). A data-dependent size becomes an unbacked symbol
(``symbolic_shapes.py``) whose range, for ``nonzero``, is ``[0, numel]``; a
guard on it fails. Two ways to carry values here were weighed:

- a tensor subclass holding the value: every op on it pays a Python dispatch
  of its own, the subclass leaks into autograd's saved tensors, activation
  checkpointing and ``type(t) is torch.Tensor`` checks (the meta engine's
  memo among them), and the views of a value must be followed op by op;
- extending the meta engine (chosen): every op already passes through the
  estimate's own dispatch (:class:`~autotune.devices.tracker.LiveStorageTracker`
  with its kernel), so :class:`KnownValues` wraps that kernel and keeps the
  values beside the tensors, one host storage per device storage. A tensor's
  value is its device tensor's view of the host storage (same sizes, strides
  and offset), so views and in-place ops on known values need no extra rule,
  and an op that writes unknown data (a parameter's, a random number
  generator's) into a storage drops that storage's value, for every tensor
  on it. The same wrapper serves ``FakeTensorMode``'s tensors (the fallback
  engine).

Bounds. A value larger than :data:`VALUE_LIMIT` elements is not kept (it
counts as unknown, and no host compute of that size ever runs), at most
:data:`HOST_LIMIT` bytes of values are held at once, and a batch larger than
:data:`BATCH_LIMIT` bytes is built shape-only as before (a batch of images
would cost host time for values nobody reads). The model is built shape-only:
its parameters and buffers carry no values. A data-dependent size whose input
depends on parameters (``nonzero`` of a router's choice) takes the upper bound
of the unbacked symbol's range (every element), the worst case, as torch's own
``meta_nonzero_assume_all_nonzero`` does (see
:mod:`autotune.devices.shaperules`); an op with no such bound still stops the
estimate. What was answered, and what was bounded, is counted for the notes.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..compat import KERNEL_ERRORS, FakeTensorMode, op_schema, tree_flatten, tree_map
from ..units import format_bytes
from .hostvalues import HOST_LIMIT, VALUE_LIMIT, HostValues
from .shaperules import BOUNDS, RULES

#: Bytes: a batch up to this size is built for real, its values known; a larger one shape-only.
BATCH_LIMIT = 32 << 20

aten = torch.ops.aten
_META = torch.device("meta")
_CPU = torch.device("cpu")
_TO_COPY = aten._to_copy.default
#: Copies to another device: ``_to_copy``, and ``to`` itself where it reaches the estimate's dispatch undecomposed
#: (``.tolist()`` inside a nested tensor's own dispatch).
_TO_HOST = {_TO_COPY, aten.to.dtype_layout}
_DYNAMIC = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
# Fresh tensors whose contents are undefined: blank, known once known data is written into them.
_EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
          aten.new_empty_strided.default, aten.empty_like.default, aten.empty_permuted.default}
# In-place ops that change a storage behind the values' back.
_RESETS = {aten.resize_.default, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
           aten.set_.default, aten.set_.source_Storage}
# In-place ops that overwrite their first argument whole without reading it.
_OVERWRITES = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.copy_.default}


class _Op:
    """What the schema says about an op, once: which arguments it writes, whether it only makes views."""

    __slots__ = ("dynamic", "empty", "plain", "random", "resets", "views", "writes")

    def __init__(self, func: Any):
        schema = op_schema(func)
        self.writes = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write)
        returns = schema.returns
        self.views = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        self.dynamic = any(tag in _DYNAMIC for tag in func.tags)
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.empty = func in _EMPTY
        self.resets = func in _RESETS
        # No rule, no data-dependent shape, no write, no blank output, no copy to the host: the common case.
        self.plain = not (self.writes or self.dynamic or self.empty or func in RULES or func in _TO_HOST)


_OPS: dict[Any, _Op] = {}


def _op(func: Any) -> _Op:
    info = _OPS.get(func)
    if info is None:
        info = _OPS[func] = _Op(func)
    return info


class Unbounded(Exception):
    """An output size that depends on values that depend on parameters, with no bound: no estimate can run."""


class KnownValues(HostValues):
    """The estimate's kernel, carrying known values (see the module docstring) in the host copies of
    :class:`~autotune.devices.hostvalues.HostValues`.

    ``inner(func, args, kwargs)`` runs an op on shape-only tensors (the meta
    engine's :class:`~autotune.devices.meta.MetaKernels`, or the op itself under
    ``FakeTensorMode``, given as ``fake_mode``); ``cpu``: the estimate stands in
    for the CPU (some rules lay outputs out as its kernels do). Counts:
    ``reads`` (``.item()``, ``.tolist()``, truth values answered from known
    values), ``shapes`` (data-dependent output shapes answered from them),
    ``bounded`` (data-dependent sizes taken at their upper bound, by op name),
    ``dropped`` (values not kept: over ``limit`` elements or ``host_limit`` bytes).
    """

    def __init__(self, inner: Callable[[Any, tuple, dict], Any] | None = None, *,
                 fake_mode: FakeTensorMode | None = None, cpu: bool = False, limit: int = VALUE_LIMIT,
                 host_limit: int = HOST_LIMIT):
        super().__init__(limit=limit, host_limit=host_limit)
        self.inner = inner if inner is not None else _call
        self.fake_mode = fake_mode
        self.cpu = cpu
        self.reads = 0
        self.shapes = 0
        self.bounded: dict[str, int] = {}
        self.shape_only_batch: int | None = None  # bytes of a batch too large to build for real
        self.unknown_origin: str | None = None  # where the first value read and not known came from, in words
        self._batch: dict[int, weakref.ref] = {}  # storages of a batch built shape-only, by id
        self._off = 0

    # -- the batch and its reads -------------------------------------------------------

    def move(self, host: torch.Tensor, device: torch.Tensor) -> torch.Tensor:
        """``device``, the batch's ``host`` tensor moved to the estimate, with ``host`` as its value (when the
        batch was built for real)."""
        if not self.is_device(host):
            self.attach(device, host, own=True)  # the batch was built for this estimate alone
        else:
            storage = device.untyped_storage()
            self._batch[id(storage)] = weakref.ref(storage)
        return device

    def origin(self, tensors: Iterable[torch.Tensor]) -> str:
        """Where the values not known among ``tensors`` come from, as far as the estimate can tell, in words."""
        unknown = [t for t in tensors if self.is_device(t) and not self.known(t)]
        if self.shape_only_batch is not None:
            batch = (f"the batch holds {format_bytes(self.shape_only_batch)}, more than the "
                     f"{format_bytes(BATCH_LIMIT)} built for real at each estimate, so it is built shape-only")
            if any(self._batch.get(id(s := t.untyped_storage()), _dead)() is s for t in unknown):
                return f"the batch's own values, which the estimate does not know ({batch})"
            return f"values the estimate does not know, computed from the batch or from parameters ({batch})"
        if self.dropped:
            return (f"values the estimate does not know, computed from parameters, or from the batch and too large "
                    f"to keep (over {VALUE_LIMIT:,} elements, or {format_bytes(HOST_LIMIT)} of values in all)")
        return "values that depend on parameters"

    def scalar(self, t: torch.Tensor) -> Any:
        """``t.item()`` from its known value (a real host tensor's own), or None when it is unknown."""
        host = self.value(t)
        if host is None:
            if self.unknown_origin is None:
                self.unknown_origin = self.origin([t])
            return None
        if host is not t:
            self.reads += 1
        with self.host():
            return host.item()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Ops inside compute no values (the model is built shape-only)."""
        self._off += 1
        try:
            yield
        finally:
            self._off -= 1

    # -- the kernel --------------------------------------------------------------------

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._off:
            return self.inner(func, args, kwargs)
        info = _OPS.get(func) or _op(func)
        if info.plain and self.fake_mode is None:  # most ops, on the meta engine: the short way
            out = self.inner(func, args, kwargs)
            if info.views or info.random or not self._all_known(args, kwargs):
                return out
            return self._computed(func, args, kwargs, out)
        tensors = _tensors(args, kwargs)
        device = [t for t in tensors if self.is_device(t)]
        if tensors and not device:
            # Real host tensors only (a packed sequence's batch sizes): the op runs on them, as it does on the
            # meta engine (FakeTensorMode would refuse them).
            if self.fake_mode is None:
                return self.inner(func, args, kwargs)
            with self.host():
                return func(*args, **kwargs)
        if self.fake_mode is not None and len(device) != len(tensors):
            args, kwargs = tree_map(self._faked, (args, kwargs))  # FakeTensorMode takes fakes only
        rule = RULES.get(func)
        if rule is not None:
            return rule(self, func, args, kwargs)
        return self.generic(func, args, kwargs)

    def generic(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op with no rule of its own: run on shape-only tensors, and on the values when they are known."""
        info = _op(func)
        if info.dynamic:
            return self.dynamic(func, args, kwargs)
        if func in _TO_HOST and self.fake_mode is None and args[0].is_meta and \
                kwargs.get("device") not in (None, _META):
            return self._to_host(func, args, kwargs)
        if info.writes:
            return self._written(func, args, kwargs, info)
        out = self.inner(func, args, kwargs)
        if info.empty:
            for t in _leaves(out):
                if isinstance(t, torch.Tensor):
                    self.blank(t)
            return out
        if info.views or info.random or not self._all_known(args, kwargs):
            return out
        return self._computed(func, args, kwargs, out)

    def _all_known(self, args: tuple, kwargs: dict) -> bool:
        """Are the values of all the op's tensor arguments known? (Stops at the first that is not.)"""
        if not self and args and isinstance(args[0], torch.Tensor) and self.is_device(args[0]):
            return False
        for x in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(x, torch.Tensor):
                if not self.known(x):
                    return False
            elif isinstance(x, (list, tuple)) and not self.known(*[t for t in x if isinstance(t, torch.Tensor)]):
                return False
        return True

    def _computed(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """``out``, the op's shape-only outputs, given the values computed on the host (within the limit)."""
        leaves = _leaves(out)
        outs = [t for t in leaves if isinstance(t, torch.Tensor) and self.is_device(t)]
        if not outs:
            return out
        if any(t.numel() > self.limit for t in outs):
            self.dropped += 1
            return out
        host = self.host_call(func, args, kwargs)
        if host is not _UNKNOWN:
            inputs = {v.untyped_storage().data_ptr() for x in _tensors(args, kwargs)
                      if (v := self.value(x)) is not None}
            for t, h in zip(leaves, _leaves(host)):
                if isinstance(t, torch.Tensor) and isinstance(h, torch.Tensor):
                    self.attach(t, h, own=h.untyped_storage().data_ptr() not in inputs and h.numel() > 0)
        return out

    def host_call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` computed on the host from its inputs' values, or ``_UNKNOWN`` when one is unknown."""
        flat, spec = tree_flatten((args, kwargs))
        host: list[Any] = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                value = self.value(x)
                if value is None:
                    return _UNKNOWN
                host.append(value)
            elif isinstance(x, torch.device) and x.type == "meta":
                host.append(_CPU)
            else:
                host.append(x)
        h_args, h_kwargs = spec.unflatten(host)
        try:
            with self.host():
                return func(*h_args, **h_kwargs)
        except KERNEL_ERRORS:  # the host kernel refuses (a dtype the CPU lacks...): the value stays unknown
            return _UNKNOWN

    def _faked(self, x: Any) -> Any:
        """A real host tensor as a fake one with its value (others as they are), under FakeTensorMode."""
        if not isinstance(x, torch.Tensor) or self.is_device(x):
            return x
        assert self.fake_mode is not None
        fake = self.fake_mode.from_tensor(x)
        self.attach(fake, x)
        return fake

    def _to_host(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``.cpu()``, ``.tolist()`` of a shape-only tensor: its value, or the meta engine's error when unknown."""
        out = self.host_call(func, args, kwargs)
        if out is _UNKNOWN:
            return self.inner(func, args, kwargs)
        self.reads += 1
        return out

    def dynamic(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op whose output shape (or value) depends on its input's values."""
        flat = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if not any(self.is_device(t) for t in flat):
            return self.inner(func, args, kwargs)  # real host tensors only
        host = self.host_call(func, args, kwargs)
        if host is not _UNKNOWN:
            if any(isinstance(h, torch.Tensor) for h in _leaves(host)):
                self.shapes += 1
            else:
                self.reads += 1  # torch.equal, is_nonzero: a value read
            return tree_map(lambda h: self.to_device(h) if isinstance(h, torch.Tensor) else h, host)
        bound = BOUNDS.get(func)
        if bound is None:
            try:
                return self.inner(func, args, kwargs)  # a kernel that sizes it without the values (output_size=)
            except RuntimeError as exc:  # meta kernels raise NotImplementedError or RuntimeError, FakeTensorMode
                # DynamicOutputShapeException (a RuntimeError): whichever it is, no engine can size this output
                raise Unbounded(f"{func}: its output size depends on {self.origin(flat)}, and has no bound "
                                f"({type(exc).__name__})") from None
        out = bound(self, func, args, kwargs)
        self.bound(func)
        return out

    def bound(self, func: Any) -> None:
        name = func.__name__.split(".")[0]
        self.bounded[name] = self.bounded.get(name, 0) + 1

    def _written(self, func: Any, args: tuple, kwargs: dict, info: _Op) -> Any:
        """An in-place or ``out=`` op: computed on the values when its inputs' are known (a blank target's
        too: it is written, not read), else it drops the values of what it writes."""
        targets = [x for i, name in info.writes
                   for x in _as_list(args[i] if i < len(args) else kwargs.get(name)) if self.is_device(x)]
        if not targets:
            return self.inner(func, args, kwargs)  # it writes real host tensors only
        if func in _OVERWRITES and not self.has_entry(targets[0]):
            self.blank(targets[0])  # overwritten whole: what it held does not matter
        out = self.inner(func, args, kwargs)
        if not self:
            return out
        if not (info.random or info.resets) and self._writable(args, kwargs, targets):
            for t in targets:
                self.fill_blank(t)
            if self.host_call(func, args, kwargs) is not _UNKNOWN:
                return out
        for t in targets:
            self.drop(t)
        return out

    def _writable(self, args: tuple, kwargs: dict, targets: list[torch.Tensor]) -> bool:
        """Are all the op's inputs known, a blank target counting as known (it is written, not read)?"""
        for t in _tensors(args, kwargs):
            if self.is_device(t) and not self.known(t) and not (self.has_entry(t) and any(t is x for x in targets)):
                return False
        return True

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A new shape-only tensor laid out as ``host``, with ``host`` as its value (called inside the
        estimate's dispatch: under ``FakeTensorMode``, a fake CPU tensor)."""
        device = _META if self.fake_mode is None else _CPU
        t = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        self.attach(t, host)
        return t

    # -- what happened -------------------------------------------------------------------

    def notes(self) -> tuple[str, ...]:
        """What the values bounded or could not do, in words the same at every batch size."""
        notes = []
        if self.bounded:
            notes.append(f"data-dependent sizes of values that depend on parameters taken at their upper bound "
                         f"({', '.join(sorted(self.bounded))}: every element counted, e.g. every token routed to "
                         "every expert): the estimate assumes the worst case and may over-count")
        if self.shape_only_batch is not None:
            notes.append(f"the batch is larger than the {format_bytes(BATCH_LIMIT)} built for real at each "
                         "estimate: estimated shape-only, its values unknown")
        return tuple(notes)


_UNKNOWN = object()


def _dead() -> None:
    return None


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments (and in its list arguments)."""
    found = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found.extend(t for t in x if isinstance(t, torch.Tensor))
    return found


def _leaves(out: Any) -> list[Any]:
    return [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]


def _as_list(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def batch_bytes(tree: Any) -> int:
    """Bytes of the tensors in a batch."""
    return sum(math.prod(t.shape) * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))
