"""Accelerate, for real on the CPU: the Accumulator with accelerator.backward on prepared objects.

Two processes: tests/integrations/test_ddp.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from autotune import Accumulator  # noqa: E402
from autotune.errors import BadInput  # noqa: E402
from autotune.integrations.accelerate import accumulator  # noqa: E402
from autotune.planning import make_plan  # noqa: E402
from autotune.training import MixedPrecision  # noqa: E402

from .tokens import MIXED, TokenNet, max_error, plan_loader, reference_parameters, sequences, token_loss, tokens  # noqa: E402

PLAN = make_plan(21, 4)  # 21 = 3 x 3 + 3 x 4 over 6 steps: uneven, each micro-batch weighted by its tokens


def prepared(accelerator: Accelerator, lr: float = 0.5):
    torch.manual_seed(0)
    model = TokenNet()
    return accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))


def test_the_accumulator_with_accelerators_backward_matches_full_batch_sgd():
    accelerator = Accelerator(cpu=True)
    model, optimizer = prepared(accelerator)
    calls: list[float] = []

    def backward(loss):
        calls.append(float(loss.detach()))
        accelerator.backward(loss)

    step = Accumulator(model, optimizer, PLAN, loss=token_loss, items=tokens, parts=[MixedPrecision(backward=backward)])
    data = sequences(MIXED)
    for batch in plan_loader(data, PLAN):
        step(batch)
    assert len(calls) == 2 * 6  # every micro-step went through the Accelerator
    assert max_error(model, reference_parameters(data, 21, steps=2)) < 1e-5


def test_the_accelerate_accumulator_clips_with_the_accelerator():
    accelerator = Accelerator(cpu=True)
    model, optimizer = prepared(accelerator)
    clipped: list[float] = []
    original = accelerator.clip_grad_norm_
    accelerator.clip_grad_norm_ = lambda params, value: clipped.append(value) or original(params, value)
    norms: list[float] = []
    optimizer.optimizer.register_step_pre_hook(lambda *_: norms.append(float(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters()])))))
    step = accumulator(accelerator, model, optimizer, PLAN, loss=token_loss, items=tokens, max_norm=1e-3)
    out = step.step(next(iter(plan_loader(sequences(MIXED), PLAN))))
    assert clipped == [1e-3] and norms == [pytest.approx(1e-3, rel=1e-4)] and out.grad_norm > 1e-3


def test_an_accelerator_that_accumulates_too_is_refused():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, optimizer = prepared(accelerator)
    with pytest.raises(BadInput, match=r"the Accelerator accumulates too \(gradient_accumulation_steps=4\): its "
                                       r"backward divides every loss by 4"):
        accumulator(accelerator, model, optimizer, PLAN, loss=token_loss)
