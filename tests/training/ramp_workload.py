"""A workload whose noise scale is known and grows as training goes on, the ramp settings that follow it within a
few steps, and the plan a ramp starts from: the ramped runs of the runner's and the report's tests."""

from __future__ import annotations

import torch
from torch import nn

import autotune
from autotune.planning.planner import make_plan
from autotune.workload import Workload

D = 8
FAST = autotune.RampConfig(min_steps=3, window=10)


def regression(noise: float) -> Workload:
    """y = x.w* + noise eps from a model far away (w = 3): the noise scale D + 1 + (D + 1) |w - w*|^2 ... grows
    as the model closes in; with a large noise it is far above the start at once."""

    def model() -> nn.Module:
        m = nn.Linear(D, 1, bias=False)
        nn.init.constant_(m.weight, 3.0)
        return m

    def batch(n: int, g: torch.Generator):
        x = torch.randn(n, D, generator=g)
        return x, noise * torch.randn(n, generator=g)

    return Workload(name="regression", model=model, batch=batch,
                    loss=lambda m, b: 0.5 * (m(b[0]).squeeze(-1) - b[1]).pow(2).mean(),
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05))


PLAN = make_plan(60, 8)  # 60 = 4 x 7 + 4 x 8 over 8 steps x 1 rank; the ramp starts at 9
