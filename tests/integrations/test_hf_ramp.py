"""The Hugging Face Trainer and a batch ramp, for real on the CPU: the callback stops train() at its start and
says why (the Trainer fixes the batch when it starts) and where a ramp runs instead."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import autotune  # noqa: E402
from autotune.errors import BadInput  # noqa: E402
from autotune.integrations.hf import AutotuneBatchRamp  # noqa: E402

from .hf_models import collate, examples, gpt2  # noqa: E402


def test_the_trainer_refuses_a_ramp_before_any_step(tmp_path):
    hf_logging.set_verbosity_error()
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=3,
                             save_strategy="no", disable_tqdm=True, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=examples([8] * 16), data_collator=collate,
                      callbacks=[AutotuneBatchRamp(autotune.RampConfig(start=4))])
    with warnings.catch_warnings(), pytest.raises(BadInput, match=(
            r"^the Hugging Face Trainer cannot follow a batch ramp: it fixed per_device_train_batch_size=4, "
            r"gradient_accumulation_steps=2 and 3 optimizer steps .* ramp in your own loop or in Lightning: "
            r"autotune\.Accumulator\(model, optimizer, plan, loss=\.\.\., parts=\[autotune\.RampConfig\(\)\]\)")):
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(p.equal(q) for p, q in zip(model.parameters(), before))  # nothing trained
