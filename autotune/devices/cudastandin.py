"""The CUDA GPU an estimate stands in for, as the user's code sees it.

People write their training step for CUDA: ``torch.cuda.is_available()`` picks the device, tensors are made
with ``device="cuda"`` or moved with ``.cuda()`` and ``.to("cuda")``, the loss runs under
``torch.autocast("cuda", ...)``, the optimizer is ``fused=True``. While an estimate stands in for a CUDA GPU
(the session installs what is here, :func:`autotune.devices.session.cuda_stand_in`, and takes it all back):

- :class:`GpuAnswers`: ``torch.cuda.is_available()``, ``device_count``, ``current_device``,
  ``get_device_properties``, ``get_device_capability``, ``get_device_name``, ``is_bf16_supported``,
  ``mem_get_info`` answer for the GPU planned (a preset's, or the budget's); with a real GPU planned for,
  torch answers itself;
- :class:`CudaDevices`: ``"cuda"`` devices (``device=`` of any call, ``.cuda()``, ``.to("cuda")``,
  ``Module.to``/``cuda``) land on the estimate's device; pinning host memory is a no-op (it holds no device
  memory, and pinning needs CUDA);
- the optimizers count the estimate's device among those with fused, foreach and capturable kernels (where
  CUDA is among them), so ``fused=True`` and ``capturable=True`` run, and ``foreach=None`` takes the
  multi-tensor path as on CUDA;
- ``torch.autocast("cuda")`` applies CUDA's cast policy (:mod:`autotune.devices.cudaamp`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..units import format_bytes

_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))


def user_frame(depth: int) -> str | None:
    """``file:line`` of the frame ``depth`` calls above the caller, when it is the user's code (not autotune's,
    torch's or an installed package's)."""
    frame = sys._getframe(depth + 1)
    name = frame.f_code.co_filename
    if name.startswith(_OURS) or name.startswith("<") or os.sep + "lib" + os.sep + "python3" in name:
        return None
    return f"{name}:{frame.f_lineno}"


@dataclass
class GpuAnswers:
    """What ``torch.cuda`` answers about the GPU planned for; ``asked``: who asked what (``file:line``)."""

    name: str
    capability: tuple[int, int]
    total_bytes: int
    free_bytes: int
    asked: dict[str, list[str]] = field(default_factory=dict)

    def _ask(self, what: str) -> None:
        where = user_frame(2)  # the caller of the torch.cuda function
        if where is not None:
            self.asked.setdefault(what, [])
            if where not in self.asked[what]:
                self.asked[what].append(where)

    def functions(self) -> dict[str, Any]:
        """The ``torch.cuda`` functions that answer for this GPU, by name."""
        def is_available() -> bool:
            self._ask("is_available")
            return True

        def properties(device: Any = None) -> Any:
            self._ask("get_device_properties")
            return SimpleNamespace(name=self.name, major=self.capability[0], minor=self.capability[1],
                                   total_memory=self.total_bytes, is_integrated=False, is_multi_gpu_board=False)

        def capability(device: Any = None) -> tuple[int, int]:
            self._ask("get_device_capability")
            return self.capability

        def bf16(including_emulation: bool = True) -> bool:
            return self.capability >= (8, 0) or including_emulation

        return {"is_available": is_available, "device_count": lambda: 1, "current_device": lambda: 0,
                "get_device_properties": properties, "get_device_capability": capability,
                "get_device_name": lambda device=None: self.name, "is_bf16_supported": bf16,
                "mem_get_info": lambda device=None: (self.free_bytes, self.total_bytes),
                "set_device": lambda device=None: None, "synchronize": lambda device=None: None,
                "get_rng_state": _rng_state, "set_rng_state": _nothing(), "get_rng_state_all": lambda: [_rng_state()],
                "set_rng_state_all": _nothing(), "reset_peak_memory_stats": _nothing(),
                "reset_max_memory_allocated": _nothing(), "reset_accumulated_memory_stats": _nothing(),
                "current_stream": lambda device=None: STREAM, "default_stream": lambda device=None: STREAM,
                "is_current_stream_capturing": lambda: False}

    @staticmethod
    def accelerator_functions() -> dict[str, Any]:
        """The ``torch.accelerator`` functions that reach the CUDA driver: on a CUDA build of torch without a GPU
        (pip's default) they would fail where the code asks them (the optimizers' graph-capture check asks for
        the current stream once ``torch.cuda.is_available()`` is true)."""
        return {"current_device_index": lambda: 0, "current_stream": lambda device=None: STREAM,
                "set_device_index": _nothing(), "synchronize": _nothing()}

    def describe(self) -> str:
        return (f"{self.name}, compute capability {self.capability[0]}.{self.capability[1]}, "
                f"{format_bytes(self.total_bytes)}")


def _rng_state(device: Any = "cuda") -> torch.Tensor:
    """The GPU's random state as torch.cuda gives it (no values: the estimate draws no random numbers)."""
    return torch.zeros(16, dtype=torch.uint8)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _nothing() -> Any:
    """A function of its own that does nothing: each torch function stood in for is a distinct object
    (torch.compile's rules refuse one object standing for several torch functions)."""
    return lambda *args, **kwargs: None


class _Stream:
    """The GPU's current stream as the user's code sees it: the default stream, never capturing a graph."""

    device_index, device_type, stream_id, cuda_stream = 0, "cuda", 0, 0
    device = torch.device("cuda", 0)

    def is_capturing(self) -> bool:
        return False

    def query(self) -> bool:
        return True

    synchronize = wait_stream = wait_event = record_event = _no_op


