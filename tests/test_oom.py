"""autotune.oom.is_oom: out-of-memory and nothing else."""

from __future__ import annotations

import pytest
import torch

from autotune.oom import OOM_MESSAGES, is_oom
from autotune.tracker import LiveStorageTracker


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
        (MemoryError(), True),
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


def test_a_real_cpu_allocation_failure_is_oom():
    # 1 PiB: more than any address space; the CPU allocator raises a plain RuntimeError.
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_oom(info.value), str(info.value)


def test_the_trackers_emulated_oom_is_oom():
    with pytest.raises(torch.OutOfMemoryError) as info, LiveStorageTracker(capacity=100):
        torch.ones(1000)
    assert is_oom(info.value)
