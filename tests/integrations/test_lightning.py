"""Lightning, for real on the CPU, in one process: AutotuneBatchSize, and accumulator in manual optimization.

Two processes: tests/integrations/test_ddp.py.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from autotune.errors import BadInput, PlanError  # noqa: E402
from autotune.integrations.common import largest_batch  # noqa: E402
from autotune.integrations.lightning import AutotuneBatchSize  # noqa: E402
from autotune.planning import make_plan  # noqa: E402

from .lightning_models import ManualLM, Sequences, TinyLM, trainer  # noqa: E402
from .tokens import MIXED, max_error, plan_loader, reference_parameters, sequences  # noqa: E402

BUDGET = "300KiB"  # TinyLM fits 46 sequences of 6 tokens, 6 of 40 (5 with DDP's buckets)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Seen(pl.Callback):
    def __init__(self):
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sizes.append(int(batch.shape[0]))


def fit_with_callback(target: int, lengths: list[int], **kwargs) -> tuple[AutotuneBatchSize, Sequences, pl.Trainer,
                                                                         Seen]:
    pl.seed_everything(0, verbose=False)
    tune, seen, data = AutotuneBatchSize(target, memory_budget=BUDGET, **kwargs), Seen(), Sequences(lengths)
    t = trainer(callbacks=[tune, seen])
    t.fit(TinyLM(), datamodule=data)
    return tune, data, t, seen


LONG_THIRD = [6] * 4 + [40] * 2 + [6] * 60  # the third batch of 2 holds the long sequences


@pytest.mark.slow
def test_the_callback_sets_batch_size_and_accumulation_for_the_exact_target():
    tune, data, t, seen = fit_with_callback(20, LONG_THIRD)
    plan = tune.plan
    assert plan is not None and plan.uniform and plan.target_batch == 20
    assert data.batch_size == plan.micro_batch and t.accumulate_grad_batches == plan.accumulation_steps
    assert data.batch_size * t.accumulate_grad_batches == 20 and t.accumulate_grad_batches > 1
    assert t.global_step == 2 and seen.sizes == [data.batch_size] * (2 * t.accumulate_grad_batches)


@pytest.mark.slow
def test_the_callback_probes_the_largest_batch_it_scans():
    worst = fit_with_callback(20, LONG_THIRD)[0].plan
    first_only = fit_with_callback(20, LONG_THIRD, scan_batches=2)[0].plan  # never meets the long sequences
    assert worst.probe.max_micro_batch <= 6 and first_only.probe.max_micro_batch == 20  # (capped at the target)
    assert first_only.accumulation_steps == 1  # 20 short sequences fit at once; 2 of 40 tokens would not


def test_largest_batch_is_the_most_elements_per_sample():
    batches = [torch.zeros(4, 6), torch.zeros(2, 40), torch.zeros(1, 40), torch.zeros(4, 8)]
    best, seen = largest_batch(iter(batches), limit=3)
    assert best is batches[1] and seen == 3  # the first of equals; the fourth is past the limit


@pytest.mark.slow
def test_a_target_with_no_equal_split_names_the_nearest():
    with pytest.raises(PlanError, match=r"Lightning runs equal micro-batches, and target_batch 23 does not split .*"
                                        r"use target_batch 21 \(21 = 3 x 7 steps x 1 rank\) or 24 \(24 = 6 x 4 steps"):
        fit_with_callback(23, LONG_THIRD)


def test_a_dataset_smaller_than_one_effective_batch_is_a_warning_and_a_note():
    """64 samples, target 1000: Lightning steps at the end of each epoch, on 64 samples; the plan says so."""
    with pytest.warns(UserWarning, match=r"^the dataset holds 64 samples, fewer than one effective batch of 1000: "
                      r"Lightning steps at the end of every epoch, so no optimizer step sees more than 64") as caught:
        tune, data, t, seen = fit_with_callback(1000, [6] * 64)
    mine = [w for w in caught if "fewer than one effective batch" in str(w.message)]
    assert len(mine) == 1 and tune.plan.notes[-1] == str(mine[0].message)
    assert t.global_step == 2 and sum(seen.sizes) == 2 * 64  # what the warning says: 64 samples a step


def test_the_callback_refuses_what_it_cannot_set():
    pl.seed_everything(0, verbose=False)
    with pytest.raises(BadInput, match=r"batch_arg_name 'bs' is neither an attribute"):
        trainer(callbacks=[AutotuneBatchSize(8, batch_arg_name="bs")]).fit(TinyLM(), datamodule=Sequences([4] * 8))
    with pytest.raises(BadInput, match=r"manual optimization does not use"):
        trainer(callbacks=[AutotuneBatchSize(8)]).fit(ManualLM(make_plan(8, 8), "autotune"),
                                                      datamodule=Sequences([4] * 8))
    with pytest.raises(BadInput, match=r"the dataloader was passed to fit\(\) directly"):
        trainer(callbacks=[AutotuneBatchSize(8)]).fit(TinyLM(), train_dataloaders=Sequences([4] * 8).train_dataloader())


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, words", [
    (dict(target_batch="64"), r"^target_batch '64' is a string, not a whole number: give the number itself, 64$"),
    (dict(target_batch=64, margin="0.1"), r"^margin '0\.1' is a string, not a number"),
    (dict(target_batch=64, scan_batches="4"), r"^scan_batches '4' is a string"),
])
def test_the_callback_refuses_strings_for_numbers_as_the_api_does(kwargs, words):
    """A2, A5: one rule for the API's numbers: a string is refused, never coerced."""
    with pytest.raises(BadInput, match=words):
        AutotuneBatchSize(**kwargs)


