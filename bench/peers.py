"""The peers, run for real on the CPU inside an emulated memory budget.

Used by ``probe_vs_peers.py``. Each peer's training steps run under autotune's
live-storage tracker with the capacity enforced; an allocation past it raises
the exception a CUDA out-of-memory reads as ("CUDA out of memory. Tried to
allocate ..."), which is what Lightning's ``is_oom_error`` and Accelerate's
``should_reduce_batch_size`` look for. That conversion lives here, in the
benchmark only: autotune itself raises ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch.utils._pytree import tree_map

from autotune.devices.base import Session, timed_measure
from autotune.devices.tracker import LiveStorageTracker
from autotune.probing.fitrule import fit_rule_work
from autotune.units import format_bytes
from autotune.workload import Workload

_EMULATED = re.compile(r"allocating .*?\((\d+) bytes\).*capacity is .*?\((\d+) bytes\)")


def cuda_oom_message(emulated: str, current: int) -> str:
    """The text of a CUDA out-of-memory error for an allocation the tracker refused."""
    match = _EMULATED.search(emulated)
    n, capacity = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    free = max(0, capacity - current)
    return (f"CUDA out of memory. Tried to allocate {format_bytes(n)}. GPU 0 has a total capacity of "
            f"{format_bytes(capacity)} of which {format_bytes(free)} is free. (emulated by the autotune "
            f"benchmark on the CPU)")


class CudaLikeTracker(LiveStorageTracker):
    """The live-storage tracker, whose emulated OOM reads like a CUDA one."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self._cuda_like():
            return super().__torch_dispatch__(func, types, args, kwargs)

    def register(self, tensors, category=None):
        with self._cuda_like():
            super().register(tensors, category)

    @contextlib.contextmanager
    def _cuda_like(self):
        try:
            yield
        except torch.OutOfMemoryError as exc:
            if "emulated capacity exceeded" not in str(exc):
                raise
            message = cuda_oom_message(str(exc), self.current_bytes)
        else:
            return
        # Raised outside the except block: no chained traceback holding the dead frames' tensors.
        raise torch.OutOfMemoryError(message)


@dataclass
class PeerResult:
    found: int | None
    trials: list[tuple[int, bool]] = field(default_factory=list)  # (batch, fitted) per attempt
    optimizer_steps: int = 0
    seconds: float = 0.0
    raw: int | None = None  # Lightning: the largest size that ran, before its 5% margin
    error: str | None = None

    @property
    def ooms(self) -> int:
        return sum(1 for _, ok in self.trials if not ok)


def _counted(workload: Workload, counter: list[int]) -> Workload:
    """The workload with every optimizer step counted."""
    factory = workload.optimizer

    def optimizer(params):
        opt = factory(params)
        opt.register_step_post_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
        return opt

    return replace(workload, optimizer=optimizer)


# -- Accelerate ----------------------------------------------------------------------------


def run_accelerate(workload: Workload, usable: int) -> PeerResult:
    """``accelerate.utils.find_executable_batch_size`` with its defaults (starts at 128).

    The decorated function runs the fit rule (2 optimizer steps x 2 micro-steps)
    at the size it is given, on the CPU, under the tracker capped at ``usable``.
    """
    from accelerate.utils import find_executable_batch_size

    steps = [0]
    work_load = _counted(workload, steps)
    result = PeerResult(found=None)

    @find_executable_batch_size
    def train(batch_size: int) -> int:
        tracker = CudaLikeTracker(capacity=usable)
        session = Session(tracker, move=lambda t: t.clone(), move_model=lambda m: m)
        try:
            timed_measure(tracker, session, fit_rule_work(work_load, batch_size))
        except BaseException:
            result.trials.append((batch_size, False))
            raise
        result.trials.append((batch_size, True))
        return batch_size

    start = time.perf_counter()
    try:
        result.found = train()
    except RuntimeError as exc:  # "No executable batch size found, reached zero."
        result.error = str(exc)
    result.seconds = time.perf_counter() - start
    result.optimizer_steps = steps[0]
    gc.collect()
    return result


# -- Lightning -----------------------------------------------------------------------------

_ACTIVE: dict[str, LiveStorageTracker | None] = {"tracker": None}


def _paused():
    tracker = _ACTIVE["tracker"]
    return tracker.paused() if tracker is not None else contextlib.nullcontext()


class _Batches(torch.utils.data.IterableDataset):
    """Endless micro-batches of one size, built on the host (not counted), like the fit rule's."""

    def __init__(self, workload: Workload, size: int):
        self.workload, self.size = workload, size

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        while True:
            with _paused():
                micro = self.workload.batch(self.size, generator)
            yield micro


def lightning_module(workload: Workload, steps: list[int]):
    import lightning.pytorch as pl

    class WorkloadModule(pl.LightningModule):
        """The workload as a LightningModule: its model, its loss, its optimizer."""

        def __init__(self):
            super().__init__()
            self.net = workload.model()
            self.batch_size = 2  # scale_batch_size sets it (its init_val, 2, by default)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_Batches(workload, self.batch_size), batch_size=None)

        def training_step(self, batch, batch_idx):
            # "Move to the device": a counted copy of the host batch, as the fit rule's session makes.
            micro = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)
            return workload.loss(self.net, micro)

        def configure_optimizers(self):
            opt = workload.optimizer(self.net.parameters())
            opt.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
            return opt

    return WorkloadModule()


def run_lightning(workload: Workload, usable: int) -> PeerResult:
    """``Tuner(trainer).scale_batch_size(model, mode="binsearch")``, other arguments at their defaults.

    The Trainer accumulates 2 micro-batches per optimizer step. Every trial of
    the tuner (its ``_try_loop_run``) runs under the tracker capped at ``usable``,
    with what the model already holds (parameters, buffers, gradients, optimizer
    state) counted from the start.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner
    from lightning.pytorch.tuner import batch_size_scaling as bss

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    steps = [0]
    result = PeerResult(found=None)
    module = lightning_module(workload, steps)
    original = bss._try_loop_run

    def tracked(trainer, params):
        lit = trainer.lightning_module
        tracker = CudaLikeTracker(capacity=usable)
        held = [*lit.parameters(), *lit.buffers(), *(p.grad for p in lit.parameters() if p.grad is not None)]
        for opt in trainer.optimizers:
            held += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        tracker.register(held)
        del held
        size = lit.batch_size
        _ACTIVE["tracker"] = tracker
        try:
            with tracker:
                original(trainer, params)
        except BaseException:
            result.trials.append((size, False))
            raise
        finally:
            _ACTIVE["tracker"] = None
        result.trials.append((size, True))

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=2, limit_train_batches=4,
                             max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=root)
        bss._try_loop_run = tracked
        try:
            result.found = Tuner(trainer).scale_batch_size(module, mode="binsearch")
        finally:
            bss._try_loop_run = original
    result.seconds = time.perf_counter() - start
    result.optimizer_steps = steps[0]
    ran = [b for b, ok in result.trials if ok]
    result.raw = max(ran) if ran else None
    del module, trainer
    gc.collect()
    return result
