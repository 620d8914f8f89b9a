"""JSON for every stage's result: a ``kind``, a ``schema_version``, atomic files.

No torch here: the planner and the reports use it too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import BadInput, ResultFileError, undo_on_failure

#: The schema of the results this autotune writes and reads (2: typed device, verification, tuning and
#: noise-scale records); a file of another schema is refused with the way to get one it reads.
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
    if version < SCHEMA_VERSION:
        raise ResultFileError(
            f"{source} has schema_version {version}, older than the {SCHEMA_VERSION} this autotune reads: "
            f"write it again with {WRITTEN_BY[found]}"
        )
    body = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
    return found, body


_EXACT = {int, str, bool, type(None)}


def _clean(value: Any) -> Any:
    """JSON cannot hold NaN or infinity: write them as null. Lists of plain numbers pass at C speed."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kinds = set(map(type, value))
        if kinds <= _EXACT or (kinds == {float} and all(map(math.isfinite, value))):
            return list(value)
        return [_clean(v) for v in value]
    return value


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(_clean(data), indent=2, sort_keys=False) + "\n"


def check_writable(path: str | os.PathLike, *, what: str | None = None, example: str = "result.json",
                   field: str | None = None) -> Path:
    """The file that writing ``path`` replaces (through symlinks); BadInput, starting with ``what``,
    when it cannot be written: a missing or unwritable folder, a folder (``example``: a file name to suggest
    in it), a read-only file.

    Cheap enough to call before long work, so that a bad output path fails first.
    """
    path = Path(path)
    what = what or f"cannot write {path}"
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise BadInput(f"{what}: it is a folder; give a file path, e.g. {path / example}", field=field)
    if _is_special(path):
        return path  # /dev/null, a pipe: written in place
    folder = target.parent
    if not folder.is_dir():
        raise BadInput(f"{what}: folder {folder} does not exist; create it or choose another path", field=field)
    if target.exists() and not target.stat().st_mode & 0o222:
        raise BadInput(f"{what}: it is read-only; make it writable (chmod u+w) or choose another path", field=field)
    if not _can_create_in(folder):
        raise BadInput(f"{what}: folder {folder} is not writable; choose another path", field=field)
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
        with undo_on_failure(lambda: tmp.unlink(missing_ok=True)):
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if mode is not None:
                    os.chmod(tmp, mode)
                os.replace(tmp, target)
            except OSError as exc:
                raise BadInput(f"{what}: {exc.strerror or exc}") from exc
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