def test_manual_accumulator_in_one_process_matches_full_batch_sgd():
    plan = make_plan(21, 4)
    assert plan.arithmetic == "21 = 3 x 3 + 3 x 4 over 6 steps x 1 rank"  # uneven, each weighted by its tokens
    data = sequences(MIXED)
    pl.seed_everything(0, verbose=False)
    model = ManualLM(plan, "autotune")
    t = trainer()
    t.fit(model, train_dataloaders=plan_loader(data, plan))
    assert t.global_step == 2 and max_error(model, reference_parameters(data, 21, steps=2)) < 1e-5


@pytest.mark.slow
def test_manual_accumulator_clips_with_lightning():
    plan, data = make_plan(21, 4), sequences(MIXED)
    model = ManualLM(plan, "autotune", max_norm=1e-3)  # SGD at lr 0.5: every step moves the weights by 5e-4
    before = [p.detach().clone() for p in model.parameters()]
    trainer(max_steps=1).fit(model, train_dataloaders=plan_loader(data, plan))
    moved = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach() - q)
                                                  for p, q in zip(model.parameters(), before)]))
    assert float(moved) == pytest.approx(0.5 * 1e-3, rel=1e-4)


class PackedLlama(pl.LightningModule):
    """A tiny Hugging Face Llama (no cache: attention stays inside each packed example), its own loss."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=128, use_cache=False))

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Flattened(pl.LightningDataModule):
    """Token examples batched by DataCollatorWithFlattening: ``batch_size`` examples in one row."""

    def __init__(self, lengths: list[int], batch_size: int = 2):
        super().__init__()
        from transformers import DataCollatorWithFlattening

        self.batch_size, self.collate = batch_size, DataCollatorWithFlattening()
        g = torch.Generator().manual_seed(0)
        self.data = [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in lengths]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, collate_fn=self.collate)


class Examples(pl.Callback):
    def __init__(self):
        self.counts: list[tuple[int, int]] = []  # (rows, examples) of every batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counts.append((int(batch["input_ids"].shape[0]), int((batch["position_ids"][0] == 0).sum())))


@pytest.mark.slow
def test_the_callback_plans_examples_packed_by_a_flattening_collator():
    """A micro-batch is batch_size examples in one row: the callback probes rows of the longest examples
    packed, sets batch_size x accumulate_grad_batches to the target, and Lightning trains one-row batches."""
    pytest.importorskip("transformers")
    pl.seed_everything(0, verbose=False)
    tune, seen = AutotuneBatchSize(24, memory_budget="24MiB"), Examples()
    data = Flattened([12] * 4 + [64] * 4 + [12] * 92)  # the scan meets the long examples
    t = trainer(callbacks=[tune, seen])
    t.fit(PackedLlama(), datamodule=data)
    plan = tune.plan
    assert plan is not None and data.batch_size * t.accumulate_grad_batches == 24
    assert plan.max_micro_batch > 1 and t.accumulate_grad_batches > 1  # examples, not rows, are the samples
    assert seen.counts == [(1, data.batch_size)] * len(seen.counts) and len(seen.counts) > 1
