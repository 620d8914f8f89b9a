"""autotune.devices.oom.is_oom: out-of-memory and nothing else."""

from __future__ import annotations

import pytest
import torch

from autotune.devices.oom import is_oom
from autotune.devices.tracker import LiveStorageTracker

#: What each backend raises, as a plain RuntimeError, when an allocation fails: (device type, the message as
#: PyTorch, cuBLAS, cuDNN or ROCm print it). Written out here, not read from autotune's table: a phrase missing
#: from that table, or mistyped there, is an out-of-memory error the probe would take for the user's own bug.
BACKENDS = [
    ("cuda", "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
             "1.06 GiB is free. Of the allocated memory 75.31 GiB is allocated by PyTorch"),
    ("cuda", "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, "
             "so the stacktrace below might be incorrect."),
    ("cuda", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ("cuda", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous "
             "input."),
    ("cuda", "HIP out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 63.98 GiB of which 0 "
             "bytes is free."),
    ("cuda", "HIP error: hipErrorOutOfMemory"),
    ("mps", "MPS backend out of memory (MPS allocated: 17.79 GB, other allocations: 40.00 KB, max allowed: 18.13 "
            "GB). Tried to allocate 512.00 MB on private pool."),
    ("xpu", "XPU out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 15.11 GiB of which "
            "0 bytes is free."),
    ("cpu", "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"),
    ("cpu", "DefaultCPUAllocator: not enough memory: you tried to allocate 8589934592 bytes."),  # Windows
]


@pytest.mark.parametrize(("device", "message"), BACKENDS, ids=[f"{d}-{m[:24]}" for d, m in BACKENDS])
def test_each_backends_own_out_of_memory_error_is_oom(device, message):
    assert is_oom(RuntimeError(message))
    assert is_oom(RuntimeError(message), device)
    other = "cpu" if device != "cpu" else "cuda"
    assert not is_oom(RuntimeError(message), other)  # another device's words: the user's own error there


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("anything at all"), True),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (MemoryError(), False),  # Python's own objects, not a device allocator
        (ValueError("CUDA out of memory"), False),  # right words, wrong type: not from an allocator
        (KeyError("CUDA out of memory"), False),
        (TypeError("out of memory"), False),
        (RuntimeError("shape mismatch: mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (RuntimeError("out of memory"), False),  # no backend says exactly this
        (RuntimeError(""), False),
        (KeyError("x"), False),
        (KeyboardInterrupt(), False),
    ],
)
def test_is_oom_table(exc, expected):
    assert is_oom(exc) is expected


@pytest.mark.parametrize(("message", "device", "expected"), [
    ("CUDA out of memory. Tried to allocate 2.00 GiB", "cuda", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", "cpu", False),  # a user's own check on the CPU
    ("HIP out of memory", "cuda", True),  # ROCm GPUs are "cuda" devices
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes", "cpu", True),
    ("DefaultCPUAllocator: can't allocate memory", "cuda", False),
    ("CUDA out of memory", "meta", False),  # estimates never run out
])
def test_only_the_devices_own_messages_count(message, device, expected):
    assert is_oom(RuntimeError(message), device) is expected
    assert is_oom(torch.OutOfMemoryError(message), device)  # the type always counts


def test_a_real_cpu_allocation_failure_is_oom():
    # 1 PiB: more than any address space; the CPU allocator raises a plain RuntimeError.
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_oom(info.value), str(info.value)
    assert is_oom(info.value, "cpu") and not is_oom(info.value, "cuda")


def test_the_trackers_emulated_oom_is_oom():
    with pytest.raises(torch.OutOfMemoryError) as info, LiveStorageTracker(capacity=100):
        torch.ones(1000)
    assert is_oom(info.value)
