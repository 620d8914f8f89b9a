"""A Plan as the batch settings of a training framework, as a JSON object that pastes.

    hf          TrainingArguments(output_dir=..., **data); for a model by name (--model), the settings that
                train it as planned: TrainingArguments(output_dir=..., **data["training_arguments"]),
                from_pretrained(name, **data["from_pretrained"]), LoraConfig(**data["lora_config"])
    lightning   Trainer(**data["trainer"]); your DataModule(**data["datamodule"]) (or its batch_size)
    accelerate  Accelerator(**data["accelerator"]); DataLoader(dataset, **data["dataloader"])
    deepspeed   the batch keys of a DeepSpeed config (train_batch_size = micro x steps x ranks)

Frameworks run equal micro-batches, so only a uniform plan exports: an uneven
one would give ``micro_batch x k x W`` samples per optimizer step instead of the
target, and they take one per-device batch size, so a plan that gives ranks that
differ their own (``mixed``) does not export either. :func:`no_equal_split` says,
in a caller's own terms, which targets near an unsplittable one do split. No torch here.
"""

from __future__ import annotations

from typing import Any

from ..errors import BadInput, NoUniformPlan, PlanError, RanksDiffer
from ..results.model import is_model_spec, trainer_settings
from ..results.plan import Plan
from .mixed import how_ranks_differ, ranks_differ_error
from .planner import uniform_options, uniform_range
from .setting_exports import with_setting

#: Every ``--format``: "table" and "json" are printed by the CLI, the rest by ``export``.
FORMATS = ("table", "json", "hf", "lightning", "deepspeed", "accelerate")
FRAMEWORKS = FORMATS[2:]

NAMES = {
    "hf": "the Hugging Face Trainer",
    "lightning": "Lightning",
    "deepspeed": "DeepSpeed",
    "accelerate": "Accelerate",
}


def _settings(plan: Plan, fmt: str) -> dict[str, Any]:
    micro, steps = plan.micro_batch, plan.accumulation_steps
    if fmt == "hf" and plan.probe is not None and is_model_spec(plan.probe.source):
        return trainer_settings(str(plan.probe.source), micro, steps)
    if fmt == "hf":
        return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": steps}
    if fmt == "lightning":
        # The batch size belongs to the DataLoader, which the DataModule (or the LightningModule) builds.
        return {"trainer": {"accumulate_grad_batches": steps}, "datamodule": {"batch_size": micro}}
    if fmt == "deepspeed":
        # DeepSpeed checks train_batch_size == micro x gradient_accumulation_steps x world size.
        return {"train_batch_size": micro * steps * plan.world_size, "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": steps}
    return {"accelerator": {"gradient_accumulation_steps": steps}, "dataloader": {"batch_size": micro}}


def export(plan: Plan, fmt: str) -> dict[str, Any]:
    """The framework's settings for ``plan``, as a JSON object; PlanError for an uneven plan."""
    if fmt not in FRAMEWORKS:
        raise BadInput(f"unknown export format {fmt!r}: choose one of {', '.join(FRAMEWORKS)} "
                       "(table and json are printed by autotune plan --format)")
    if plan.mixed is not None:
        how = how_ranks_differ([r.max_micro_batch for r in plan.mixed.ranks])
        raise PlanError(f"{NAMES[fmt]} takes one per-device batch size, and this plan gives each rank its own "
                        f"({how}): plan again with {{uniform_ranks=True}} for the "
                        "smallest-for-all plan, or run it with autotune's runner or Accumulator")
    if not plan.uniform:
        raise PlanError(f"{NAMES[fmt]} runs equal micro-batches, and this plan's are not ({plan.arithmetic}): "
                        "plan again with {uniform=True}, or run it with autotune's runner or Accumulator, which "
                        "weight uneven micro-batches exactly")
    return with_setting(_settings(plan, fmt), plan, fmt)


def ranks_differ(error: RanksDiffer, fmt: str) -> PlanError:
    """``error`` (equal micro-batches asked for on ranks that differ) in the command line's terms: a framework's
    one per-device batch size, or ``--uniform``; the fix is ``--uniform-ranks``."""
    asked = (f"{NAMES[fmt]} takes one per-device batch size" if fmt in NAMES else
             "--uniform asks for equal micro-batches on every rank")
    return ranks_differ_error(error.maxima, asked, fix="--uniform-ranks",
                              drop=f"drop --format {fmt}" if fmt in NAMES else "drop --uniform")


def no_equal_split(error: NoUniformPlan, fmt: str, *, target_name: str = "target",
                   force: str | None = None) -> PlanError:
    """``error`` as a framework's user reads it: the nearest targets that split into equal micro-batches,
    named as the caller names the target (``target_batch``), and how to force the split when the caller
    can (``--uniform``)."""
    numbers = dict(world_size=error.world_size, multiple_of=error.multiple_of)
    nearest, forced = uniform_options(error.target, error.max_micro_batch, **numbers)
    fixes = f"use {target_name} {' or '.join(nearest)}" if nearest else f"use another {target_name}"
    if force is not None and forced is not None:
        fixes += f", or {force} to force equal micro-batches: {forced}"
    return PlanError(
        f"{NAMES[fmt]} runs equal micro-batches, and {target_name} {error.target} does not split into "
        f"{uniform_range(error.target, error.max_micro_batch, **numbers)} (micro-batches of at least about half "
        f"the {error.max_micro_batch} that fit): {fixes}")
