"""autotune.devices.oom.is_oom: out-of-memory and nothing else."""

from __future__ import annotations

import pytest
import torch

from autotune.devices.oom import OOM_MESSAGES, is_oom
from autotune.devices.tracker import LiveStorageTracker


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_backend_messages_in_a_runtime_error_are_oom(message):
    assert is_oom(RuntimeError(message))
    # As the backends print them: the phrase inside a longer message.
    assert is_oom(RuntimeError(f"[enforce fail at somewhere.cpp:42] {message}. Tried to allocate 2.00 GiB"))


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
