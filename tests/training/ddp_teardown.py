"""Run under torchrun by tests/training/test_distributed.py: DDP training, then the rank leaves and finalizes at once.

Each rank prints one JSON line: its thread count before joining the process
group, inside it and after leaving it, and the all-reduce rounds counted for
optimizer steps of 1, 2 and 3 micro-steps (all but the last in ``no_sync()``).
Then the script ends the ordinary way, through interpreter finalization, right
after its last collective.

``python ddp_teardown.py SECONDS [--rank0-fails]``: the interpreter hands the GIL to a waiting
thread only every SECONDS (default 0.005, Python's own). At 0.5 a
communication thread that asks for the GIL to release what it holds nearly
always still waits when the main thread finalizes: what a loaded machine does
by chance, made the rule. A process group that leaves such a thread alive ends
the rank with ``terminate called without an active exception`` (SIGABRT).
With ``--rank0-fails``, rank 0 raises after its last collective, before the
ranks leave together; each rank prints its error instead, and rank 0 lingers until
rank 1 has spoken (a key rank 1 sets in torchrun's store; at most a few seconds), so
that torchrun does not stop rank 1 before it has.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from autotune.errors import AutotuneError
from autotune.training import distributed


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def train() -> list[int]:
    torch.manual_seed(0)
    model = distributed.wrap(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), torch.device("cpu"))
    counter = distributed.RoundCounter(model)
    x = torch.randn(16, 64)
    rounds = []
    for micro_steps in (1, 2, 3):
        for i in range(micro_steps):
            with model.no_sync() if i < micro_steps - 1 else contextlib.nullcontext():
                model(x).sum().backward()
        rounds.append(counter.take())
    return rounds


def main() -> int:
    sys.setswitchinterval(float(sys.argv[1]) if len(sys.argv) > 1 else 0.005)
    rank = int(os.environ["RANK"])
    before = threads()
    try:
        with distributed.process_group(60):
            inside = threads()
            rounds = train()  # its last collective, then straight out (a syscall here would let waiting threads in)
            if "--rank0-fails" in sys.argv and rank == 0:
                raise ValueError("planted failure after the last collective")
    except (ValueError, AutotuneError) as exc:
        say({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        spoken(rank)
        return 1
    say({"rank": rank, "threads_before": before, "threads_inside": inside, "threads_after": threads(),
         "rounds": rounds})
    return 0


def spoken(rank: int, linger_s: float = 3) -> None:
    """Rank 1: say in torchrun's store that it has spoken. Rank 0: wait for that, ``linger_s`` at most."""
    start = time.monotonic()
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=linger_s))
        if rank == 0:
            store.wait(["ddp_teardown/rank_1_spoke"])
        else:
            store.set("ddp_teardown/rank_1_spoke", "1")
    except RuntimeError:  # no store, or no word from rank 1 in time: rank 0 lingers what is left
        if rank == 0:
            time.sleep(max(0.0, linger_s - (time.monotonic() - start)))


def say(record: dict) -> None:
    """One JSON line in one write: both ranks share torchrun's stdout, and a line written in pieces can
    interleave with the other rank's."""
    os.write(1, (json.dumps(record) + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
