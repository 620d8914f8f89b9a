"""Reading JSON data as the type a record's field declares: one reader per type, made once.

A value of another JSON type raises :class:`Bad`, which says what is wrong and where (``trials[0].batch``)
once the containers it unwinds through have named themselves; :func:`invalid` makes that the one-line
ResultFileError a user sees. Lists of whole numbers (a plan's schedule, up to a million sizes) are checked
at C speed.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Callable
from itertools import chain
from typing import Annotated, Any

from ..errors import ResultFileError
from ..serial import WRITTEN_BY

Reader = Callable[[Any, str], Any]  # (parsed JSON, the file's name for errors) -> the value the field holds
RecordReader = Callable[[type, Any, str], Any]  # (record class, parsed JSON, file) -> the record


class Bad(Exception):
    """What is wrong with a value read back, in words for where it is (filled in while unwinding)."""

    def __init__(self, words: Callable[[str], str], *, loose: bool = False):
        super().__init__()
        self.path: list[str] = []
        self._words = words
        self.loose = loose  # a plain type mismatch right here: a union of types may name all of them instead

    @classmethod
    def mismatch(cls, value: Any, expected: str, *, final: bool = False) -> Bad:
        return cls(lambda where: f"{where or 'the data'} is {_shown(value)}, expected {expected}", loose=not final)

    @classmethod
    def field(cls, template: str, name: str) -> Bad:
        """``template`` with the field ``name``'s place for ``{}``: ``the field {} is missing``."""
        return cls(lambda where: template.format(f"{where}.{name}" if where else name))

    def inside(self, segment: str) -> Bad:
        """The same error one level up: ``segment`` is a field's name, a key or ``[index]``."""
        self.path.insert(0, segment)
        self.loose = False
        return self

    def words(self, where: str = "") -> str:
        place = where
        for segment in self.path:
            place += segment if segment.startswith("[") or not place else f".{segment}"
        return self._words(place)


def invalid(kind: str, source: str, why: str) -> ResultFileError:
    """The one-line error for a ``kind`` in ``source`` that cannot be read back, and the fix."""
    fix = f"write it again with {WRITTEN_BY[kind]}" if kind in WRITTEN_BY else "write it again with autotune"
    return ResultFileError(f"{source}: not a valid {kind} ({why}); {fix}")


@functools.cache
def reader(hint: Any, record: RecordReader) -> Reader:
    """The reader of a value of type ``hint``; ``record`` reads a record class (a dataclass) inside."""
    hint = _bare(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return _any
    if origin in (typing.Union, types.UnionType):
        return _union([reader(a, record) for a in args if a is not type(None)], type(None) in args, _name(hint))
    if hint in _SIMPLE:
        return _SIMPLE[hint]
    if hint is dict or origin is dict:
        return _dict(reader(args[1], record) if args else _any)
    if origin in (tuple, list):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return _many(reader(args[0], record) if args else _any, origin, _name(hint))
        return _fixed(tuple(reader(a, record) for a in args), _name(hint))
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return lambda value, source: record(hint, value, source)
    return _any  # an object of its own kind: kept as it is


def _bare(hint: Any) -> Any:
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _any(value: Any, source: str) -> Any:
    return value


def _bool(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    raise Bad.mismatch(value, _name(bool))


def _int(value: Any, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise Bad.mismatch(value, _name(int))


def _float(value: Any, source: str) -> float:
    if value is None:
        return math.nan  # dumps writes NaN and infinity as null
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise Bad.mismatch(value, _name(float))


def _str(value: Any, source: str) -> str:
    if isinstance(value, str):
        return value
    raise Bad.mismatch(value, _name(str))


_SIMPLE: dict[Any, Reader] = {bool: _bool, int: _int, float: _float, str: _str}


def _union(options: list[Reader], nullable: bool, expected: str) -> Reader:
    def read(value: Any, source: str) -> Any:
        if value is None and nullable:
            return None
        for option in options:
            try:
                return option(value, source)
            except Bad as bad:
                if not bad.loose:
                    raise  # something inside is wrong: say that
        raise Bad.mismatch(value, expected)
    return read


def _dict(item: Reader) -> Reader:
    def read(value: Any, source: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise Bad.mismatch(value, _name(dict))
        if item is _any:
            return dict(value)
        out = {}
        for key, inner in value.items():
            try:
                out[key] = item(inner, source)
            except Bad as bad:
                raise bad.inside(str(key)) from None
        return out
    return read


def _many(item: Reader, origin: Any, expected: str) -> Reader:
    whole_rows = getattr(item, "whole_numbers", False)

    def read(value: Any, source: str) -> Any:
        if not isinstance(value, list):
            raise Bad.mismatch(value, expected)
        if item is _int and set(map(type, value)) <= {int}:
            out: Any = value
        elif whole_rows and set(map(type, value)) <= {list} and set(map(type, chain.from_iterable(value))) <= {int}:
            out = map(tuple, value)
        else:
            out = []
            for i, inner in enumerate(value):
                try:
                    out.append(item(inner, source))
                except Bad as bad:
                    raise bad.inside(f"[{i}]") from None
        return tuple(out) if origin is tuple else list(out)

    read.whole_numbers = item is _int and origin is tuple  # type: ignore[attr-defined]
    return read


def _fixed(items: tuple[Reader, ...], expected: str) -> Reader:
    def read(value: Any, source: str) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) != len(items):
            raise Bad.mismatch(value, expected)
        out = []
        for i, (item, inner) in enumerate(zip(items, value)):
            try:
                out.append(item(inner, source))
            except Bad as bad:
                raise bad.inside(f"[{i}]") from None
        return tuple(out)
    return read


_PRIMITIVE = {bool: ("true or false", "true/false values"), int: ("a whole number", "whole numbers"),
              float: ("a number", "numbers"), str: ("a string", "strings"), dict: ("an object", "objects")}


def _name(hint: Any, many: bool = False) -> str:
    """A type as a person reads it in an error message: ``a list of whole numbers``."""
    hint = _bare(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _name(a, many) for a in args)
    if hint in _PRIMITIVE:
        return _PRIMITIVE[hint][many]
    if origin is dict:
        return "objects" if many else "an object"
    if origin in (tuple, list):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            inner = _name(args[0], True) if args else "values"
            return f"lists of {inner}" if many else f"a list of {inner}"
        return f"lists of {len(args)}" if many else f"a list of {len(args)} ({', '.join(_name(a) for a in args)})"
    return getattr(hint, "__name__", str(hint))


def _shown(value: Any) -> str:
    """A JSON value as a person reads it in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"the string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, list):
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    if isinstance(value, dict):
        return "an object"
    return repr(value)
