"""What a piece of autotune loads, watched in a fresh interpreter: which heavy libraries it imported, and for each
the chain of imports (and calls) that pulled it in.

``watch(code, *argv)`` runs ``code`` as ``python -c`` does, with a watcher on the import system installed first:
when a watched library is first imported, the watcher notes the stack of autotune (and third-party) frames that
asked for it. The chain reads outermost first: ``<code>:1 -> autotune.store.store:12 -> autotune.store.fingerprint:8
-> torch``; a frame inside a function is named ``module.function:line``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

#: The libraries the light parts of autotune never load.
TORCH, NUMPY, PANDAS = "torch", "numpy", "pandas"
FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")

_WATCHER = r'''
import atexit as _atexit, json as _json, os as _os, sys as _sys


def _watch():
    watched = set(_os.environ["AUTOTUNE_TEST_WATCHED"].split(","))
    chains = {}

    def name_of(filename):
        for name, module in list(_sys.modules.items()):
            if getattr(module, "__file__", None) == filename:
                return name
        return filename

    def chain():
        frame, frames = _sys._getframe(2), []
        while frame is not None:
            code = frame.f_code
            if code.co_filename != "<string>" and not code.co_filename.startswith("<frozen") \
                    and "importlib" not in code.co_filename:
                where = name_of(code.co_filename)
                if code.co_name != "<module>":
                    where = f"{where}.{code.co_name}"
                frames.append(f"{where}:{frame.f_lineno}")
            frame = frame.f_back
        return frames[::-1]

    class Watcher:
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in watched and top not in chains and top not in _sys.modules:
                chains[top] = chain()
            return None

    _sys.meta_path.insert(0, Watcher())

    def report():
        loaded = {m: chains.get(m, []) for m in sorted(watched) if m in _sys.modules}
        with open(_os.environ["AUTOTUNE_TEST_WATCH_REPORT"], "w") as out:
            _json.dump(loaded, out)

    _atexit.register(report)


_watch()
del _watch
'''


@dataclass(frozen=True)
class Watched:
    """A watched run: its exit code and output, and each watched library it loaded with the chain that did."""

    returncode: int
    stdout: str
    stderr: str
    loaded: dict[str, list[str]]

    def chains(self) -> str:
        """What was loaded and how, in one line: ``<code>:1 -> autotune.x:3 -> ... -> torch; ...``."""
        return "; ".join(" -> ".join([*chain, name]) for name, chain in self.loaded.items())


def watch(code: str, *argv: str, libraries: tuple[str, ...] = (TORCH,), timeout: float = 120) -> Watched:
    """Run ``code`` (with ``argv``) in a fresh interpreter, watching for ``libraries`` being imported."""
    with tempfile.TemporaryDirectory(prefix="watch-") as folder:
        report = os.path.join(folder, "loaded.json")
        env = {**os.environ, "AUTOTUNE_TEST_WATCHED": ",".join(libraries), "AUTOTUNE_TEST_WATCH_REPORT": report,
               "PYTHONWARNINGS": "ignore"}
        program = f"{_WATCHER}\nexec(compile({code!r}, '<code>', 'exec'))\n"
        done = subprocess.run([sys.executable, "-c", program, *argv], capture_output=True, text=True,
                              timeout=timeout, env=env, check=False)
        if not os.path.exists(report):
            raise AssertionError(f"the watched code ended before it could report (exit {done.returncode}): "
                                 f"{done.stderr[-2000:]}")
        with open(report) as f:
            loaded = json.load(f)
    return Watched(done.returncode, done.stdout, done.stderr, loaded)
