"""JSON for every stage's result: a ``kind``, a ``schema_version``, atomic files.

No torch here: the planner and the reports use it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import stat
import threading
import types
import typing
import uuid
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from .errors import BadInput, ResultFileError

#: 2: typed device, verification, tuning and noise-scale records; files of schema 1 still read (their
#: memory budget from the old capacity source, their tuning record without a baseline).
SCHEMA_VERSION = 2
KINDS = ("ProbeResult", "Plan", "RunResult")
WRITTEN_BY = {"ProbeResult": "autotune probe --output", "Plan": "autotune plan --output",
              "RunResult": "autotune run --output"}


def envelope(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the fields that say what it is."""
    return {"kind": f"autotune.{kind}", "schema_version": SCHEMA_VERSION, **body}


def open_envelope(data: Any, kind: str | None = None, *, source: str = "data") -> tuple[str, dict[str, Any]]:
    """(kind, body) of an autotune JSON object; ResultFileError for anything else."""
    if not isinstance(data, dict) or not str(data.get("kind", "")).startswith("autotune."):
        raise ResultFileError(
            f"{source} is not an autotune result (no \"kind\": \"autotune.…\" field): "
            "give a file written by autotune plan/run --output or --report"
        )
    found = data["kind"].removeprefix("autotune.")
    if found not in KINDS:
        raise ResultFileError(f"{source} holds an unknown autotune kind {found!r}; known: {', '.join(KINDS)}")
    if kind is not None and found != kind:
        raise ResultFileError(f"{source} holds a {found}, not a {kind}: give the {kind} JSON that "
                              f"{WRITTEN_BY[kind]} writes")
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise ResultFileError(f"{source} has no valid schema_version (got {version!r})")
    if version > SCHEMA_VERSION:
        raise ResultFileError(
            f"{source} has schema_version {version}, newer than the {SCHEMA_VERSION} this autotune reads: "
            "upgrade autotune (pip install -U autotune)"
        )
    body = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
    return found, body


def read_fields(cls: type, body: dict[str, Any], *, kind: str, source: str) -> dict[str, Any]:
    """``body`` checked against the fields of the dataclass ``cls``, as its keyword arguments.

    Every required field must be there and no unknown one; each value must have its annotated
    JSON type (lists become the tuples the fields hold; null in a ``float`` field is the NaN or
    infinity that :func:`dumps` wrote as null). Fields annotated with a class of their own (a
    nested result) are left to the caller. ResultFileError names the field.
    """
    return read_dataclass(cls, body, kind=kind, source=source)


def read_dataclass(cls: type, value: Any, *, kind: str, source: str, where: str = "") -> dict[str, Any]:
    """:func:`read_fields` for a dataclass nested ``where`` inside a ``kind`` (a trial, a check)."""
    types_, required = _field_types(cls)
    return read_record(value, types_, required=required, extra=False, kind=kind, source=source, where=where)


