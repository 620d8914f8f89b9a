"""A settings search's chosen setting in each framework's settings: the real HF Trainer and Lightning Trainer
on the CPU pick it up."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autotune.planning.exports import export
from autotune.planning.planner import make_plan
from autotune.planning.setting_exports import setting_notes
from autotune.results.plan import Plan
from autotune.results.search import TrainSetting


def chosen(setting: TrainSetting, world_size: int = 1) -> Plan:
    return replace(make_plan(8 * world_size, 2, world_size=world_size), setting=setting)


@pytest.mark.slow  # a real Trainer step
def test_hf_trainer_checkpoints_every_2nd_layer_as_chosen(tmp_path) -> None:
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(config)
    data = export(chosen(TrainSetting(blocks="model.layers.*", checkpoint_every=2)), "hf")
    assert data["gradient_checkpointing_kwargs"]["every_n_layers"] == 2
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                                          save_strategy="no", **data)
    examples = [{"input_ids": torch.randint(0, 100, (8,)), "labels": torch.randint(0, 100, (8,))}
                for _ in range(8)]
    transformers.Trainer(model=model, args=args, train_dataset=examples).train()
    assert model.is_gradient_checkpointing
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)


@pytest.mark.slow  # Lightning's import
def test_lightning_trainer_takes_the_strategy_and_precision() -> None:
    import lightning.pytorch as lightning

    data = export(chosen(TrainSetting(changes=("bf16-mixed",)), world_size=2), "lightning")
    trainer = lightning.Trainer(**data["trainer"], accelerator="cpu", devices=2, logger=False,
                                enable_checkpointing=False)
    assert type(trainer.strategy).__name__ == "DDPStrategy"
    assert trainer.precision == "bf16-mixed" and trainer.accumulate_grad_batches == 4


@pytest.mark.parametrize(("fmt", "key", "value"), [
    ("hf", "fsdp", "full_shard"),
    ("deepspeed", "zero_optimization", {"stage": 3}),
])
def test_fsdp_is_each_frameworks_own_sharding(fmt: str, key: str, value: object) -> None:
    data = export(chosen(TrainSetting(parallel="fsdp", fsdp_sync="last"), world_size=2), fmt)
    assert data[key] == value


def test_accelerate_and_lightning_fsdp_with_checkpointing() -> None:
    plan = chosen(TrainSetting(parallel="fsdp", fsdp_sync="last", blocks="blocks.*", checkpoint_every=1), world_size=2)
    accelerate = export(plan, "accelerate")
    assert accelerate["config"]["fsdp_config"]["fsdp_activation_checkpointing"] is True
    lightning = export(plan, "lightning")
    assert lightning["trainer"]["strategy"] == "fsdp"
    assert lightning["checkpointing"] == {"blocks": "blocks.*", "every_n_layers": 1}


def test_what_a_format_cannot_hold_is_said() -> None:
    plan = chosen(TrainSetting(allocator="expandable_segments:True", changes=("lora",)))
    notes = setting_notes(plan, "hf")
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in n for n in notes)
    assert any("LoRA" in n for n in notes)
    assert setting_notes(make_plan(8, 2, world_size=1), "hf") == []


OFFLOAD = TrainSetting(parallel="fsdp", fsdp_sync="every", offload=True)


@pytest.mark.slow  # transformers' import
def test_hf_training_arguments_take_the_offload(tmp_path) -> None:
    import transformers

    data = export(chosen(OFFLOAD, world_size=2), "hf")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                                          **data)
    assert args.fsdp_plugin_args["cpu_offload"] is True and args.fsdp_plugin_args["fsdp_version"] == 2


@pytest.mark.slow  # Lightning's import
def test_lightning_trainer_takes_fsdp_with_cpu_offload() -> None:
    import lightning.pytorch as lightning
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    data = export(chosen(OFFLOAD, world_size=2), "lightning")
    # Lightning's FSDP needs a GPU accelerator to build a Trainer; the name resolves as the Trainer resolves it
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        lightning.Trainer(**data["trainer"], accelerator="cpu", devices=2, logger=False)
    strategy = StrategyRegistry.get(data["trainer"]["strategy"])
    assert isinstance(strategy, FSDPStrategy) and strategy.cpu_offload.offload_params


@pytest.mark.slow  # Accelerate's import
def test_accelerate_launch_gives_fsdp2_its_cpu_offload(tmp_path, monkeypatch) -> None:
    import yaml
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = export(chosen(OFFLOAD, world_size=2), "accelerate")["config"]
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "num_processes": 2, "use_cpu": True,
                                    "mixed_precision": "no", **config}))
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    for name, value in prepare_multi_gpu_env(args).items():
        if name.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"


@pytest.mark.slow  # Accelerate's import
def test_deepspeed_offloads_the_optimizer_and_parameters_under_zero_3() -> None:
    from accelerate.utils.deepspeed import HfDeepSpeedConfig  # DeepSpeed's config as Accelerate and HF read it

    data = export(chosen(OFFLOAD, world_size=2), "deepspeed")
    config = HfDeepSpeedConfig(data)
    assert config.is_zero3() and config.is_offload()
    assert data["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert data["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert "offload" not in json_keys(export(chosen(TrainSetting(parallel="fsdp", fsdp_sync="every"), 2), "deepspeed"))


def json_keys(data: object) -> str:
    import json

    return json.dumps(data)


@pytest.fixture(scope="module")
def fsdp_plans() -> dict[str, Plan]:
    """Plain FSDP plans over 2 ranks (no settings search), by the gradient sync they were probed under."""
    from autotune import api

    return {sync: api.plan(16, probe="mlp", device="estimate:A10G-24GB", parallel="fsdp", world_size=2, fsdp_sync=sync)
            for sync in ("every", "last")}


def test_a_plain_fsdp_plan_exports_each_frameworks_sharding(fsdp_plans) -> None:
    """An FSDP plan made without a settings search is exported as FSDP too: run as DDP it would not fit."""
    plan = fsdp_plans["last"]
    assert plan.setting is None and plan.parallel == "fsdp"
    assert export(plan, "hf")["fsdp"] == "full_shard"
    assert export(plan, "deepspeed")["zero_optimization"] == {"stage": 3}
    assert export(plan, "accelerate")["config"]["distributed_type"] == "FSDP"
    assert export(plan, "lightning")["trainer"]["strategy"] == "fsdp"
    assert not any(n.startswith("setting:") for n in setting_notes(plan, "hf"))  # no setting was searched


def test_a_plan_syncing_fsdp_after_every_micro_step_says_so_to_hf_and_accelerate(fsdp_plans) -> None:
    """Accelerate, and the HF Trainer through it, defer the sync to the last micro-step unless told; a plan that
    fits only syncing after every micro-step says so (sync_each_batch); one that syncs at the last does not."""
    every, last = fsdp_plans["every"], fsdp_plans["last"]
    assert every.fsdp_sync == "every" and last.fsdp_sync == "last"
    hf = export(every, "hf")
    assert hf["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    assert "accelerator_config" not in export(last, "hf")
    accelerate = export(every, "accelerate")
    assert accelerate["gradient_accumulation_plugin"] == {"num_steps": every.accumulation_steps,
                                                          "sync_each_batch": True}
    assert "gradient_accumulation_steps" not in accelerate["accelerator"]  # the plugin holds them
    assert any("GradientAccumulationPlugin(**" in n for n in setting_notes(every, "accelerate"))
    assert "gradient_accumulation_plugin" not in export(last, "accelerate")
    for fmt in ("lightning", "deepspeed"):  # each reduce-scatters after every micro-step: "last" is a bound there
        assert any("after every micro-step" in n for n in setting_notes(last, fmt)), fmt
        assert not any("after every micro-step" in n for n in setting_notes(every, fmt)), fmt


@pytest.mark.slow  # transformers' and accelerate's imports
def test_hf_trainer_and_accelerate_take_the_sync_after_every_micro_step(fsdp_plans, tmp_path) -> None:
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    plan = fsdp_plans["every"]
    hf = export(plan, "hf")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                                          **{k: v for k, v in hf.items() if not k.startswith("fsdp")})
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
    data = export(plan, "accelerate")
    accelerator = Accelerator(cpu=True, **data["accelerator"], gradient_accumulation_plugin=GradientAccumulationPlugin(
        **data["gradient_accumulation_plugin"]))
    assert accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is True
    assert accelerator.gradient_accumulation_steps == plan.accumulation_steps
