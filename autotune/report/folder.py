"""Report folders written atomically: all files or none, never a half report.

Every file goes into a hidden temporary sibling folder first; only when all of
them are written is that folder renamed into place. An existing folder is
replaced only with ``force``, and only when it is a report folder (or empty),
so a mistyped ``--out`` cannot wipe unrelated files. A process killed outright
(SIGKILL, power loss) can leave a hidden ``.<name>.*.tmp`` folder beside the
target; the target itself is never half written.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from ..errors import BadInput

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
        if not path.is_dir() or path.is_symlink():
            raise BadInput(f"cannot write a report at {path}: it exists and is not a folder; choose another path")
        if not force:
            raise BadInput(f"report folder {path} exists already: pass --force to replace it, or choose another folder")
        if any(path.iterdir()) and not any((path / marker).is_file() for marker in REPORT_MARKERS):
            raise BadInput(f"{path} is not a report folder (no report.html or report.md): refusing to replace it "
                           "even with --force; choose an empty or new folder")
    return path


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as exc:
        raise BadInput(f"cannot write a report at {path}: {exc.strerror or exc}; choose a writable folder") from None
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a report folder is an ordinary, readable one
        _move_into_place(tmp, path, force=force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _move_into_place(tmp: Path, path: Path, *, force: bool) -> None:
    if not path.exists():
        try:
            os.rename(tmp, path)
        except OSError as exc:
            raise BadInput(f"cannot write a report at {path}: {exc.strerror or exc}") from None
        return
    if not force:  # appeared while the report was being written
        raise BadInput(f"report folder {path} exists already: pass --force to replace it, or choose another folder")
    old = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.old")
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)

