"""The batch ramp at run time: it follows a known, changing noise scale, ignores noisy readings, applies the
learning-rate rule, feeds exact phases, and its sampler gives the loader the batch it wants."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autotune
from autotune.errors import BadInput
from autotune.planning.planner import make_plan
from autotune.results.noise import NoiseStep
from autotune.training import NoiseScale
from autotune.training.accumulate import Accumulator
from autotune.training.ramp import BatchRamp, RampSampler

D = 8  # features of the linear regression below


def truth(sigma2: float) -> float:
    """B_simple of the regression below: x ~ N(0, I_D), y = x.w* + sigma eps, a model off by Delta = 1 in every
    coordinate: G = Delta, tr(Sigma) = D (|Delta|^2 + sigma^2) + |Delta|^2, so B = D + 1 + sigma^2."""
    return D + 1 + sigma2


def regression(batch: int, sigma2: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, D, generator=g)
    return x, sigma2 ** 0.5 * torch.randn(batch, generator=g)  # w* = 0, the model at w = 1


def squared(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return 0.5 * (model(x).squeeze(-1) - y).pow(2).mean()


def fixed_model() -> nn.Module:
    model = nn.Linear(D, 1, bias=False)
    nn.init.ones_(model.weight)
    return model


def train(noise_at, steps: int, *, target: int = 512, m: int = 32, seed: int = 0, **config) -> BatchRamp:
    """The regression with learning rate 0 (the noise scale is ``truth(noise_at(step))`` at every step)."""
    model = fixed_model()
    step = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), make_plan(target, m), loss=squared,
                       parts=[autotune.RampConfig(**config)])
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        step(regression(step.ramp.effective_batch, noise_at(t), g))
    return step.ramp


def check_exact(ramp: BatchRamp, target: int, m: int) -> None:
    sizes = [p.effective_batch for p in ramp.phases]
    assert sizes == sorted(sizes) and sizes[-1] <= target
    for p in ramp.phases:
        assert sum(map(sum, p.schedule)) == p.effective_batch and p.micro_batch <= m


@pytest.mark.slow
def test_the_batch_follows_a_known_growing_noise_scale():
    def noise(t: int) -> float:
        return 500.0 * (t / 200) ** 2  # B_simple from 9 to 509

    ramp = train(noise, 200)
    check_exact(ramp, 512, 32)
    grown = ramp.phases[1:]
    assert len(grown) >= 3 and ramp.phases[-1].effective_batch >= 256
    for before, phase in zip(ramp.phases, grown):
        known = truth(noise(phase.first_step))
        assert phase.low is not None and phase.low > before.effective_batch  # grown on a bounded reading
        assert known > 0.8 * before.effective_batch, phase  # the noise scale really had outgrown the batch
        assert phase.effective_batch < 2.5 * known, phase  # about B_simple, not past it


@pytest.mark.slow
def test_a_noise_scale_below_the_batch_never_grows_it():
    ramp = train(lambda t: 11.0, 150)  # B_simple = 20, the ramp starts at 33
    assert [p.effective_batch for p in ramp.phases] == [33]


class Readings:
    """Stands in for a GradientNoiseScale: per-step estimates chosen by the test."""

    def __init__(self, steps: list[tuple[float, float]]):
        self.history = [NoiseStep(step=i, items=64, micro_batches=2, grad_sq=g, trace_cov=t, b_simple=None, low=None,
                                  high=None) for i, (g, t) in enumerate(steps)]
        self.fed = 0

    def since(self, start: int) -> list[NoiseStep]:
        self.fed += 1
        return self.history[start:self.fed]


@pytest.mark.parametrize("spread,grows", [(6.0, False), (0.1, True)])
def test_a_noisy_reading_does_not_make_it_grow(spread, grows):
    # Both windows estimate B_simple = 100 (tr Sigma 100 / |G|^2 1) while the batch is 33; only the steady one
    # bounds it above 33.
    steps = [(1.0 + spread * (-1) ** i, 100.0) for i in range(40)]
    ramp = BatchRamp(make_plan(512, 32), autotune.RampConfig())
    ramp.begin_step(33)
    source = Readings(steps)
    for _ in range(40):
        ramp.end_step(source)  # type: ignore[arg-type]
    reading = ramp.reading()
    assert reading.b_simple == pytest.approx(100)
    assert (ramp.effective_batch > 33) == grows
    if not grows:
        assert reading.low is None or reading.low <= 33


def recorded_lr(optimizer: torch.optim.Optimizer) -> list[float]:
    seen: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    return seen


@pytest.mark.parametrize("optimizer,rule,want", [
    (torch.optim.SGD, "linear", 64 / 512), (torch.optim.SGD, "sqrt", (64 / 512) ** 0.5),
    (torch.optim.SGD, "none", 1.0), (torch.optim.SGD, "noise", 64 / 512),  # no reading yet: the conservative end
    (torch.optim.AdamW, "noise", (64 / 512) ** 0.5),  # Adam-type: the square root of SGD's factor
])
def test_the_learning_rate_rule_is_applied_during_each_step_and_the_schedulers_rate_kept(optimizer, rule, want):
    model = fixed_model()
    opt = optimizer(model.parameters(), lr=0.4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)  # sets the rate from its own base
    step = Accumulator(model, opt, make_plan(512, 32), loss=squared,
                       parts=[autotune.RampConfig(start=64, lr_scaling=rule)])
    seen = recorded_lr(opt)  # registered after the ramp's hook: sees the rate the step uses
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        step(regression(64, 1.0, g))
        scheduler.step()
    assert seen == pytest.approx([0.4 * want, 0.2 * want, 0.1 * want])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # the scheduler's own rate, unscaled, between steps
    assert step.ramp.phases[0].lr_scale == pytest.approx(want)


def test_a_plain_loop_in_four_lines_with_the_ramps_sampler():
    torch.manual_seed(0)
    x = torch.randn(600, D)
    dataset = torch.utils.data.TensorDataset(x, x @ torch.ones(D))
    model = nn.Linear(D, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = make_plan(96, 16)
    # docs/noise-scale-and-ramp.md's loop:
    step = autotune.Accumulator(model, optimizer, plan, loss=squared, parts=[autotune.RampConfig(start=32)])
    for batch in torch.utils.data.DataLoader(dataset, batch_sampler=step.ramp.sampler(len(dataset))):
        step(batch)
    assert step.ramp.phases[0].effective_batch == 32
    assert step.ramp._steps == 600 // 32 + 1  # 18 batches of 32 and the last 24 samples, nothing left out


def test_the_sampler_yields_what_the_ramp_wants_each_step_and_every_sample_once_per_epoch():
    ramp = BatchRamp(make_plan(64, 8, world_size=2), autotune.RampConfig(start=16))
    samplers = [RampSampler(100, ramp, rank=r) for r in (0, 1)]
    iters = [iter(s) for s in samplers]
    seen: list[int] = []
    for wanted in (16, 16, 32, 32):
        ramp.wanted = wanted  # what a decision sets
        shares = [next(it) for it in iters]
        assert [len(s) for s in shares] == [wanted // 2] * 2
        seen += shares[0] + shares[1]
    rest = [list(it) for it in iters]  # 4 samples left: split over the ranks
    assert [sum(map(len, r)) for r in rest] == [2, 2]
    seen += [i for r in rest for b in r for i in b]
    assert sorted(seen) == list(range(100))
    assert len(samplers[0]) == 100 // 32 + 1  # at the batch wanted now: an upper bound


def test_a_phase_begins_at_the_first_batch_of_its_size_when_the_loader_lags():
    model = fixed_model()
    step = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), make_plan(512, 32), loss=squared,
                       parts=[autotune.RampConfig(start=40)])
    g = torch.Generator().manual_seed(0)
    step(regression(40, 1.0, g))
    step.ramp.wanted = 80  # decided after step 1; the loader had built two more batches of 40 already
    for n in (40, 40, 80, 80):
        out = step.step(regression(n, 1.0, g))
        assert out.samples == n
    assert [(p.first_step, p.effective_batch) for p in step.ramp.phases] == [(0, 40), (3, 80)]
    assert step.sizes == list(make_plan(80, 32).schedule[0])


@pytest.mark.parametrize("kwargs,words", [
    ({"schedule": [16, 16]}, "a batch ramp needs the Plan of the target batch"),
    ({"parts": [autotune.RampConfig(), NoiseScale(measure=False)]},
     "ramp grows the batch with the measured gradient noise scale: leave noise_scale on"),
    ({"parts": [], "ramp": 0.5}, "ramp must be an autotune.RampConfig or a BatchRamp"),  # the old keyword
])
def test_an_accumulator_refuses_a_ramp_it_cannot_follow(kwargs, words):
    model = fixed_model()
    args = {"schedule": make_plan(512, 32), "parts": [autotune.RampConfig()], **kwargs}
    with pytest.raises(BadInput, match=words), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), args.pop("schedule"), loss=squared, **args)


def test_the_first_batch_must_be_the_ramps():
    model = fixed_model()
    step = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), make_plan(512, 32), loss=squared,
                       parts=[autotune.RampConfig()])
    with pytest.raises(BadInput, match=r"the batch ramp starts at 33 samples per step \(33 on rank 0\) but the "
                                       r"first batch holds 512: feed the batches the ramp wants"):
        step(regression(512, 1.0, torch.Generator().manual_seed(0)))


def test_a_dataset_smaller_than_the_first_batch_is_said_when_the_sampler_is_made():
    # R30: the mid-loop error told the user to use step.ramp.sampler(len(dataset)), which they had.
    ramp = BatchRamp(make_plan(512, 280), autotune.RampConfig())
    assert ramp.start == 281
    with pytest.raises(BadInput, match=r"the dataset holds 100 samples, fewer than the batch ramp's first batch of "
                                       r"281: .*RampConfig\(start=N\) with N from 2 to 100, e\.g\. 25"):
        ramp.sampler(100)
    assert len(ramp.sampler(281)) == 1


def test_a_ramp_that_starts_at_the_target_says_so(caplog):
    # R7: "growing toward 512 with the measured noise scale" at a start of 512.
    model = fixed_model()
    step = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), make_plan(64, 32), loss=squared,
                       parts=[autotune.RampConfig(start=64)])
    with caplog.at_level("INFO", logger="autotune"):
        step(regression(64, 1.0, torch.Generator().manual_seed(0)))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "starts at the target 64: every step takes it, nothing to grow" in said and "growing" not in said


def test_a_new_phase_on_cuda_hands_the_allocators_unused_blocks_back_first(monkeypatch):
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(step.ramp._steps))
    model = fixed_model()
    step = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), make_plan(512, 32), loss=squared,
                       parts=[autotune.RampConfig(start=40)])
    step.device_type = "cuda"  # what a model on a GPU reports; the allocator itself is faked above
    g = torch.Generator().manual_seed(0)
    for wanted in (40, 40, 80, 80, 160):
        step.ramp.wanted = wanted
        step(regression(wanted, 1.0, g))
    assert emptied == [2, 4]  # before the first step of each later phase, never within one
