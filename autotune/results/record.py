"""Record: how every request and result type declares its fields once, checks them, and reads and writes JSON.

A record is a frozen, keyword-only dataclass that derives from :class:`Record`::

    @dataclass(frozen=True, kw_only=True)
    class Trial(Record):
        batch: Whole                                    # a whole number, at least 1
        source: Annotated[str, one_of(("estimate", "real"))]
        seconds: Annotated[float, Rule(options.seconds)]
        fits: bool
        oom: bool = False                               # missing in a file: reads as False

        def validate(self) -> None:                     # rules between fields, after each field's own
            if self.oom and self.fits:
                raise ValueError("a trial that ran out of memory does not fit")

Each field's type says what JSON holds there; its :class:`Rule` (from :mod:`autotune.options`, where every
check of a value lives once) what value it may take and how it is normalised, applied whenever a record is
made, in Python or from a file. A field of a tuple type takes any iterable; a field holding a record must
hold one. ``to_dict`` writes the fields in the order declared (records inside as their own dicts, tuples as
lists) and the properties marked :func:`derived` after the field they name; a record with a ``KIND`` is a
file of its own, in the envelope of :mod:`autotune.serial`. ``from_dict`` reads that back: a missing
required field, an unknown one, a value of another JSON type or one its rules refuse is a one-line
ResultFileError naming the file and the field (``trials[0].batch``); null in a ``float`` field is the NaN
or infinity that :func:`autotune.serial.dumps` wrote as null.
Adding a field to a record is all it takes to write it, read it back and check it. A field declared
``= memory_only()`` is the exception: the record holds it in this process only (never written, read back,
compared or shown; a trial's device measurement, say).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator
from typing import Annotated, Any, ClassVar, TypeVar

from .. import options
from ..errors import BadInput
from ..serial import envelope, open_envelope
from .reading import Bad, Reader, invalid, reader

R = TypeVar("R", bound="Record")
F = TypeVar("F", bound=Callable[..., Any])


class Rule:
    """What value a field may take: ``check(value, name=field, **options)`` returns it normalised, or raises
    ValueError (:class:`autotune.errors.BadInput`) naming the field. None skips it where the type allows None."""

    __slots__ = ("_call", "check", "options")

    def __init__(self, check: Callable[..., Any], **options: Any):
        self.check, self.options = check, tuple(sorted(options.items()))
        self._call = functools.partial(check, **options)

    def __call__(self, value: Any, name: str) -> Any:
        return self._call(value, name=name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rule) and (self.check, self.options) == (other.check, other.options)

    def __hash__(self) -> int:
        return hash((self.check, self.options))

    def __repr__(self) -> str:
        return f"Rule({self.check.__name__}{''.join(f', {k}={v!r}' for k, v in self.options)})"


def one_of(choices: tuple[str, ...]) -> Rule:
    """A string among ``choices``."""
    return Rule(options.choice, choices=choices)


#: A whole number of at least 1 (never a bool or a string of digits), and of at least 0.
Whole = Annotated[int, Rule(options.whole, text=False)]
Count = Annotated[int, Rule(options.whole, least=0, text=False)]
#: A fraction in [0, 1): the share of memory kept free.
Margin = Annotated[float, Rule(options.margin, text=False)]


_MEMORY_ONLY = "autotune.record.memory_only"


def memory_only() -> Any:
    """A record's field held in this process only (None unless given): ``to_dict`` never writes it, ``from_dict``
    never reads it, and it is no part of the record's equality, hash or repr."""
    return dataclasses.field(default=None, compare=False, repr=False, metadata={_MEMORY_ONLY: True})


