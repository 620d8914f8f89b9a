"""Estimates: the fit rule on fake tensors, no real compute, no real memory.

Nothing real is allocated for weights or activations, so a whole training step
of a billion-parameter model is estimated here in under a second; the tracker
counts what the real device would hold. Two engines run the fit rule:

- ``meta`` (the default): every tensor lives on the ``meta`` device, ops run
  through memoised meta kernels (:mod:`autotune.devices.meta`), and composite
  ops choose their kernels as on the CPU. Several times faster.
- ``fake``: every tensor is a ``FakeTensorMode`` fake on the CPU device (its
  storage on ``meta``), which behaves as a CPU tensor throughout. A workload the
  meta engine cannot run (a recurrent layer, CPU autocast, code that insists
  on a CPU tensor) falls back to it, once, and stays there; the description
  says why. ``AUTOTUNE_ESTIMATE_ENGINE=fake`` makes it the default.

Standing in for a CUDA device (``cuda_like``), every allocation is rounded up
to 512 bytes as CUDA's caching allocator does, optimizers left at
``foreach=None`` take the multi-tensor path CUDA would pick, and a stated
allowance for the CUDA context and library workspaces is taken off the budget.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from ..errors import BadInput
from ..results.device import DeviceInfo
from ..units import format_bytes
from .base import Measurement, Session, T, _move_module, timed_measure
from .meta import CpuKernelChoices, MetaKernels
from .quiet import quiet_torch_logs
from .tracker import LiveStorageTracker

#: What a CUDA process holds outside PyTorch's allocator: the context, cuBLAS and
#: cuDNN handles and workspaces. Typical of torch 2.x with lazy module loading.
CUDA_CONTEXT_ALLOWANCE = 640 * 1024**2
CUDA_ROUNDING = 512
ENGINES = ("meta", "fake")
ENGINE_VARIABLE = "AUTOTUNE_ESTIMATE_ENGINE"
_MEASURED_BY = {
    "meta": "live tensor-storage bytes of meta tensors (no real compute)",
    "fake": "live tensor-storage bytes under FakeTensorMode (no real compute)",
}


class EstimateDevice:
    """A device that exists only as an estimate (``estimated = True``)."""

    estimated = True

    torch_device = torch.device("meta")  # where the work's tensors live; no allocator can run out

    def __init__(self, *, capacity: int, round_to: int = CUDA_ROUNDING, cuda_like: bool = True,
                 allowance: int = 0, name: str = "estimate", engine: str | None = None, guess: int = 0):
        if capacity - allowance <= 0:
            raise ValueError(
                f"memory budget {format_bytes(capacity)} leaves nothing after the "
                f"{format_bytes(allowance)} allowance for the CUDA context"
            )
        engine = default_engine() if engine is None else engine
        if engine not in ENGINES:
            raise BadInput(f"unknown estimate engine {engine!r}; use one of {', '.join(ENGINES)}")
        self.name = name
        self.budget = capacity
        self.allowance = allowance
        self.round_to = round_to
        self.cuda_like = cuda_like
        self.engine = engine
        self.fallback: str | None = None  # why the meta engine gave way to FakeTensorMode
        self.guess = guess  # which answers unknown values get (see LiveStorageTracker)
        self._kernels = MetaKernels()

    def with_other_guesses(self) -> EstimateDevice:
        """This estimate, answering every value it cannot know differently: when a run's peak
        changes with the answers, the values decide shapes and the estimate cannot be trusted."""
        other = EstimateDevice(capacity=self.budget, round_to=self.round_to, cuda_like=self.cuda_like,
                               allowance=self.allowance, name=self.name, engine=self.engine, guess=1 - self.guess)
        other.fallback = self.fallback
        return other

    @classmethod
    def for_gpu(cls, budget: int, engine: str | None = None) -> EstimateDevice:
        """The ``estimate`` device of the CLI: a CUDA GPU with ``budget`` bytes of memory."""
        return cls(capacity=budget, round_to=CUDA_ROUNDING, cuda_like=True, allowance=CUDA_CONTEXT_ALLOWANCE,
                   engine=engine)

    def capacity_bytes(self) -> int:
        return self.budget - self.allowance

    @quiet_torch_logs
    def measure(self, work: Callable[[Session], T], *, enforce_capacity: bool = False) -> tuple[T, Measurement]:
        # Estimates never emulate an OOM: they measure the whole step and compare.
        if self.engine == "meta":
            try:
                return self._measure_meta(work)
            except Exception as exc:  # the meta engine cannot run this workload: FakeTensorMode can
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                del exc
            result = self._measure_fake(work)  # the workload's own error, if it fails here too
            self.engine, self.fallback = "fake", reason
            return result
        return self._measure_fake(work)

    def _measure_meta(self, work: Callable[[Session], T]) -> tuple[T, Measurement]:
        tracker = LiveStorageTracker(round_to=self.round_to, fake_scalars=True, kernel=self._kernels,
                                     guess=self.guess)

        def build_model(factory: Callable[[], Any]) -> Any:
            with torch.device("meta"):
                return factory()

        def build_batch(make: Callable[[], Any]) -> Any:
            with tracker.paused():
                return _build_fake(FakeTensorMode(allow_non_fake_inputs=True), make)

        def move_model(model: Any) -> Any:
            with tracker.paused():  # counted by the session, parameters first, as on a real device
                return _move_module(model, _on_meta)

        session = Session(tracker, move=_meta_copy, move_model=move_model,
                          build_model=build_model, build_batch=build_batch, cuda_like=self.cuda_like)
        with CpuKernelChoices(tracker.paused):
            return timed_measure(tracker, session, work)

    def _measure_fake(self, work: Callable[[Session], T]) -> tuple[T, Measurement]:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        tracker = LiveStorageTracker(round_to=self.round_to, fake_scalars=True, guess=self.guess)

        def move(t: torch.Tensor) -> torch.Tensor:
            # A copy, as moving to a real device makes: a view of a host dataset
            # then counts as its own elements, not as the whole dataset.
            return (t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t)).clone()

        def build_model(factory: Callable[[], Any]) -> Any:
            # On meta, outside FakeTensorMode (deep copies and dtype changes of fake
            # parameters trip it); move_model then makes CPU fakes of them.
            try:
                with unset_fake_temporarily(), torch.device("meta"):
                    return factory()
            except Exception:
                return factory()

        def move_model(model: Any) -> Any:
            faked: dict[int, torch.Tensor] = {}  # one fake per tensor: shared buffers stay shared

            def fake(t: torch.Tensor) -> torch.Tensor:
                if isinstance(t, FakeTensor):
                    return t
                if not t.is_meta:
                    return fake_mode.from_tensor(t)
                if id(t) not in faked:
                    faked[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                return faked[id(t)]

            with tracker.paused():  # counted by the session, parameters first, as on a real device
                return _move_module(model, fake)

        def build_batch(make: Callable[[], Any]) -> Any:
            with tracker.paused():
                tracker.fake_scalars = False
                try:
                    return _build_fake(None, make)
                finally:
                    tracker.fake_scalars = True

        session = Session(tracker, move=move, move_model=move_model, build_model=build_model, build_batch=build_batch,
                          cuda_like=self.cuda_like)
        with fake_mode:
            return timed_measure(tracker, session, work)

    def cleanup(self) -> None:
        gc.collect()

    def estimator(self) -> EstimateDevice:
        return self

    def describe(self) -> DeviceInfo:
        lines = [f"estimate for a {'CUDA GPU' if self.cuda_like else 'device'} with {format_bytes(self.budget)}"]
        if self.allowance:
            lines.append(f"{format_bytes(self.allowance)} allowed for the CUDA context and library workspaces")
        if self.round_to > 1:
            lines.append(f"allocations rounded up to {self.round_to} bytes")
        lines.append("not confirmed on a real device")
        return DeviceInfo(
            name=self.name, kind="estimate", estimated=True, capacity_bytes=self.capacity_bytes(),
            capacity_source="memory budget" + (" less the CUDA context allowance" if self.allowance else ""),
            budget_bytes=self.budget, measured_by=_MEASURED_BY[self.engine], summary="; ".join(lines),
            torch=torch.__version__, allowance_bytes=self.allowance, round_to=self.round_to,
            cuda_like=self.cuda_like, engine=self.engine, engine_fallback=self.fallback,
        )


def default_engine() -> str:
    """``$AUTOTUNE_ESTIMATE_ENGINE`` (``meta`` or ``fake``), else ``meta``."""
    engine = os.environ.get(ENGINE_VARIABLE, "").strip() or "meta"
    if engine not in ENGINES:
        raise BadInput(f"{ENGINE_VARIABLE}={engine!r} is not an estimate engine; use one of {', '.join(ENGINES)}")
    return engine


def _build_fake(fake_mode: FakeTensorMode | None, make: Callable[[], Any]) -> Any:
    """Build a batch as fake tensors (no memory) in ``fake_mode`` (None: the active one);
    a batch whose shapes depend on its values is built for real instead."""
    try:
        if fake_mode is None:
            return make()
        with fake_mode:
            return make()
    except Exception:
        with unset_fake_temporarily():
            return make()


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else _meta_copy(t)


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as ``t.clone()`` would be: what a move to a device allocates."""
    if _dense(t.shape, t.stride()):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Do these strides cover exactly ``numel`` elements, none twice (in any dimension order)?"""
    expected = 1
    for size, step in sorted(zip(shape, stride), key=lambda p: p[1]):
        if size == 0:
            return True
        if size != 1:
            if step != expected:
                return False
            expected *= size
    return True
