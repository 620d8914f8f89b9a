"""Report folders written atomically: all files or none, never a half report.

Every file goes into a hidden temporary sibling folder first; only when all of
them are written is that folder renamed into place. An existing folder is
replaced only with ``force``, and only when it is a report folder (or empty),
so a mistyped ``--out`` cannot wipe unrelated files; writers racing to replace
the same folder leave one whole report. An error, Ctrl-C or SIGTERM removes
the temporary folder; only a process killed outright (SIGKILL, power loss) can
leave a hidden ``.<name>.*.tmp`` folder beside the target. The target itself is
never half written.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from ..errors import BadInput, undo_on_failure
from ..serial import cleanup_before_termination

REPORT_MARKERS = ("report.html", "report.md")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_folder(name: str, *, root: str | os.PathLike = "reports", now: datetime | None = None) -> Path:
    """``reports/<name>-<YYYYmmdd-HHMMSS>/`` (relative to the current folder), with ``-2``, ``-3``, ...
    appended when a report of the same second exists already."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{_UNSAFE.sub('-', name).strip('-.') or 'report'}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_folder(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Raise BadInput unless a report can be written at ``path``; returns the path.

    Cheap enough to call before long work so that a bad ``--out`` fails first.
    """
    path = Path(path)
    parent = _existing_ancestor(path.parent)
    if not parent.is_dir():
        raise BadInput(f"cannot write a report at {path}: {parent} is a file, not a folder; choose another folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"cannot write a report at {path}: folder {parent} is not writable; choose another folder")
    if path.is_symlink() or path.exists():
        entries = _entries(path)  # one listing, so that a folder swapped meanwhile is judged whole
        if entries is None:
            raise BadInput(f"cannot write a report at {path}: it exists and is not a folder; choose another path")
        if not force:
            raise BadInput(f"report folder {path} exists already: pass {{force=True}} to replace it, "
                           "or choose another folder")
        if entries and not any(name in entries and entries[name] for name in REPORT_MARKERS):
            raise BadInput(f"{path} is not a report folder (no report.html or report.md): refusing to replace it "
                           "even with {force=True}; choose an empty or new folder")
    return path


def _entries(path: Path) -> dict[str, bool] | None:
    """{name: is a file} of the folder ``path``; {} once it is gone; None when it is not a folder."""
    if path.is_symlink():
        return None
    try:
        with os.scandir(path) as listing:
            return {entry.name: entry.is_file() for entry in listing}
    except FileNotFoundError:
        return {}
    except NotADirectoryError:
        return None


def _existing_ancestor(path: Path) -> Path:
    """The nearest of ``path`` and its parents that exists (a folder, or a file in the way)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_folder(path: str | os.PathLike, fill: Callable[[Path], None], *, force: bool = False) -> Path:
    """Create ``path`` with the files ``fill(tmp)`` writes into a temporary sibling folder.

    The temporary folder becomes ``path`` by one rename. With ``force`` an
    existing report folder is swapped out by two renames and then deleted; if
    the second rename fails, the old folder is put back.
    """
    path = check_folder(path, force=force)
    with cleanup_before_termination():
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir(0o777)  # the umask applies, as to any new folder
        except OSError as exc:
            raise BadInput(f"cannot write a report at {path}: {exc.strerror or exc}; "
                           "choose a writable folder") from None
        with undo_on_failure(lambda: shutil.rmtree(tmp, ignore_errors=True)):
            fill(tmp)
            _move_into_place(tmp, path, force=force)
    return path


_TAKEN = (errno.EEXIST, errno.ENOTEMPTY)


def _move_into_place(tmp: Path, path: Path, *, force: bool, attempts: int = 20) -> None:
    """Rename ``tmp`` to ``path``; with ``force`` an existing folder is moved aside first and deleted.

    Another writer may replace ``path`` at the same time: the last rename wins and each
    writer deletes only the folder it moved aside, so one whole report remains. If the
    new folder cannot be put in place for another reason, the old one is put back.
    """
    for _ in range(attempts):
        try:
            os.rename(tmp, path)
            return
        except OSError as exc:
            if exc.errno not in _TAKEN:
                raise BadInput(f"cannot write a report at {path}: {exc.strerror or exc}") from None
        if not force:  # appeared while the report was being written
            raise BadInput(f"report folder {path} exists already: pass {{force=True}} to replace it, "
                           "or choose another folder")
        old = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.old")
        try:
            os.rename(path, old)
        except FileNotFoundError:
            continue  # another writer moved it aside first
        except OSError as exc:
            raise BadInput(f"cannot replace the report at {path}: {exc.strerror or exc}") from None
        with undo_on_failure(functools.partial(_put_back, old, path)):
            try:
                os.rename(tmp, path)
            except OSError as exc:
                if exc.errno not in _TAKEN:
                    raise BadInput(f"cannot write a report at {path}: {exc.strerror or exc}") from None
                # another writer put its report in place meanwhile: replace that one
                shutil.rmtree(old, ignore_errors=True)
                continue
        shutil.rmtree(old, ignore_errors=True)
        return
    raise BadInput(f"cannot write a report at {path}: other processes keep replacing it; try again")


def _put_back(old: Path, path: Path) -> None:
    try:
        os.rename(old, path)
    except OSError:  # another writer's report is there now: the old one is not needed
        shutil.rmtree(old, ignore_errors=True)

