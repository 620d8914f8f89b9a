"""The probes a service runs: the built-in ones and those in the folders its operator named.

A probe is code, so a request names one of these and nothing else: ``NAME`` or
``NAME:FUNCTION``, letters, digits and underscores only, never a path or a
module. ``NAME`` is a built-in probe (mlp, gpt, convnet) or a ``NAME.py`` file
directly inside a ``--probes`` folder (built-in names first, then the folders in
the order given); ``FUNCTION`` (default ``build``) a function defined at the top
of that file that takes no arguments and is not annotated to return anything but
a ``Workload``. Files are read with :mod:`ast` here, never
imported: the service's worker process imports them when a request needs one.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput

#: How a request names a probe.
PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,63}(:[A-Za-z][A-Za-z0-9_]{0,63})?$"
_NAME = re.compile(PATTERN)


class UnknownProbe(BadInput):
    """A request named a probe this service does not run."""


class BrokenProbe(BadInput):
    """A request named a probe whose file cannot be read (a syntax error in it)."""


@dataclass(frozen=True)
class Probe:
    """A probe the service runs: its name, file, the functions a request may call, and why the file
    cannot be read (``SyntaxError at line 3``), if it cannot."""

    name: str
    path: Path
    builtin: bool
    functions: tuple[str, ...]
    error: str | None = None

    def spec(self, function: str) -> str:
        """What :func:`autotune.workload.load_workload` loads for ``function``."""
        return f"{self.name}:{function}" if self.builtin else f"{self.path}:{function}"

    def source(self) -> str:
        """A digest of the code the probe may run as it is now: the ``*.py`` files of its folder (the file
        itself and the modules beside it that it may import)."""
        return folder_digest(self.path.parent)


class Catalogue:
    """The built-in probes and the ``*.py`` files in ``folders``, looked up afresh on every request
    (a file the operator adds or edits is served as it is now)."""

    def __init__(self, folders: Sequence[str | Path] = ()):
        self.folders = tuple(Path(f).resolve() for f in folders)
        for folder in self.folders:
            if not folder.is_dir():
                raise BadInput(f"--probes {folder} is not a folder: give folders holding probe files (NAME.py)")
        self.builtins = tuple(sorted(p.stem for p in _builtin_dir().glob("*.py") if not p.name.startswith("_")))

    def find(self, name: str) -> Probe | None:
        if name in self.builtins:
            path = _builtin_dir() / f"{name}.py"
            return Probe(name=name, path=path, builtin=True, functions=_read(path)[0])
        for folder in self.folders:
            path = folder / f"{name}.py"
            if path.is_file():
                try:
                    found = _read(path)[0]
                except (OSError, SyntaxError, ValueError) as exc:
                    return Probe(name=name, path=path, builtin=False, functions=(), error=_why(exc))
                return Probe(name=name, path=path, builtin=False, functions=found)
        return None

    def resolve(self, text: str) -> tuple[Probe, str]:
        """The probe and function a request names; UnknownProbe when this service has no such probe."""
        if not isinstance(text, str) or not _NAME.match(text):
            raise UnknownProbe(f"probe {text!r} is not a probe name: use NAME or NAME:FUNCTION (letters, digits, "
                               "underscores); GET /v1/probes lists them")
        name, _, function = text.partition(":")
        probe = self.find(name)
        if probe is None:
            raise UnknownProbe(f"probe {name!r} is not served here: GET /v1/probes lists the probes this service "
                               f"runs ({', '.join(p.name for p in self.all())})")
        function = function or "build"
        if probe.error is not None:
            raise BrokenProbe(f"probe {name!r} failed to load: {probe.error}")
        if function not in probe.functions:
            raise UnknownProbe(f"probe {name!r} has no function {function!r} that builds a workload without "
                               f"arguments; it has {', '.join(probe.functions) or 'none'}")
        return probe, function

    def all(self) -> list[Probe]:
        """Every probe served, built-in ones first, each name once."""
        seen: dict[str, Probe] = {}
        names = list(self.builtins) + [p.stem for f in self.folders for p in sorted(f.glob("*.py"))]
        for name in names:
            if name not in seen and _NAME.match(name) and (probe := self.find(name)) is not None:
                seen[name] = probe
        return list(seen.values())


def functions(path: Path) -> tuple[str, ...]:
    """Public functions defined at the top of ``path`` that can be called without arguments and may build a
    workload (no return annotation, or ``Workload``: ``def model() -> nn.Module`` is not one); OSError,
    SyntaxError or ValueError (not UTF-8, a null byte) when it cannot be read."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and _builds(node.returns):
            args = node.args
            positional = args.posonlyargs + args.args
            if len(args.defaults) == len(positional) and all(d is not None for d in args.kw_defaults):
                out.append(node.name)
    return tuple(out)


def _builds(returns: ast.expr | None) -> bool:
    """Whether a function's return annotation allows a workload: none, ``Workload``, ``autotune.Workload``
    or either in quotes."""
    if returns is None:
        return True
    if isinstance(returns, ast.Constant) and isinstance(returns.value, str):
        return returns.value.rpartition(".")[2].strip() == "Workload"
    name = returns.id if isinstance(returns, ast.Name) else returns.attr if isinstance(returns, ast.Attribute) else None
    return name == "Workload"


_READ: dict[Path, tuple[tuple[int, int, int], tuple[str, ...], str]] = {}
_READ_LOCK = threading.Lock()


def _read(path: Path) -> tuple[tuple[str, ...], str]:
    """``path``'s callable functions (:func:`functions`) and the digest of its bytes, read again only once
    the file changed (its inode, size or time of change); raises as :func:`functions` does."""
    found = os.stat(path)
    signature = (found.st_ino, found.st_size, found.st_mtime_ns)
    with _READ_LOCK:
        known = _READ.get(path)
    if known is not None and known[0] == signature:
        return known[1], known[2]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    try:
        names = functions(path)
    except (SyntaxError, ValueError):
        names = None
    with _READ_LOCK:
        if names is not None:
            _READ[path] = (signature, names, digest)
    if names is None:
        functions(path)  # raises again, for the caller to say why
    return names or (), digest


def folder_digest(folder: Path) -> str:
    """A digest of the names and contents of the ``*.py`` files in ``folder`` (a file that cannot be read
    counts by its name)."""
    parts = []
    for path in sorted(folder.glob("*.py")):
        try:
            parts.append(f"{path.name}:{_read(path)[1]}")
        except (OSError, SyntaxError, ValueError):
            parts.append(f"{path.name}:unreadable")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _why(exc: BaseException) -> str:
    """Why a probe file cannot be read, without its path: ``SyntaxError at line 3``."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__} at line {exc.lineno}" if exc.lineno else type(exc).__name__
    if isinstance(exc, OSError):
        return f"the file cannot be read ({exc.strerror or type(exc).__name__})"
    return f"{type(exc).__name__}: the file is not UTF-8 Python text"


@functools.cache
def _builtin_dir() -> Path:
    """Where the built-in probes are: the installed ``autotune.probes`` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("autotune.probes")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the built-in probes (autotune.probes) are not installed")
    return Path(next(iter(spec.submodule_search_locations)))
