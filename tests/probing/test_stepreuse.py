"""An estimate probe's optimizer steps: evaluated once, made again at every other size, to the byte."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.devices import get_device
from autotune.probing.fitrule import isolate, run_trial
from autotune.probing.fsdp import Sharding
from autotune.probing.stepreuse import OptimizerSteps
from autotune.workload import Workload, load_workload

from .blockmodels import BIG
from .blockmodels import gpt_blocks as _gpt
from .blockmodels import llama_blocks as _llama

DEVICE = "estimate:H100-80GB"


def _same(a, b) -> None:
    """Two measurements of the fit rule alike to the byte: the trace, every peak, the breakdown, the timeline."""
    assert a.trace == b.trace
    assert (a.peak_bytes, a.allocated_peak_bytes, a.alloc_retries, a.tracked_peak_bytes) == \
        (b.peak_bytes, b.allocated_peak_bytes, b.alloc_retries, b.tracked_peak_bytes)
    assert a.breakdown == b.breakdown
    assert a.timeline == b.timeline


def _reused_and_full(workload: Workload, sizes: tuple[int, ...], sharding: Sharding | None = None):
    """Each size's estimate with the probe's optimizer steps reused (the first size records them), and each
    evaluated in full; the reuse."""
    workload = isolate(workload)
    estimate = get_device(DEVICE).estimator()
    steps = OptimizerSteps()
    pairs = []
    for batch in sizes:
        reused = run_trial(estimate, workload, batch, BIG, source="estimate", capacity_guard=False,
                           sharding=sharding, optimizer_steps=steps)
        full = run_trial(estimate, workload, batch, BIG, source="estimate", capacity_guard=False, sharding=sharding)
        pairs.append((reused.measurement, full.measurement))
    return pairs, steps


CASES = {
    "mlp": lambda: load_workload("mlp"),
    "convnet": lambda: load_workload("convnet"),
    "gpt": lambda: _gpt(),
    "gpt, checkpointing": lambda: _gpt(checkpointing=True),
    "llama": lambda: _llama(False),
}


@pytest.mark.parametrize("case", [c if c in ("mlp", "gpt") else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_a_reused_optimizer_step_gives_the_full_evaluation_to_the_byte(case):
    """The whole model evaluated; under FSDP and through block replay's cut models, see
    ``test_blockreplay.test_the_replayed_estimate_is_the_whole_models_to_the_byte``."""
    if case.startswith("llama"):
        pytest.importorskip("transformers")
    pairs, steps = _reused_and_full(CASES[case](), (3, 5))
    for reused, full in pairs:
        _same(reused, full)
    assert (steps.recorded, steps.replayed) == (2, 2)  # both steps recorded at 3, made again at 5


class _DropsGradients(torch.optim.SGD):
    """Frees the gradients inside its step (what it did not allocate)."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def _mlp(optimizer=None, model=None) -> Workload:
    base = load_workload("mlp")
    return Workload(name="mlp", model=model or base.make_model, batch=base.make_batch, loss=base.loss,
                    optimizer=optimizer or base.optimizer)


def test_a_step_that_frees_what_it_did_not_allocate_runs_at_every_size():
    optimizer = lambda params: _DropsGradients(params, lr=0.1, momentum=0.9)  # noqa: E731
    pairs, steps = _reused_and_full(_mlp(optimizer), (3, 5))
    assert (steps.recorded, steps.replayed) == (0, 0)
    for reused, full in pairs:
        _same(reused, full)


_KEPT: list[torch.Tensor] = []


class _KeepsAside(torch.optim.SGD):
    """Keeps a tensor of its own outside its state, which outlives it."""

    def step(self, closure=None):
        super().step(closure)
        _KEPT.append(torch.zeros_like(self.param_groups[0]["params"][0]))


def test_a_step_that_keeps_what_is_not_its_state_runs_at_every_size(monkeypatch):
    optimizer = lambda params: _KeepsAside(params, lr=0.1)  # noqa: E731
    pairs, steps = _reused_and_full(_mlp(optimizer), (3, 5))
    assert (steps.recorded, steps.replayed) == (0, 0)
    for reused, full in pairs:
        _same(reused, full)
    # planted: the check off, the kept tensor is made again as if it were state, and dies with the optimizer
    from autotune.probing import stepreuse

    monkeypatch.setattr(stepreuse, "_its_state", lambda kept: True)
    pairs, steps = _reused_and_full(_mlp(optimizer), (3, 5))
    assert steps.replayed == 2 and pairs[1][0].trace != pairs[1][1].trace
    _KEPT.clear()


class _LateLayer(nn.Module):
    """An MLP whose second layer takes part from its third forward on, at micro-batches over 4 only: its
    gradients (and what the optimizer step makes for them) change between the two optimizer steps there."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.late = nn.Linear(8, 8), nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = self.first(x)
        return self.late(x) if self.calls >= 3 and x.shape[0] > 4 else x


def test_a_step_that_differs_after_one_made_again_is_evaluated_again_in_full():
    workload = Workload(name="late", model=_LateLayer, batch=lambda n, g: torch.randn(n, 8, generator=g),
                        loss=lambda m, x: m(x).square().mean())
    pairs, steps = _reused_and_full(workload, (3, 5))
    for reused, full in pairs:
        _same(reused, full)
    assert steps.differed == 1  # at 5, the first step was made again, the second differed


def test_a_wrong_replay_is_caught_by_the_comparison(monkeypatch):
    """The comparison above sees a step made again one byte off (planted)."""
    from autotune.devices import tracker as tracking

    replay = tracking.LiveStorageTracker.replay

    def off_by_one(self, events, owner):
        events = list(events)
        events[0] = tracking.Replayed(events[0].nbytes + 1, events[0].stream, events[0].device,
                                      events[0].category, events[0].tags)
        return replay(self, events, owner)

    monkeypatch.setattr(tracking.LiveStorageTracker, "replay", off_by_one)
    pairs, steps = _reused_and_full(_mlp(), (3, 5))
    assert steps.replayed == 2
    with pytest.raises(AssertionError):
        _same(*pairs[1])
