"""The framework settings that apply a settings search's chosen setting (or a plain FSDP plan's sharding and
gradient sync), beside the batch settings of :mod:`autotune.planning.exports`, and what a framework's JSON
cannot hold, said in words.

    hf          gradient_checkpointing (+ every_n_layers), fsdp "full_shard" with FSDP2 ("full_shard offload" and
                fsdp_config cpu_offload for CPU offload), accelerator_config's sync_each_batch where FSDP's
                gradients are reduce-scattered after every micro-step, bf16
    lightning   trainer.strategy "fsdp" / "ddp" / "fsdp_cpu_offload", trainer.precision "bf16-mixed";
                checkpointing for the module
    accelerate  accelerator.mixed_precision; accelerate config's FSDP2 keys (fsdp_activation_checkpointing,
                fsdp_offload_params); a GradientAccumulationPlugin's keys (sync_each_batch) for FSDP's gradients
                reduce-scattered after every micro-step
    deepspeed   ZeRO stage 3 for FSDP (offload_optimizer and offload_param to the CPU for offload), bf16

Checkpointing of every k-th block, LoRA and the allocator setting have no key in some of them: the notes say how
to apply them. No torch here.
"""

from __future__ import annotations

from typing import Any

from ..results.plan import Plan
from ..results.search import TrainSetting


def setting_of(plan: Plan) -> TrainSetting | None:
    """How ``plan`` trains beyond its batch: the setting a settings search chose, else a plain FSDP plan's
    sharding and gradient sync (None: plain DDP, nothing to add)."""
    if plan.setting is not None:
        return plan.setting
    return TrainSetting(parallel="fsdp", fsdp_sync=plan.fsdp_sync) if plan.parallel == "fsdp" else None


def with_setting(data: dict[str, Any], plan: Plan, fmt: str) -> dict[str, Any]:
    """``data`` (a framework's batch settings for ``plan``) with the keys that apply its setting (see
    :func:`setting_of`)."""
    s = setting_of(plan)
    if s is None:
        return data
    if fmt == "hf":
        return {**data, **_hf(s)}
    if fmt == "lightning":
        trainer = dict(data["trainer"])
        if s.parallel == "fsdp" or plan.world_size > 1:  # Lightning's registered FSDPStrategy(cpu_offload=True)
            trainer["strategy"] = "fsdp_cpu_offload" if s.offload else s.parallel
        if "bf16-mixed" in s.changes:
            trainer["precision"] = "bf16-mixed"
        extra: dict[str, Any] = {"checkpointing": {"blocks": s.blocks, "every_n_layers": s.checkpoint_every}} \
            if s.checkpoint_every else {}
        return {**data, "trainer": trainer, **extra}
    if fmt == "accelerate":
        accelerator = dict(data["accelerator"])
        if "bf16-mixed" in s.changes:
            accelerator["mixed_precision"] = "bf16"
        extra = {"config": {"distributed_type": "FSDP", "fsdp_config": {
            "fsdp_version": 2, "fsdp_reshard_after_forward": True,
            "fsdp_activation_checkpointing": bool(s.checkpoint_every),
            **({"fsdp_offload_params": True} if s.offload else {})}}} if s.parallel == "fsdp" else {}
        if s.fsdp_sync == "every":  # Accelerate defers the sync to the last micro-step unless its plugin says so
            extra["gradient_accumulation_plugin"] = {"num_steps": accelerator.pop("gradient_accumulation_steps"),
                                                     "sync_each_batch": True}
        return {**data, "accelerator": accelerator, **extra}
    out = dict(data)
    if s.parallel == "fsdp":
        out["zero_optimization"] = {"stage": 3, **({"offload_optimizer": {"device": "cpu"},
                                                    "offload_param": {"device": "cpu"}} if s.offload else {})}
    if "bf16-mixed" in s.changes:
        out["bf16"] = {"enabled": True}
    return out


def _hf(s: TrainSetting) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s.checkpoint_every:
        out["gradient_checkpointing"] = True
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False, **(
            {"every_n_layers": s.checkpoint_every} if s.checkpoint_every > 1 else {})}
    if s.parallel == "fsdp":
        out["fsdp"] = "full_shard offload" if s.offload else "full_shard"
        out["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                              **({"cpu_offload": True} if s.offload else {})}
    if s.fsdp_sync == "every":  # the Trainer's Accelerator defers the sync to the last micro-step unless told
        out["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    if "bf16-mixed" in s.changes:
        out["bf16"] = True
    return out


def setting_notes(plan: Plan, fmt: str) -> list[str]:
    """What of ``plan.setting`` the framework's JSON does not hold, and how to apply it."""
    s = setting_of(plan)
    if s is None:
        return []
    notes = [f"setting: {s.label}"] if plan.setting is not None else []
    if s.fsdp_sync == "every" and fmt == "accelerate":
        notes.append("FSDP's gradients are reduce-scattered after every micro-step, as planned: "
                     "Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(**out["
                     "'gradient_accumulation_plugin']), **out['accelerator']), GradientAccumulationPlugin from "
                     "accelerate.utils")
    if s.fsdp_sync == "last" and fmt in ("lightning", "deepspeed"):
        notes.append(f"{'Lightning' if fmt == 'lightning' else 'DeepSpeed ZeRO 3'} reduce-scatters the gradients "
                     "after every micro-step, not at the last only as planned: it holds less than the plan's peak "
                     "and communicates more (plan with fsdp_sync every for its own figures)")
    if s.allocator:
        notes.append(f"set PYTORCH_CUDA_ALLOC_CONF={s.allocator} in the training process's environment")
    if "lora" in s.changes:
        notes.append("LoRA: wrap the model with peft (LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, "
                     "target_modules='all-linear')), as the estimate did")
    if "bf16" in s.changes:
        notes.append("bf16 weights: build the model with torch_dtype=torch.bfloat16")
    if s.checkpoint_every and fmt == "lightning":
        notes.append("checkpointing: in configure_model, autotune.probing.lowering.checkpoint_blocks("
                     f"self, {s.blocks!r}, "
                     f"every={s.checkpoint_every})")
    if s.checkpoint_every and fmt == "deepspeed":
        notes.append(f"checkpointing: wrap {s.blocks} (every {s.checkpoint_every}) with "
                     "deepspeed.checkpointing.checkpoint, or autotune.probing.lowering.checkpoint_blocks")
    return notes
