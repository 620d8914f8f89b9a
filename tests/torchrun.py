"""torchrun for the tests: torch's own launcher (``torch.distributed.run``), in a process forked from a
server that imported it once, instead of a fresh interpreter per job (each would import torch again,
seconds of CPU). The ranks it starts are fresh processes, as under ``python -m torch.distributed.run``."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).parent.parent
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["torch.distributed.run"])


def torchrun(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 ARGV...`` from the repository root, with one intra-op
    thread per rank and Python's warnings off; its exit code, stdout and stderr as ``subprocess.run`` gives
    them (``TimeoutExpired`` past ``timeout`` seconds)."""
    command = ["--standalone", "--nproc-per-node", "2", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        launcher = _context.Process(target=_launch, args=(command, env, str(out), str(err)))
        launcher.start()
        launcher.join(timeout)
        if launcher.is_alive():
            launcher.kill()
            launcher.join()
            raise subprocess.TimeoutExpired(["torchrun", *command], timeout)
        return subprocess.CompletedProcess(["torchrun", *command], launcher.exitcode, out.read_text(),
                                           err.read_text())


def _launch(command: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The launcher's life: torchrun's ``main``, its output in the files given, its exit code as it would
    end (1 when a rank failed: torchrun raises ChildFailedError)."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    from torch.distributed.run import main

    code = 0
    try:
        main(command)
    except SystemExit as exc:  # as the interpreter ends on it: None is 0, a message is 1
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
