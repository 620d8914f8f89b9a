"""The framework settings that apply a settings search's chosen setting, beside the batch settings of
:mod:`autotune.planning.exports`, and what a framework's JSON cannot hold, said in words.

    hf          gradient_checkpointing (+ every_n_layers), fsdp "full_shard" with FSDP2 ("full_shard offload" and
                fsdp_config cpu_offload for CPU offload), bf16
    lightning   trainer.strategy "fsdp" / "ddp" / "fsdp_cpu_offload", trainer.precision "bf16-mixed";
                checkpointing for the module
    accelerate  accelerator.mixed_precision; accelerate config's FSDP2 keys (fsdp_activation_checkpointing,
                fsdp_offload_params)
    deepspeed   ZeRO stage 3 for FSDP (offload_optimizer and offload_param to the CPU for offload), bf16

Checkpointing of every k-th block, LoRA and the allocator setting have no key in some of them: the notes say how
to apply them. No torch here.
"""

from __future__ import annotations

from typing import Any

from ..results.plan import Plan
from ..results.search import TrainSetting


def with_setting(data: dict[str, Any], plan: Plan, fmt: str) -> dict[str, Any]:
    """``data`` (a framework's batch settings for ``plan``) with the keys that apply ``plan.setting``."""
    s = plan.setting
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
    if "bf16-mixed" in s.changes:
        out["bf16"] = True
    return out


def setting_notes(plan: Plan, fmt: str) -> list[str]:
    """What of ``plan.setting`` the framework's JSON does not hold, and how to apply it."""
    s = plan.setting
    if s is None:
        return []
    notes = [f"setting: {s.label}"]
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
