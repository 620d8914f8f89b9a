"""A case of torchrun_cases.py: the ``autotune`` command line, run by every rank inside the job's process group
(the command joins none of its own then, as it would under a launcher that made the group)."""

from __future__ import annotations

import contextlib
import io

import torch.distributed as dist

from autotune.cli import _main


def case(argv: str) -> dict:
    """``autotune ARGV`` (one string, split on spaces) on every rank: the exit codes of all ranks, and rank 0's
    stdout and the end of its stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _main(argv.split(" "))
    codes: list = [None] * dist.get_world_size()
    dist.all_gather_object(codes, code)
    return {"codes": codes, "stdout": out.getvalue(), "stderr": err.getvalue()[-2000:]}
