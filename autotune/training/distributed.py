"""Many ranks with torch.distributed: PyTorch's own process group and DDP, nothing home-made.

Under ``torchrun`` every rank probes its own device; ranks alike agree on the
smallest maximum and the plan gives every rank the same number of micro-steps,
ranks that differ (a smaller or busier GPU) each get their own micro-batch and
number of micro-steps (:mod:`autotune.training.ranks`); the runner wraps the model in
DistributedDataParallel and checks, after each step, that one all-reduce round
synchronised the gradients and that every rank holds the same parameters.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import options
from ..compat import queue_backward_callback, sequence_number, tree_leaves
from ..errors import AutotuneError, BadInput, undo_on_failure
from ..units import plural


def active() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_world(planned: int, what: str, fix: str) -> None:
    """BadInput unless ``planned`` processes are running (this process group's ranks, else this one process):
    a job of another size would train the wrong share of every batch. ``what`` asked for them ("the plan is
    for 2 ranks"), ``fix`` is the other way out."""
    world = world_size()
    if world != planned:
        raise BadInput(f"{what} but {plural(world, 'process', 'processes')} {'is' if world == 1 else 'are'} "
                       "running", field="world_size", limit=world,
                       fix=f"launch with torchrun --nproc-per-node {planned} ({fix})")


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    return options.torchrun_group(env) is not None


@contextlib.contextmanager
def process_group(timeout_s: float = options.DIST_TIMEOUT_S) -> Iterator[bool]:
    """Join the process group torchrun describes (gloo on CPUs, nccl on GPUs) for the block.

    Yields True when a group was joined here. A rank waiting for another that
    failed gives up after ``timeout_s`` seconds instead of hanging.

    When the block ends normally the ranks leave together (a barrier), and the
    group is destroyed for real: its threads are joined before this returns, so
    the interpreter never finalizes under a communication thread that may still
    need the GIL to release what it holds. When the block raises, the rank
    leaves at once (the others are stopped by torchrun or their timeout).
    """
    if not launched_by_torchrun() or (dist.is_available() and dist.is_initialized()):
        yield False
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _import_group_defaults()
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    with undo_on_failure(lambda: _leave(together=False)):
        yield True
    _leave(together=True)


def _leave(*, together: bool) -> None:
    try:
        if together:
            try:
                dist.barrier()
            except RuntimeError as exc:  # a rank that stopped with an error has closed its connections
                raise AutotuneError(f"rank {rank()} finished its work but another rank stopped before the end; "
                                    f"that rank's error says why ({_first_sentence(exc)})") from exc
    finally:
        gc.collect()  # DDP wrappers left in reference cycles still hold the group
        dist.destroy_process_group()


def _first_sentence(exc: BaseException) -> str:
    """A library error's first sentence, without the source location gloo puts in front."""
    text = next(iter(str(exc).strip().splitlines()), "") or type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0].rstrip(".")


def _import_group_defaults() -> None:
    """Import the modules that take the world group as a default argument, before there is one.

    ``torch.distributed.nn.functional`` (imported by DistributedDataParallel,
    through ``torch._dynamo``) evaluates ``group=group.WORLD`` at import time;
    imported inside a process group, it keeps that group alive for good, and
    ``destroy_process_group`` then leaves its threads running.
    """
    import torch.distributed.nn  # noqa: F401


def local_device_name() -> str:
    """This rank's device when asked for ``auto``: its own GPU, else the CPU."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def collective_device(group: Any = None) -> torch.device:
    """Where a collective of ``group`` (default: the world's) takes its tensors: this rank's GPU under nccl,
    else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_ints(value: int) -> list[int]:
    """Every rank's ``value``, in rank order."""
    t = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [int(x.item()) for x in out]


def all_true(flag: bool) -> bool:
    """True when ``flag`` holds on every rank."""
    return min(gather_ints(int(bool(flag)))) == 1


def parameter_digest(model: nn.Module) -> int:
    """A 63-bit hash of every parameter's bytes, to compare ranks."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """The model in DistributedDataParallel on ``device``."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # Gradients as views into the communication buckets: no second copy of every gradient.
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


class RoundCounter:
    """Counts the gradient all-reduce rounds of a DDP model: backward passes that communicated.

    A round is one backward through the model's output during which the process
    group issued collectives (DDP's bucket all-reduces), read from the group's
    collective sequence number when that backward starts and when it ends. It is
    all observed on the thread that runs the backward: DDP's communication keeps
    its built-in C++ path, with no Python callback on the process group's threads.
    """

    def __init__(self, ddp_model: nn.Module):
        self.rounds = 0
        group: Any = getattr(ddp_model, "process_group", None) or dist.group.WORLD
        self._sequence = sequence_number(group)
        ddp_model.register_forward_hook(self._watch)

    def _watch(self, module: nn.Module, inputs: object, output: object) -> None:
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_starts, mode="any")

    def _backward_starts(self, grad: torch.Tensor) -> None:
        start = self._sequence()
        queue_backward_callback(lambda: self._backward_ends(start))

    def _backward_ends(self, start: int) -> None:
        if self._sequence() != start:
            self.rounds += 1

    def take(self) -> int:
        """Rounds since the last call."""
        n, self.rounds = self.rounds, 0
        return n


def rank_offsets(per_rank: tuple[int, ...]) -> list[int]:
    """Where each rank's share starts in the global effective batch."""
    out, start = [], 0
    for n in per_rank:
        out.append(start)
        start += n
    return out
