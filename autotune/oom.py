"""One place that decides whether an exception means "out of memory"."""

from __future__ import annotations

import torch

# Messages the backends raise for an allocation that failed, as plain RuntimeErrors.
OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's way of saying its workspace did not fit
    "HIP out of memory",
    "hipErrorOutOfMemory",
    "MPS backend out of memory",
    "XPU out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` says a device ran out of memory, and for nothing else."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(text in message for text in OOM_MESSAGES)
    return False
