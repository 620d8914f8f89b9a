"""docs/integrations.md, "Where you already train": every code block runs here as written, on the CPU.

Each block gets what its text assumes the user has (a model, a dataset, a plan...); the checks after it
say what the block must have done.
"""

from __future__ import annotations

import pytest

import autotune
from autotune.planning import make_plan

from .. import docs

PAGE = "integrations.md"


def blocks(heading: str) -> list[str]:
    """The python code blocks under the heading on docs/integrations.md."""
    return docs.blocks(PAGE, heading)


def run(code: str, namespace: dict) -> dict:
    return docs.run(code, namespace, PAGE)


def test_every_subsection_has_its_blocks():
    assert [len(blocks(h)) for h in ("Hugging Face Trainer", "Lightning", "Accelerate", "A model you already have")] \
        == [1, 2, 1, 1]
    # README's framework example is the Trainer's block here, word for word: what test_hugging_face runs is both
    assert docs.blocks("README.md", "Where you already train") == blocks("Hugging Face Trainer")


@pytest.mark.slow
def test_hugging_face(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from .hf_models import collate, examples, gpt2

    hf_logging.set_verbosity_error()
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2,
                             save_strategy="no", disable_tqdm=True)
    data = examples([12] * 60 + [24] * 4)
    done = run(blocks("Hugging Face Trainer")[0], {"args": args, "model": gpt2(), "train_dataset": data,
                                                   "collate": collate, "Trainer": Trainer})
    new, plan = done["args"], done["plan"]
    assert new.per_device_train_batch_size * new.gradient_accumulation_steps == 256 and plan.uniform
    assert done["trainer"].state.global_step == 2


@pytest.mark.slow
def test_lightning():
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from .lightning_models import ManualLM, Sequences, TinyLM, trainer
    from .tokens import MIXED, plan_loader, sequences, token_loss, tokens

    callback, manual = blocks("Lightning")
    pl.seed_everything(0, verbose=False)
    datamodule = Sequences([40] * 4 + [6] * 600)
    done = run(callback, {"Trainer": trainer, "model": TinyLM(), "datamodule": datamodule})  # Trainer: yours
    t = done["trainer"]
    assert datamodule.batch_size * t.accumulate_grad_batches == 256 and t.global_step == 2

    plan = make_plan(21, 4)

    class LightningModule(ManualLM):  # the page's base class, with the test's network and manual optimization
        def __init__(self):
            super().__init__(plan, "none")

    done = run(manual, {"LightningModule": LightningModule, "plan": plan, "my_loss": token_loss,
                        "count_tokens": tokens})
    model = done["Model"]()
    fitted = trainer()
    fitted.fit(model, train_dataloaders=plan_loader(sequences(MIXED), plan))
    assert fitted.global_step == 2 and model.accumulate.sizes == list(plan.schedule[0])


@pytest.mark.slow
def test_accelerate():
    pytest.importorskip("accelerate")
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from .tokens import MIXED, TokenNet, max_error, pad, reference_parameters, sequences, token_loss

    torch.manual_seed(0)
    model = TokenNet()
    dataset = sequences(MIXED)
    done = run(blocks("Accelerate")[0], {
        "accelerator": Accelerator(cpu=True), "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
        "plan": make_plan(21, 4), "my_loss": token_loss, "dataset": dataset, "collate": pad, "DataLoader": DataLoader,
        "autotune": autotune})
    assert done["step"].max_norm == 1.0
    start = reference_parameters(dataset, 21, steps=0)
    moved = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach() - q)
                                                  for p, q in zip(done["model"].parameters(), start)]))
    assert float(moved) <= 2 * 0.5 * 1.0 + 1e-6  # two steps of SGD at lr 0.5 on gradients clipped to norm 1
    assert max_error(done["model"], reference_parameters(dataset, 21, steps=2)) > 1e-4  # and they were clipped


@pytest.mark.slow
def test_a_model_you_already_have():
    import torch
    from torch.utils.data import DataLoader

    from .tokens import MIXED, TokenNet, pad, sequences, token_loss

    torch.manual_seed(0)
    model = TokenNet()
    dataset = sequences(MIXED * 7)  # 294 sequences: one effective batch of 256, then the rest
    before = [p.detach().clone() for p in model.parameters()]
    done = run(blocks("A model you already have")[0], {
        "model": model, "batch": pad(dataset[:8]), "my_loss": token_loss, "dataset": dataset, "collate": pad,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.5), "DataLoader": DataLoader})
    assert done["plan"].target_batch == 256 and done["step"].sizes == list(done["plan"].schedule[0])
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