@functools.cache
def _field_types(cls: type) -> tuple[Mapping[str, Any], frozenset[str]]:
    """The dataclass ``cls``'s field types, resolved once (resolving string annotations compiles each one),
    and the names of the fields without a default."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = frozenset(f.name for f in fields if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
    return types.MappingProxyType({f.name: hints[f.name] for f in fields}), required


def read_record(value: Any, types_: Mapping[str, Any], *, kind: str, source: str, where: str = "",
                required: AbstractSet[str] | None = None, extra: bool = True) -> dict[str, Any]:
    """A JSON object (``where`` inside a ``kind`` read from ``source``) checked field by field against
    ``types_`` (see :func:`read_fields`); ``required`` defaults to every field; ``extra`` lets fields
    not in ``types_`` through unchecked."""
    if not isinstance(value, dict):
        raise invalid(kind, source, f"{where or 'the data'} is {_shown(value)}, expected an object")
    prefix = f"{where}." if where else ""
    for name in sorted(set(types_) if required is None else required):
        if name not in value:
            raise invalid(kind, source, f"the field {prefix}{name} is missing")
    out = {}
    for name, item in value.items():
        if name not in types_:
            if not extra:
                raise invalid(kind, source, f"unknown field {prefix}{name}")
            out[name] = item
            continue
        try:
            out[name] = conform(item, types_[name], f"{prefix}{name}")
        except _Mismatch as exc:
            raise invalid(kind, source, f"{exc.where} is {_shown(exc.value)}, expected {exc.expected}") from None
    return out


def invalid(kind: str, source: str, why: str) -> ResultFileError:
    """The one-line error for a ``kind`` in ``source`` that cannot be read back, and the fix."""
    fix = f"write it again with {WRITTEN_BY[kind]}" if kind in WRITTEN_BY else "write it again with autotune"
    return ResultFileError(f"{source}: not a valid {kind} ({why}); {fix}")


class _Mismatch(Exception):
    def __init__(self, where: str, value: Any, expected: str):
        super().__init__(where)
        self.where, self.value, self.expected = where, value, expected


_PRIMITIVE = {bool: ("true or false", "true/false values"), int: ("a whole number", "whole numbers"),
              float: ("a number", "numbers"), str: ("a string", "strings"), dict: ("an object", "objects")}


def conform(value: Any, hint: Any, where: str) -> Any:
    """``value`` (parsed JSON) as the type ``hint`` describes; raises _Mismatch when it is not one."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return conform(value, option, where)
            except _Mismatch:
                pass
        raise _Mismatch(where, value, _name(hint))
    if hint in (int, float) and isinstance(value, bool):
        raise _Mismatch(where, value, _name(hint))
    if hint is float and (value is None or isinstance(value, (int, float))):
        return math.nan if value is None else float(value)  # dumps writes NaN and infinity as null
    if hint in (bool, int, str) and isinstance(value, hint):
        return value
    if (hint is dict or origin is dict) and isinstance(value, dict):
        item = args[1] if args else Any
        return {k: conform(v, item, f"{where}.{k}") for k, v in value.items()}
    if origin in (tuple, list) and isinstance(value, list):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            items = [conform(v, args[0] if args else Any, f"{where}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if origin is tuple else items
        if len(value) == len(args):
            return tuple(conform(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if isinstance(hint, type) and hint not in _PRIMITIVE and origin is None:
        return value  # an object of its own (a nested result, a DataFrame): the caller builds it
    raise _Mismatch(where, value, _name(hint))


def _name(hint: Any, many: bool = False) -> str:
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


def _clean(value: Any) -> Any:
    """JSON cannot hold NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(_clean(data), indent=2, sort_keys=False) + "\n"


def check_writable(path: str | os.PathLike, *, what: str | None = None) -> Path:
    """The file that writing ``path`` replaces (through symlinks); BadInput, starting with ``what``,
    when it cannot be written: a missing or unwritable folder, a folder, a read-only file.

    Cheap enough to call before long work, so that a bad output path fails first.
    """
    path = Path(path)
    what = what or f"cannot write {path}"
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise BadInput(f"{what}: it is a folder; give a file path, e.g. {path / 'result.json'}")
    if _is_special(path):
        return path  # /dev/null, a pipe: written in place
    folder = target.parent
    if not folder.is_dir():
        raise BadInput(f"{what}: folder {folder} does not exist; create it or choose another path")
    if target.exists() and not target.stat().st_mode & 0o222:
        raise BadInput(f"{what}: it is read-only; make it writable (chmod u+w) or choose another path")
    if not _can_create_in(folder):
        raise BadInput(f"{what}: folder {folder} is not writable; choose another path")
    return target


def write_atomic(path: str | os.PathLike, text: str | bytes, *, what: str | None = None) -> Path:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one.

    The file is written as any program writes one: a new file gets the mode the umask
    gives, an existing one keeps its mode, and a symlink stays a link whose target is
    replaced. The new text goes to a hidden temporary file beside the target first,
    removed again on any error, Ctrl-C or SIGTERM. BadInput names ``what`` (default
    "cannot write PATH") when the file cannot be written.
    """
    path = Path(path)
    what = what or f"cannot write {path}"
    target = check_writable(path, what=what)
    data = text.encode("utf-8") if isinstance(text, str) else text
    if _is_special(path):
        with open(path, "wb") as f:
            f.write(data)
        return path
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    with cleanup_before_termination():
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise BadInput(f"{what}: {exc.strerror or exc}") from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


def _is_special(path: Path) -> bool:
    """An existing file that is not a regular file or a folder (/dev/null, /dev/stdout, a named pipe)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _can_create_in(folder: Path) -> bool:
    probe = folder / f".autotune-write-check.{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        return False
    probe.unlink(missing_ok=True)
    return True


class _Terminated(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


@contextlib.contextmanager
def cleanup_before_termination() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP (where they would end the process outright) raise
    inside it, so its cleanup (``except``/``finally``) runs; then the signal ends the process as it
    would have. Elsewhere than the main thread, or with a handler of the program's own, nothing changes.
    """
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _raise_terminated) for s in signals if signal.getsignal(s) is signal.SIG_DFL}
    try:
        yield
    except _Terminated as exc:
        for s, handler in previous.items():
            signal.signal(s, handler)
        previous = {}
        os.kill(os.getpid(), exc.signum)  # the default action again: the process ends here
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ResultFileError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise ResultFileError(f"{path} is a folder; give the JSON file inside it (plan.json or result.json)") from None
    except OSError as exc:
        raise ResultFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultFileError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}): not an autotune result") from None