def written_fields(cls: type[Record]) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of a record class that JSON holds: all but the :func:`memory_only` ones, in the order declared."""
    return tuple(f for f in dataclasses.fields(cls) if not f.metadata.get(_MEMORY_ONLY))  # type: ignore[arg-type]


def derived(after: str) -> Callable[[F], F]:
    """Marks a property's getter (under ``@property``) as written by ``to_dict`` after the field ``after``;
    a file's value of it is left out when read back (the property computes it again)."""

    def mark(getter: F) -> F:
        getter.__derived_after__ = after  # type: ignore[attr-defined]
        return getter

    return mark


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a record class declares, resolved once: the order written, readers, rules, fields to convert."""

    written: tuple[tuple[str, Callable[[Any], Any]], ...]  # (name, how its value is written), in order
    readers: dict[str, Reader]
    required: tuple[str, ...]
    derived: frozenset[str]
    rules: tuple[tuple[str, Rule, bool], ...]  # (field, rule, None allowed)
    tuples: tuple[str, ...]  # fields of a tuple type: any iterable becomes a tuple
    records: tuple[tuple[str, type, bool, bool], ...]  # (field, record class, a tuple of them, None allowed)


class Record:
    """Base of the frozen, keyword-only, self-checking types that stages hand on (see the module's docstring).

    ``KIND`` names a record that is a file of its own (``autotune.Plan``); None for one inside another.
    """

    KIND: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        layout = _layout(type(self))
        for name, check, nullable in layout.rules:
            value = getattr(self, name)
            if value is not None or not nullable:
                object.__setattr__(self, name, check(value, name))
        for name in layout.tuples:
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        for name, cls, many, nullable in layout.records:
            value = getattr(self, name)
            if value is None and nullable:
                continue
            if many and not all(isinstance(v, cls) for v in value):
                raise BadInput(f"{name} must be {cls.__name__} objects", field=name)
            if not many and not isinstance(value, cls):
                raise BadInput(f"{name} must be a {cls.__name__}, got {type(value).__name__}", field=name,
                               fix=f"give {name}={cls.__name__}(...)")
        self.validate()

    def validate(self) -> None:
        """Rules between fields (each field's own rule has held): raise ValueError naming them."""

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON data (see the module's docstring)."""
        body = {name: write(getattr(self, name)) for name, write in _layout(type(self)).written}
        return body if self.KIND is None else envelope(self.KIND, body)

    @classmethod
    def from_dict(cls: type[R], data: Any, *, source: str = "data", kind: str | None = None,
                  where: str = "") -> R:
        """The record that ``to_dict`` wrote, read from ``source``; ResultFileError names the field, inside
        the file of ``kind`` (this record's KIND, or the kind of the file it is part of)."""
        if cls.KIND is not None:
            kind = cls.KIND
            _, data = open_envelope(data, kind, source=source)
        kind = kind or cls.__name__
        try:
            return typing.cast(R, _read(cls, data, source))
        except Bad as bad:
            raise invalid(kind, source, bad.words(where)) from None


def _read(cls: type[Record], value: Any, source: str) -> Record:
    """A record (not in an envelope) from JSON data; Bad names what is wrong, relative to the record."""
    layout = _layout(cls)
    if not isinstance(value, dict):
        raise Bad.mismatch(value, "an object", final=True)
    for name in layout.required:
        if name not in value:
            raise Bad.field("the field {} is missing", name)
    fields = {}
    for name, item in value.items():
        if name in layout.derived:
            continue
        read = layout.readers.get(name)
        if read is None:
            raise Bad.field("unknown field {}", name)
        try:
            fields[name] = read(item, source)
        except Bad as bad:
            raise bad.inside(name) from None
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        why = str(exc)
    raise Bad(lambda where: f"{where}: {why}" if where else why)


_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type[Record]) -> _Layout:
    """What ``cls`` declares, resolved on first use (resolving annotations compiles each one)."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = _resolve(cls)
    return layout


def _resolve(cls: type[Record]) -> _Layout:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = written_fields(cls)
    after: dict[str, list[str]] = {}
    for name, getter in _derived(cls):
        after.setdefault(getter.__derived_after__, []).append(name)
    written: list[tuple[str, Callable[[Any], Any]]] = []
    rules, tuples, records = [], [], []
    for f in fields:
        hint = hints[f.name]
        written.append((f.name, _writer(hint)))
        written += [(name, _plain) for name in after.pop(f.name, ())]
        inner, nullable = _optional(hint)  # Annotated[int, rule] | None, or Annotated[int | None, rule]:
        nullable = nullable or _optional(_bare(inner))[1]
        rules += [(f.name, r, nullable) for r in getattr(inner, "__metadata__", ()) if isinstance(r, Rule)]
        inner = _optional(_bare(inner))[0]
        if typing.get_origin(inner) is tuple:
            tuples.append(f.name)
        one = _record_in(inner)
        if one is not None:
            records.append((f.name, one[0], one[1], nullable))
    if after:
        raise TypeError(f"{cls.__name__}: derived values after unknown fields {sorted(after)}")
    return _Layout(written=tuple(written), readers={f.name: _field_reader(f.name, hints[f.name]) for f in fields},
                   required=tuple(sorted(f.name for f in fields if f.default is dataclasses.MISSING
                                         and f.default_factory is dataclasses.MISSING)),
                   derived=frozenset(name for name, _ in _derived(cls)), rules=tuple(rules), tuples=tuple(tuples),
                   records=tuple(records))


def _derived(cls: type) -> Iterator[tuple[str, Any]]:
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, property) and hasattr(value.fget, "__derived_after__"):
                yield name, value.fget


def _optional(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _bare(hint: Any) -> Any:
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Record)


def _record_in(hint: Any) -> tuple[type, bool] | None:
    """(the record class, whether a tuple of them) a field holds, or None."""
    hint = _bare(hint)
    if _is_record(hint):
        return hint, False
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis and _is_record(args[0]):
        return args[0], True
    return None


def _field_reader(name: str, hint: Any) -> Reader:
    """Records that are files of their own (a plan's probe) are read as such, from ``SOURCE (its NAME)``."""
    inner, nullable = _optional(hint)
    if _is_record(inner) and inner.KIND is not None:
        def read_file(value: Any, source: str) -> Any:
            if value is None and nullable:
                return None
            return inner.from_dict(value, source=f"{source} (its {name})")
        return read_file
    return reader(hint, _read)


_PRIMITIVES = (bool, int, float, str, type(None))


def _writer(hint: Any) -> Callable[[Any], Any]:
    """How a field of type ``hint`` is written: at C speed where it can be (a schedule of a million sizes)."""
    inner, nullable = _optional(_bare(hint))
    inner = _bare(inner)
    args = typing.get_args(inner)
    write: Callable[[Any], Any] = _plain
    if inner in _PRIMITIVES:
        return _same
    if _is_record(inner):
        write = _to_dict
    elif typing.get_origin(inner) is tuple and all(_bare(a) in _PRIMITIVES or a is Ellipsis for a in args):
        write = list
    elif typing.get_origin(inner) is tuple and len(args) == 2 and args[1] is Ellipsis and _writer(args[0]) is list:
        write = _lists
    if nullable and write is not _plain:
        return lambda value: None if value is None else write(value)
    return write


def _same(value: Any) -> Any:
    return value


def _to_dict(value: Record) -> dict[str, Any]:
    return value.to_dict()


def _lists(value: Any) -> list[list[Any]]:
    return list(map(list, value))


def _plain(value: Any) -> Any:
    """Any value as JSON data: records as their dicts, tuples as lists, dicts copied."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


__all__ = ["Count", "Margin", "Record", "Rule", "Whole", "derived", "memory_only", "one_of", "written_fields"]
