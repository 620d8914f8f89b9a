"""A small model the compile tests (tests/devices/test_compiled.py, tests/probing/test_probe.py) compile: a class
of its own, so no other test's compiled forward is shared with theirs."""

from __future__ import annotations

import torch
from torch import nn

from autotune.workload import Workload


class Net(nn.Module):  # a class of this module's own: no other test compiles its forward
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).sin() * 2)


def compiled_net() -> nn.Module:
    """``Net`` compiled by Inductor with a dynamic batch size: one compile serves every micro-batch a probe tries
    (no recompile at its second size), and the two tests that compile it reuse one compiled program (Inductor's FX
    graph cache holds it for the second): the C++ is built once per run of the suite."""
    return torch.compile(Net(), dynamic=True)


def workload(make_model) -> Workload:
    return Workload(name="compiled-net", model=make_model,
                    batch=lambda n, g: (torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)),
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
