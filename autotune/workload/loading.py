"""Probe specs: a built-in name, a .py file, or package.module[:function] whose build() gives a Workload."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from ..errors import ProbeFileError, user_code
from ..options import BUILTIN_PROBES, ProbeSpec, probe_spec
from ..results.model import ModelSpec, is_model_spec
from .core import Workload


def load_workload(spec: str | None = None) -> Workload:
    """The Workload that ``spec`` builds.

    ``spec``: a built-in probe name (mlp, gpt, convnet), a path to a ``.py``
    file, or an importable ``package.module``; any of them optionally followed
    by ``:function`` to call instead of ``build``; or a Hugging Face model by name (``hf:NAME?...``, see
    :mod:`autotune.results.model`). None means the default probe.
    """
    if is_model_spec(spec):
        from .hf import build as build_model

        return build_model(ModelSpec.parse(str(spec)))
    where = probe_spec(spec)
    target, func_name = where.name, where.function
    module = _import(where)
    build = getattr(module, func_name, None)
    if build is None:
        raise ProbeFileError(f"probe {target!r} has no {func_name}() function: "
                             f"define {func_name}() -> autotune.Workload")
    if not callable(build):
        raise ProbeFileError(f"probe {target!r}: {func_name} is a {type(build).__name__}, not a function")
    with user_code(lambda exc: ProbeFileError(f"probe {target!r}: {func_name}() failed: {type(exc).__name__}: {exc}")):
        workload = build()
    if not isinstance(workload, Workload):
        raise ProbeFileError(
            f"probe {target!r}: {func_name}() returned {type(workload).__name__}, not an autotune.Workload"
        )
    return workload


def _import(where: ProbeSpec) -> ModuleType:
    target = where.module
    if where.file:
        path = Path(target)
        name = f"autotune_probe_{abs(hash(str(path.resolve())))}"
        added = _importable(path.resolve().parent)
        try:
            with user_code(lambda exc: _file_error(target, exc)):
                module_spec = importlib.util.spec_from_file_location(name, path)
                if module_spec is None or module_spec.loader is None:
                    raise OSError(f"{target} is not a Python file")
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                module_spec.loader.exec_module(module)
        except ProbeFileError:
            _forget(name, added)
            raise
        return module
    with user_code(lambda exc: _module_error(target, exc)):
        return importlib.import_module(target)


def _file_error(target: str, exc: Exception) -> ProbeFileError:
    """Why the probe file ``target`` cannot be used: it cannot be read, or importing it raised ``exc``."""
    if isinstance(exc, OSError):
        return ProbeFileError(f"probe file {target!r} cannot be read: {exc.strerror or exc}")
    return ProbeFileError(f"probe file {target!r} could not be imported: {type(exc).__name__}: {exc}")


def _module_error(target: str, exc: Exception) -> ProbeFileError:
    """Why the module ``target`` cannot be used: there is none of that name, or importing it raised ``exc``."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and target.startswith(exc.name):
        return ProbeFileError(f"probe {target!r} is neither a file nor an importable module "
                              f"(built-in probes: {', '.join(BUILTIN_PROBES)})")
    return ProbeFileError(f"probe {target!r} could not be imported: {type(exc).__name__}: {exc}")


def _importable(folder: Path) -> str | None:
    """Put a probe file's folder on ``sys.path`` so the file imports the modules beside it, as
    ``python probe.py`` would; returns the entry added (None when it was there already).

    The entry goes right after the standard library's, so a file beside the probe (a
    ``random.py``, say) never replaces a standard module, while it is found before installed
    packages. It stays for the rest of the process: the workload's factories may import
    lazily, when they first run.
    """
    entry = str(folder)
    if any(os.path.realpath(p or os.curdir) == entry for p in sys.path):
        return None
    sys.path.insert(_after_stdlib(), entry)
    return entry


def _after_stdlib() -> int:
    """The ``sys.path`` index just past the standard library's entries (the end when none is found)."""
    stdlib = {os.path.realpath(sysconfig.get_path(key)) for key in ("stdlib", "platstdlib")}
    stdlib |= {os.path.join(p, "lib-dynload") for p in stdlib}
    last = max((i for i, p in enumerate(sys.path)
                if os.path.realpath(p or os.curdir) in stdlib or re.fullmatch(r"python\d+\.zip", os.path.basename(p))),
               default=None)
    return len(sys.path) if last is None else last + 1


def _forget(name: str, added: str | None) -> None:
    """Undo what loading a probe file changed, when it failed."""
    sys.modules.pop(name, None)
    if added is not None and added in sys.path:
        sys.path.remove(added)
