"""`autotune plan --format X` pastes into X: the real constructors take the settings as printed."""

from __future__ import annotations

import json

import pytest

from autotune.cli import main

MLP = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB", "--quiet"]  # micro-batches of up to 307 fit


def exported(capsys, fmt: str, *argv: str) -> dict:
    code = main(["plan", "--target-batch", "1024", *MLP, "--format", fmt, *argv])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    return json.loads(out)


@pytest.mark.slow
def test_lightning_trainer_and_datamodule_take_the_export(capsys):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from .lightning_models import Sequences

    data = exported(capsys, "lightning")
    trainer = pl.Trainer(**data["trainer"], accelerator="cpu", logger=False)
    module = Sequences([4] * 8, **data["datamodule"])
    assert module.batch_size * trainer.accumulate_grad_batches == 1024 == 256 * 4


@pytest.mark.slow
def test_hf_training_arguments_take_the_export(capsys, tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **exported(capsys, "hf"))
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size == 1024


@pytest.mark.slow
def test_accelerate_takes_the_export(capsys):
    pytest.importorskip("accelerate")
    import torch
    from accelerate import Accelerator

    data = exported(capsys, "accelerate")
    accelerator = Accelerator(cpu=True, **data["accelerator"])
    loader = torch.utils.data.DataLoader(list(range(2048)), **data["dataloader"])
    assert loader.batch_size * accelerator.gradient_accumulation_steps * accelerator.num_processes == 1024


@pytest.mark.parametrize("world", ["1", "8"])
def test_deepspeed_batch_identity(capsys, world):
    # DeepSpeed is not installed here: its config check is this identity.
    data = exported(capsys, "deepspeed", "--world-size", world)
    micro, steps = data["train_micro_batch_size_per_gpu"], data["gradient_accumulation_steps"]
    assert data["train_batch_size"] == micro * steps * int(world) == 1024


@pytest.mark.parametrize("fmt, name", [("hf", "the Hugging Face Trainer"), ("lightning", "Lightning"),
                                       ("accelerate", "Accelerate"), ("deepspeed", "DeepSpeed")])
def test_a_plan_whose_ranks_differ_does_not_export_and_the_error_names_uniform_ranks(capsys, fmt, name):
    code = main(["plan", "--target-batch", "1300", "--probe", "mlp", "--device", "cpu", "--memory-budget", "8MiB,3MiB",
                 "--quiet", "--format", fmt])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{name} takes one per-device batch size, but the ranks differ (max micro-batch per rank: " in err
    assert "pass --uniform-ranks for the smallest-for-all plan" in err