STREAM = _Stream()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # an index: a CUDA device


class CudaDevices(TorchFunctionMode):
    """``"cuda"`` devices in any torch call land on ``device`` (the estimate's), or on the host while a batch
    is built (:meth:`on_host`); ``to_cpu``: where the user's code moved a tensor of the estimate's device to
    the CPU (code that chose the CPU where a GPU runs it on CUDA), as ``file:line``."""

    def __init__(self, device: torch.device, to_cpu: list[str] | None = None):
        super().__init__()
        self.device = device
        self.to_cpu: list[str] = [] if to_cpu is None else to_cpu

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        device, self.device = self.device, torch.device("cpu")
        try:
            yield
        finally:
            self.device = device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": self._target(args[0]) if func is torch.Tensor.to else self.device}
        if kwargs.get("pin_memory"):  # page-locked host memory: no device memory, and no CUDA here to lock it
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cuda:  # .cuda(device=None, non_blocking=False, memory_format=...)
            rest = {k: v for k, v in kwargs.items() if k != "device"}
            return torch.Tensor.to(args[0], self._target(args[0]), **rest)
        if func is torch.Tensor.to:
            args = self._to(args, kwargs)
        elif func is torch.Tensor.cpu:
            self._to_cpu(args[0], "cpu", depth=2)
        return func(*args, **kwargs)

    def device_type_of(self, original: Any) -> Any:
        """``original`` (a function giving the device type of its tensor arguments), saying ``"cuda"`` for the
        estimate's device: activation checkpointing then saves and restores CUDA's autocast state."""
        device = self.device.type

        def device_type(*args: Any) -> str:
            found = original(*args)
            return "cuda" if found == device else found

        device_type.original = original  # type: ignore[attr-defined]
        return device_type

    def _target(self, tensor: Any) -> torch.device:
        """Where a move to CUDA puts ``tensor``: a shape-only tensor (a model built on ``meta``) stays one."""
        return tensor.device if isinstance(tensor, torch.Tensor) and tensor.is_meta else self.device

    def _to(self, args: tuple, kwargs: dict) -> tuple:
        if len(args) > 1 and _is_cuda(args[1]):
            return (args[0], self._target(args[0]), *args[2:])
        self._to_cpu(args[0], args[1] if len(args) > 1 else kwargs.get("device"), depth=3)
        return args

    def _to_cpu(self, tensor: Any, target: Any, depth: int) -> None:
        """Note where the user's code (``depth`` calls up) moves a tensor of the estimate's device to the CPU."""
        if self.device.type != "cpu" and isinstance(tensor, torch.Tensor) and tensor.device == self.device and \
                isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            where = user_frame(depth)
            if where is not None and where not in self.to_cpu:
                self.to_cpu.append(where)


class DeviceLists:
    """The optimizers' device lists, with the estimate's device among them wherever the device it stands in for
    (``beside``: CUDA, or the CPU for an estimate of the CPU) is."""

    def __init__(self, device: torch.device, beside: str = "cuda"):
        self.device = device.type
        self.beside = beside

    def wrap(self, original: Any) -> Any:
        device, beside = self.device, self.beside

        def devices(*args: Any, **kwargs: Any) -> list[str]:
            found = original(*args, **kwargs)
            return _WithDevice(found, device, beside) if beside in found else found

        devices.original = original  # type: ignore[attr-defined]
        return devices


class _WithDevice(list):
    """A device list holding the estimate's device beside ``beside`` (``cuda`` or ``cpu``), and dropping it with
    it."""

    def __init__(self, items: list[str], device: str, beside: str):
        super().__init__(items)
        if device not in self:
            self.append(device)
        self._device, self._beside = device, beside

    def remove(self, value: str) -> None:
        super().remove(value)
        if value == self._beside and self._device in self:
            super().remove(self._device)


class StandIn:
    """The parts of one estimate's CUDA stand-in, made for the estimate's ``device``, and what they saw."""

    def __init__(self, device: torch.device, answers: GpuAnswers | None, to_cpu: list[str] | None = None):
        from .cudaamp import CudaAutocast

        self.answers = answers
        self.devices = CudaDevices(device, to_cpu)  # ``to_cpu``: shared by an estimate's measurements
        self.amp = CudaAutocast(device.type)
        self.lists = DeviceLists(device)

    def installed(self) -> Any:
        from .session import cuda_stand_in

        return cuda_stand_in(self.devices, self.answers, self.amp, self.lists)

    def notes(self) -> tuple[str, ...]:
        """What the user's code was told and which dtype policy applied, in words."""
        notes = []
        if self.amp.counts:
            dtypes = ", ".join(sorted(str(d).replace("torch.", "") for d in self.amp.dtypes)) or "float32 only"
            runs = ", ".join(f"{n} {policy}" for policy, n in sorted(self.amp.counts.items()))
            notes.append(f"autocast('cuda', {dtypes}): CUDA's cast policy applied op by op ({runs}), parameters "
                         "cast once per autocast region")
        if self.answers is not None and self.answers.asked:
            asked = "; ".join(f"{what} at {', '.join(where[:5])}" for what, where in self.answers.asked.items())
            notes.append(f"torch.cuda answered as the GPU planned ({self.answers.describe()}): {asked}")
        if self.devices.to_cpu:
            notes.append("your code moved a device tensor to the CPU at " + ", ".join(self.devices.to_cpu[:3]) +
                         ": a device chosen before the estimate began (torch.cuda.is_available() is False when "
                         "the probe file is imported here, True on the GPU) differs from what the GPU runs; "
                         "choose it inside build() or the model, or use 'cuda'")
        return tuple(notes)
