"""Framework exports: exact settings from plans of equal micro-batches, and the nearest targets when there is none.

The real constructors take these settings in tests/integrations/test_exports_paste.py.
"""

from __future__ import annotations

import pytest

from autotune.errors import BadInput, NoUniformPlan, PlanError
from autotune.planning.exports import export, no_equal_split
from autotune.planning.planner import make_plan

UNIFORM = make_plan(1024, 32, world_size=8)  # 1024 = 32 x 4 steps x 8 ranks


@pytest.mark.parametrize("fmt, expected", [
    ("hf", {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 4}),
    ("lightning", {"trainer": {"accumulate_grad_batches": 4}, "datamodule": {"batch_size": 32}}),
    ("deepspeed", {"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 4}),
    ("accelerate", {"accelerator": {"gradient_accumulation_steps": 4}, "dataloader": {"batch_size": 32}}),
])
def test_uniform_plan_exports_exactly(fmt, expected):
    assert UNIFORM.arithmetic == "1024 = 32 x 4 steps x 8 ranks"
    assert export(UNIFORM, fmt) == expected


@pytest.mark.parametrize("fmt", ["hf", "lightning", "deepspeed", "accelerate"])
def test_an_uneven_plan_does_not_export(fmt):
    plan = make_plan(1021, 300)  # 3 x 255 + 1 x 256: any framework would run 256 x 4 = 1024
    with pytest.raises(PlanError, match=r"runs equal micro-batches, and this plan's are not \(1021 = 3 x 255 \+ "
                                        r"1 x 256 over 4 steps x 1 rank\): plan again with uniform=True"):
        export(plan, fmt)


def test_deepspeed_batch_identity_on_eight_ranks():
    plan = make_plan(1024, 48, world_size=8, uniform=True)  # the fewest steps would be 3 uneven ones of 42/43
    data = export(plan, "deepspeed")
    micro, steps = data["train_micro_batch_size_per_gpu"], data["gradient_accumulation_steps"]
    assert (micro, steps) == (32, 4)
    assert data["train_batch_size"] == micro * steps * 8 == 1024


@pytest.mark.parametrize("fmt", ["table", "json", "yaml", "HF", ""])
def test_unknown_format_is_bad_input(fmt):
    with pytest.raises(BadInput, match=r"choose one of hf, lightning, deepspeed, accelerate"):
        export(UNIFORM, fmt)


def _no_uniform(target: int, m: int, **kw) -> NoUniformPlan:
    with pytest.raises(NoUniformPlan) as info:
        make_plan(target, m, uniform=True, **kw)
    return info.value


def test_no_equal_split_names_the_nearest_targets_in_the_callers_terms():
    error = _no_uniform(1021, 300)
    cli = str(no_equal_split(error, "hf", force="--uniform"))
    assert cli.startswith("the Hugging Face Trainer runs equal micro-batches, and target 1021 does not split into "
                          "equal micro-batches of at most 300 on 1 rank within 4..8 steps")
    assert ("use target 1020 (1020 = 255 x 4 steps x 1 rank) or 1022 (1022 = 146 x 7 steps x 1 rank), "
            "or --uniform to force equal micro-batches: 1021 = 1 x 1021 steps x 1 rank") in cli
    library = str(no_equal_split(error, "lightning", target_name="target_batch"))
    assert "target_batch 1021 does not split" in library and "use target_batch 1020 (" in library
    assert "--uniform" not in library and "force" not in library
    assert "\n" not in cli + library


def test_no_equal_split_on_several_ranks_with_a_multiple():
    error = _no_uniform(1021 * 8, 300, world_size=8, multiple_of=8)  # per rank 1021 units of 8: prime
    message = str(no_equal_split(error, "deepspeed", force="--uniform"))
    assert "equal micro-batches that are multiples of 8 of at most 300 on 8 ranks" in message
    for target in (t for t in message.split() if t.isdigit() and int(t) % 64 == 0 and int(t) > 8000):
        assert make_plan(int(target), 300, world_size=8, multiple_of=8, uniform=True).uniform
