"""One place that decides whether an exception means "out of memory" on a device."""

from __future__ import annotations

import torch

# What each backend's allocator raises, as a plain RuntimeError, when an allocation fails.
BACKEND_MESSAGES: dict[str, tuple[str, ...]] = {
    "cuda": (
        "CUDA out of memory",
        "CUDA error: out of memory",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's way of saying its workspace did not fit
        "HIP out of memory",  # ROCm builds report their GPUs as "cuda" devices
        "hipErrorOutOfMemory",
    ),
    "mps": ("MPS backend out of memory",),
    "xpu": ("XPU out of memory",),
    "cpu": ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory"),
}
OOM_MESSAGES = tuple(m for messages in BACKEND_MESSAGES.values() for m in messages)


def is_oom(exc: BaseException, device: str | None = None) -> bool:
    """True when ``exc`` says a device ran out of memory, and for nothing else.

    ``device`` is the device type the work ran on ("cpu", "cuda", ...): then only
    that backend's own messages count, so a user's ``RuntimeError("CUDA out of
    memory")`` raised on the CPU is the user's error, not a full device. With
    None, any backend's message counts. ``torch.OutOfMemoryError`` always counts;
    Python's ``MemoryError`` (host objects, not a device allocator) never does.
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    messages = OOM_MESSAGES if device is None else BACKEND_MESSAGES.get(device, ())
    text = str(exc)
    return any(m in text for m in messages)
