"""Run under torchrun by tests/training/test_distributed.py: several cases in one job, one process group.

``python -m tests.training.torchrun_cases CASE [CASE ...]``, from the repository root, runs each case on every
rank, in order, inside one gloo process group (a job costs seconds to start; the cases share it). A case given
as ``NAME=KIND:ARGUMENT`` is the case KIND called with ARGUMENT (``cli:ARGV`` runs the command line). Rank 0
prints one JSON object: each case's name and what its ``case()`` returned there.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from autotune.cli.common import import_torch

import_torch(freeze=True)  # as ``autotune run`` loads torch in a rank

from autotune.training import distributed  # noqa: E402

from . import (  # noqa: E402
    cli_worker,
    ddp_uneven_worker,
    ddp_worker,
    fsdp_worker,
    mixed_worker,
    noise_ddp_worker,
    ramp_ddp_worker,
)
from .batch_kinds_worker import case as batch_kinds  # noqa: E402
from .rank_exit import run_then_exit  # noqa: E402

CASES: dict[str, Callable[..., object]] = {
    "ddp_faults": ddp_worker.case,
    "uneven_batches": ddp_uneven_worker.case,
    "noise_scale": noise_ddp_worker.case,
    "fsdp": fsdp_worker.case,
    "ramp": ramp_ddp_worker.case,
    "mixed_ranks": mixed_worker.case,
    "batch_kinds": batch_kinds,
    "cli": cli_worker.case,
}


def main() -> None:
    with distributed.process_group(60):
        out = {}
        for spec in sys.argv[1:]:
            name, _, call = spec.partition("=")
            kind, _, argument = call.partition(":")
            out[name] = CASES[kind](argument) if call else CASES[name]()
        if distributed.rank() == 0:
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    run_then_exit(main)
