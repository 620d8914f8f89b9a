"""The batch ramp under Lightning, for real on the CPU: epoch by epoch with automatic optimization, step by step
with manual optimization."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import autotune  # noqa: E402
from autotune.integrations.lightning import AutotuneBatchSize, accumulator  # noqa: E402
from autotune.planning import make_plan  # noqa: E402
from autotune.training.ramp import BatchRamp  # noqa: E402

from .lightning_models import Sequences, TinyLM, trainer  # noqa: E402
from .tokens import pad, sequences, token_loss, tokens  # noqa: E402

QUICK = autotune.RampConfig(min_steps=3, window=8)  # random tokens: a noise scale far above every batch here


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Steps(pl.Callback):
    """Samples per optimizer step, the rate each step used, and the global step at each epoch's start."""

    def __init__(self):
        self.samples: list[int] = []
        self.rates: list[float] = []
        self.epoch_starts: list[int] = []
        self._pending = 0

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]  # registered after the ramp's hook: sees the rate the step uses
        opt.register_step_pre_hook(lambda o, args, kwargs: self.rates.append(o.param_groups[0]["lr"]))

    def on_train_epoch_start(self, trainer, pl_module):
        self.epoch_starts.append(trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._pending += int(batch.shape[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.samples.append(self._pending)
        self._pending = 0


@pytest.mark.slow
def test_automatic_optimization_grows_the_batch_at_epoch_starts_in_whole_micro_batches():
    pl.seed_everything(0, verbose=False)
    tune, steps = AutotuneBatchSize(256, memory_budget="300KiB", ramp=QUICK), Steps()
    data = Sequences([6] * 768)
    t = trainer(callbacks=[tune, steps], max_steps=-1, max_epochs=5)
    t.fit(TinyLM(lr=0.1), datamodule=data)
    plan, phases = tune.plan, tune.ramp.ramp.phases
    micro = plan.micro_batch
    assert data.batch_size == micro and 256 % micro == 0
    sizes = [p.effective_batch for p in phases]
    assert sizes[0] == 2 * micro and sizes == sorted(sizes) and sizes[-1] == 256 and len(sizes) >= 3
    assert all(p.first_step in steps.epoch_starts for p in phases)  # changed between epochs only
    assert all(set(map(len, p.schedule)) == {p.effective_batch // micro} and p.micro_batch == micro for p in phases)
    ends = [p.first_step for p in phases[1:]] + [len(steps.samples)]
    for phase, end in zip(phases, ends):  # every step took its phase's batch (the epochs divide evenly here)
        assert steps.samples[phase.first_step:end] == [phase.effective_batch] * (end - phase.first_step)
        want = 0.1 * phase.lr_scale
        assert steps.rates[phase.first_step:end] == pytest.approx([want] * (end - phase.first_step))
    assert t.optimizers[0].param_groups[0]["lr"] == 0.1  # the user's rate, between steps and after


@pytest.mark.slow
def test_the_short_last_step_of_an_epoch_is_said_and_recorded_as_it_was():
    # R34: 700 sequences in micro-batches of the plan's size end each epoch with a step of fewer samples than the
    # phase's (fewer micro-batches, the last one short), each weighted 1/k by Lightning as if full.
    pl.seed_everything(0, verbose=False)
    tune, steps = AutotuneBatchSize(256, memory_budget="300KiB", ramp=QUICK), Steps()
    data = Sequences([6] * 700)
    t = trainer(callbacks=[tune, steps], max_steps=-1, max_epochs=6)
    with pytest.warns(UserWarning, match=r"took \d+ samples on this rank instead of the phase's \d+") as said:
        t.fit(TinyLM(lr=0.1), datamodule=data)
    said = [str(w.message) for w in said if "batch ramp" in str(w.message)]
    assert said and all("accumulator" in w for w in said)  # the way to exact steps
    phases, short = tune.ramp.ramp.phases, tune.ramp.short_steps
    assert short and len(phases) >= 2
    ends = [p.first_step for p in phases[1:]] + [len(steps.samples)]
    for phase, end in zip(phases, ends):
        for step in range(phase.first_step, end):
            took = steps.samples[step]
            assert took == phase.effective_batch or short.get(step) == took, (step, took, short)
    assert all(steps.samples[step] == took < 256 for step, took in short.items())


@pytest.mark.slow
def test_a_target_of_two_micro_batches_leaves_no_room_and_says_what_would():
    # R33: the suggested start was the target itself (no ramp at all).
    from autotune.errors import PlanError

    pl.seed_everything(0, verbose=False)
    tune = AutotuneBatchSize(64, memory_budget="300KiB", ramp=QUICK)
    with pytest.raises(PlanError) as caught:
        trainer(callbacks=[tune], max_steps=-1, max_epochs=1).fit(TinyLM(lr=0.1), datamodule=Sequences([6] * 128))
    said = str(caught.value)
    assert "whole micro-batches of 32" in said and "2 x 32 = 64 is the target 64" in said
    assert "a smaller memory_budget" in said and "a larger target_batch" in said and "e.g. 64" not in said


@pytest.mark.slow
def test_manual_optimization_grows_the_batch_at_any_step():
    plan = make_plan(48, 8)
    ramp = BatchRamp(plan, autotune.RampConfig(start=12, min_steps=3, window=8))

    class Ramped(TinyLM):
        def __init__(self):
            super().__init__(lr=0.1)
            self.automatic_optimization = False

        def train_dataloader(self):
            return DataLoader(sequences([6] * 600), batch_sampler=ramp.sampler(600), collate_fn=pad)

        def on_train_start(self):
            self.accumulate = accumulator(self, self.optimizers(), plan, loss=token_loss, items=tokens, ramp=ramp)

        def training_step(self, batch, batch_idx):
            self.accumulate(batch)

    pl.seed_everything(0, verbose=False)
    t = trainer(max_steps=-1, max_epochs=1)
    t.fit(Ramped())
    sizes = [p.effective_batch for p in ramp.phases]
    assert sizes[0] == 12 and sizes == sorted(sizes) and sizes[-1] == 48 and len(sizes) >= 3
    assert t.global_step == ramp._steps  # every optimizer step went through the ramp's accumulation


def test_a_ramp_that_is_not_a_ramp_config_is_refused():
    from autotune.errors import BadInput

    with pytest.raises(BadInput, match="ramp must be an autotune.RampConfig, got bool"):
        AutotuneBatchSize(256, ramp=True)
