"""A Plan as the batch settings of a training framework, as a JSON object.

Frameworks run equal micro-batches, so an uneven plan exported to one gives
``micro_batch x k x W`` samples per optimizer step instead of the target; the
export says so, with the numbers, every time. No torch here.
"""

from __future__ import annotations

from typing import Any

from ..errors import BadInput, PlanError
from ..results.plan import Plan
from ..units import plural as _plural
from .planner import make_plan, nearest_uniform_targets

#: Every ``--format``: "table" and "json" are printed by the CLI, the rest by ``export``.
FORMATS = ("table", "json", "hf", "lightning", "deepspeed", "accelerate")
FRAMEWORKS = FORMATS[2:]

NAMES = {
    "hf": "The Hugging Face Trainer",
    "lightning": "Lightning",
    "deepspeed": "DeepSpeed",
    "accelerate": "Accelerate",
}


def _settings(plan: Plan, fmt: str) -> dict[str, Any]:
    micro, steps = plan.micro_batch, plan.accumulation_steps
    if fmt == "hf":
        return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": steps}
    if fmt == "lightning":
        return {"accumulate_grad_batches": steps, "batch_size": micro}
    if fmt == "deepspeed":
        # DeepSpeed checks train_batch_size == micro x gradient_accumulation_steps x world size.
        return {"train_batch_size": micro * steps * plan.world_size, "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": steps}
    return {"gradient_accumulation_steps": steps}


def _uniform(plan: Plan, target: int) -> str | None:
    """The arithmetic of the uniform plan for ``target`` under the plan's limits, if there is one."""
    try:
        return make_plan(target, plan.max_micro_batch, world_size=plan.world_size, multiple_of=plan.multiple_of,
                         uniform=True).arithmetic
    except PlanError:
        return None


def _uneven_warning(plan: Plan, fmt: str) -> str:
    exported = plan.micro_batch * plan.accumulation_steps * plan.world_size
    below, above = nearest_uniform_targets(plan.target_batch, plan.max_micro_batch,
                                           world_size=plan.world_size, multiple_of=plan.multiple_of)
    targets = [text for t in (below, above) if t is not None and (text := _uniform(plan, t)) is not None]
    same = _uniform(plan, plan.target_batch)
    fix = f"re-plan with --uniform for {same}, " if same else ""
    return (
        f"{NAMES[fmt]} runs equal micro-batches: these settings give an effective batch of {exported} "
        f"({plan.micro_batch} x {_plural(plan.accumulation_steps, 'step')} x {_plural(plan.world_size, 'rank')}), "
        f"not the target {plan.target_batch} ({plan.arithmetic}); run the plan with autotune's runner, which "
        f"weights uneven micro-batches exactly, {fix}or plan a target that divides evenly: {' or '.join(targets)}"
    )


def export(plan: Plan, fmt: str) -> tuple[dict[str, Any], list[str]]:
    """(the framework's settings as a JSON object, warnings for stderr, one line each)."""
    if fmt not in FRAMEWORKS:
        raise BadInput(f"unknown export format {fmt!r}: choose one of {', '.join(FRAMEWORKS)} "
                       "(table and json are printed by autotune plan --format)")
    warnings = [] if plan.uniform else [_uneven_warning(plan, fmt)]
    return _settings(plan, fmt), warnings
