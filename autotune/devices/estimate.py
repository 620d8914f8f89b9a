"""Estimates: the fit rule under ``FakeTensorMode``, no real compute, no real memory.

Every tensor is a fake tensor on the CPU device (its storage is on ``meta``), so
a whole training step of a billion-parameter model runs here in a second or so
and allocates nothing for weights or activations. The tracker counts what the
real device would hold.

Standing in for a CUDA device (``cuda_like``), every allocation is rounded up
to 512 bytes as CUDA's caching allocator does, optimizers left at
``foreach=None`` take the multi-tensor path CUDA would pick, and a stated
allowance for the CUDA context and library workspaces is taken off the budget.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from ..tracker import LiveStorageTracker
from ..units import format_bytes
from .base import Measurement, Session, T, _move_module, timed_measure

#: What a CUDA process holds outside PyTorch's allocator: the context, cuBLAS and
#: cuDNN handles and workspaces. Typical of torch 2.x with lazy module loading.
CUDA_CONTEXT_ALLOWANCE = 640 * 1024**2
CUDA_ROUNDING = 512


class EstimateDevice:
    """A device that exists only as an estimate (``estimated = True``)."""

    estimated = True

    def __init__(self, *, capacity: int, round_to: int = CUDA_ROUNDING, cuda_like: bool = True,
                 allowance: int = 0, name: str = "estimate"):
        if capacity - allowance <= 0:
            raise ValueError(
                f"memory budget {format_bytes(capacity)} leaves nothing after the "
                f"{format_bytes(allowance)} allowance for the CUDA context"
            )
        self.name = name
        self.budget = capacity
        self.allowance = allowance
        self.round_to = round_to
        self.cuda_like = cuda_like

    @classmethod
    def for_gpu(cls, budget: int) -> EstimateDevice:
        """The ``estimate`` device of the CLI: a CUDA GPU with ``budget`` bytes of memory."""
        return cls(capacity=budget, round_to=CUDA_ROUNDING, cuda_like=True, allowance=CUDA_CONTEXT_ALLOWANCE)

    def capacity_bytes(self) -> int:
        return self.budget - self.allowance

    def measure(self, work: Callable[[Session], T], *, enforce_capacity: bool = False) -> tuple[T, Measurement]:
        # Estimates never emulate an OOM: they measure the whole step and compare.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        tracker = LiveStorageTracker(round_to=self.round_to, fake_scalars=True)

        def move(t: torch.Tensor) -> torch.Tensor:
            # A copy, as moving to a real device makes: a view of a host dataset
            # then counts as its own elements, not as the whole dataset.
            return (t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t)).clone()

        def move_model(model):
            return _move_module(model, lambda t: t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t))

        def build_batch(make: Callable[[], Any]) -> Any:
            # Try building the batch as fake tensors (no memory); a batch whose
            # shapes depend on its values is built for real and then faked.
            with tracker.paused():
                tracker.fake_scalars = False
                try:
                    return make()
                except Exception:
                    with unset_fake_temporarily():
                        return make()
                finally:
                    tracker.fake_scalars = True

        session = Session(tracker, move=move, move_model=move_model, build_batch=build_batch,
                          cuda_like=self.cuda_like)
        with fake_mode:
            return timed_measure(tracker, session, work)

    def cleanup(self) -> None:
        gc.collect()

    def estimator(self) -> EstimateDevice:
        return self

    def describe(self) -> dict[str, Any]:
        lines = [f"estimate for a {'CUDA GPU' if self.cuda_like else 'device'} with {format_bytes(self.budget)}"]
        if self.allowance:
            lines.append(f"{format_bytes(self.allowance)} allowed for the CUDA context and library workspaces")
        if self.round_to > 1:
            lines.append(f"allocations rounded up to {self.round_to} bytes")
        lines.append("not confirmed on a real device")
        return {
            "name": self.name,
            "kind": "estimate",
            "estimated": True,
            "budget_bytes": self.budget,
            "allowance_bytes": self.allowance,
            "capacity_bytes": self.capacity_bytes(),
            "round_to": self.round_to,
            "cuda_like": self.cuda_like,
            "measured_by": "live tensor-storage bytes under FakeTensorMode (no real compute)",
            "summary": "; ".join(lines),
            "torch": torch.__version__,
        }
