"""JSON for every stage's result: a ``kind``, a ``schema_version``, atomic files.

No torch here: the planner and the reports use it too.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import BadInput, ResultFileError

SCHEMA_VERSION = 1
KINDS = ("ProbeResult", "Plan", "RunResult")


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
        raise ResultFileError(f"{source} holds a {found}, not a {kind}")
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


def write_atomic(path: str | os.PathLike, text: str | bytes) -> Path:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one."""
    path = Path(path)
    if not path.parent.is_dir():
        raise BadInput(f"cannot write {path}: folder {path.parent} does not exist; create it or choose another path")
    mode = "wb" if isinstance(text, bytes) else "w"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}; choose a writable folder") from exc
    try:
        with os.fdopen(fd, mode) as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
