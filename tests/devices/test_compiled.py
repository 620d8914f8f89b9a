"""torch.compile: found in the work, run compiled on a real device, said of in an estimate.

A real CPU run of a compiled model runs compiled (dynamo's counters show the
frame it compiled) and its peak is the CPU allocator's own count; an estimate
measures the eager program and says by how much the compiled run may differ.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from torch import nn

from autotune.compat import compiled_function, dynamo_counters
from autotune.devices import CpuDevice, get_device
from autotune.devices.compiled import AllocatorCount, compiled_parts
from autotune.probing.fitrule import fit_rule_work
from autotune.units import format_bytes

from .compiled_net import Net, compiled_net, workload

MiB = 2**20


def test_compiled_modules_and_functions_are_found():
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert compiled_parts(plain) == []
    assert compiled_parts(torch.compile(Net())) == ["the model"]
    in_place = Net()
    in_place.compile()
    assert compiled_parts(in_place) == ["the model"]
    inner = nn.Sequential(torch.compile(nn.Linear(2, 2)), nn.ReLU())
    assert compiled_parts(inner) == ["0"]
    assert compiled_function(torch.compile(lambda x: x + 1)) and not compiled_function(lambda x: x + 1)


def test_the_allocator_count_sees_what_is_allocated_outside_any_op():
    count = AllocatorCount()
    count.start(base=5)
    a = torch.empty(MiB, dtype=torch.uint8)
    b = torch.empty(2 * MiB, dtype=torch.uint8)
    del a
    c = torch.empty(MiB, dtype=torch.uint8)
    count.stop()
    assert count.peak == 5 + 3 * MiB  # a and b together; c came after a was freed
    del b, c


def counting_backend(calls: list[int]):
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        calls.append(1)
        return gm.forward

    return backend


def test_an_estimate_runs_the_eager_program_and_a_real_run_after_it_still_compiles():
    torch._dynamo.reset()
    calls: list[int] = []
    compiled = workload(lambda: torch.compile(Net(), backend=counting_backend(calls)))
    _, est = get_device("estimate:A10G-24GB").measure(fit_rule_work(compiled, 8))
    assert calls == []  # the estimate ran the eager program: nothing compiled
    (note,) = [n for n in est.notes if "is compiled" in n]
    activations = est.breakdown["activations"]
    assert note.startswith("the model is compiled (torch.compile): estimated as its eager program")
    assert activations and f"activations and temporaries at the peak, {format_bytes(activations)} of " in note
    _, real = CpuDevice(memory_budget=2**30).measure(fit_rule_work(compiled, 8))
    assert calls  # dynamo compiled the frame the estimate ran eagerly: no skip was left behind
    assert any(n.startswith("the model ran compiled (torch.compile)") for n in real.notes), real.notes
    _, eager = CpuDevice(memory_budget=2**30).measure(fit_rule_work(workload(Net), 8))
    assert real.peak_bytes >= eager.peak_bytes == eager.tracked_peak_bytes  # the allocator also counts the host batch
    assert not any("compiled" in n for n in eager.notes)


def test_a_compiled_loss_is_found_too():
    torch._dynamo.reset()
    calls: list[int] = []
    plain = workload(Net)
    compiled = dataclasses.replace(plain, loss=torch.compile(plain.loss, backend=counting_backend(calls)))
    _, est = get_device("estimate:A10G-24GB").measure(fit_rule_work(compiled, 8))
    assert calls == [] and any(n.startswith("the loss is compiled (torch.compile)") for n in est.notes), est.notes
    _, real = CpuDevice(memory_budget=2**30).measure(fit_rule_work(compiled, 8))
    assert calls and any(n.startswith("the loss ran compiled (torch.compile)") for n in real.notes), real.notes


@pytest.mark.slow  # Inductor compiles C++ for the CPU: tens of seconds to minutes on a loaded 2-core machine
@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                    reason="Inductor on the CPU needs a C++ compiler (gcc): none on PATH")
def test_a_compiled_model_runs_compiled_on_the_cpu_and_the_eager_estimate_states_its_bound():
    torch._dynamo.reset()
    compiled = workload(compiled_net)
    _, est = CpuDevice(memory_budget=2**30).estimator().measure(fit_rule_work(compiled, 64))
    before = dynamo_counters().get("frames", {}).get("ok", 0)
    _, real = CpuDevice(memory_budget=2**30).measure(fit_rule_work(compiled, 64))
    assert dynamo_counters()["frames"]["ok"] > before  # Inductor compiled it: the real run ran compiled
    assert any(n.startswith("the model ran compiled (torch.compile)") for n in real.notes), real.notes
    # the stated fallback: the compiled run differs from the eager estimate by at most its activations at the peak
    assert abs(real.peak_bytes - est.peak_bytes) <= est.breakdown["activations"]
    again = dataclasses.replace(compiled, name="again")
    _, second = CpuDevice(memory_budget=2**30).measure(fit_rule_work(again, 64))
    # compiled code is reused; the count repeats to within a few scalars (8-byte allocations outside the step's
    # tensors come and go between runs)
    assert abs(second.peak_bytes - real.peak_bytes) <= 64
    assert real.peak_bytes > real.tracked_peak_bytes  # Inductor's own buffers: the tracker does not see them
