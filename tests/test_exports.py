"""Framework exports: exact settings, and a warning whenever they would not give the target."""

from __future__ import annotations

import pytest

from autotune.errors import BadInput
from autotune.planning.exports import FORMATS, FRAMEWORKS, export
from autotune.planning.planner import make_plan

UNIFORM = make_plan(1024, 32, world_size=8)  # 1024 = 32 x 4 steps x 8 ranks


@pytest.mark.parametrize("fmt, expected", [
    ("hf", {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 4}),
    ("lightning", {"accumulate_grad_batches": 4, "batch_size": 32}),
    ("deepspeed", {"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 4}),
    ("accelerate", {"gradient_accumulation_steps": 4}),
])
def test_uniform_plan_exports_exactly(fmt, expected):
    assert UNIFORM.arithmetic == "1024 = 32 x 4 steps x 8 ranks"
    data, warnings = export(UNIFORM, fmt)
    assert data == expected
    assert warnings == []


def test_formats_cover_the_cli():
    assert FORMATS == ("table", "json", "hf", "lightning", "deepspeed", "accelerate")
    assert FRAMEWORKS == ("hf", "lightning", "deepspeed", "accelerate")


@pytest.mark.parametrize("fmt", FRAMEWORKS)
def test_uneven_plan_warns_with_both_numbers(fmt):
    plan = make_plan(1021, 300)  # 3 x 255 + 1 x 256
    data, warnings = export(plan, fmt)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    warning = warnings[0]
    assert "effective batch of 1024 (256 x 4 steps x 1 rank), not the target 1021" in warning
    assert "autotune's runner" in warning
    assert "1020 = 255 x 4 steps x 1 rank or 1022 = 146 x 7 steps x 1 rank" in warning
    assert data["gradient_accumulation_steps" if fmt != "lightning" else "accumulate_grad_batches"] == 4


def test_deepspeed_batch_identity_on_eight_ranks():
    plan = make_plan(1024, 48, world_size=8)  # 3 uneven steps of 42/43
    data, warnings = export(plan, "deepspeed")
    micro, steps = data["train_micro_batch_size_per_gpu"], data["gradient_accumulation_steps"]
    assert (micro, steps) == (43, 3)
    assert data["train_batch_size"] == micro * steps * 8 == 1032
    assert "effective batch of 1032" in warnings[0] and "not the target 1024" in warnings[0]
    assert "re-plan with --uniform for 1024 = 32 x 4 steps x 8 ranks" in warnings[0]


def test_deepspeed_uniform_on_eight_ranks_needs_no_warning():
    plan = make_plan(4096, 128, world_size=8)
    data, warnings = export(plan, "deepspeed")
    assert data == {"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 128, "gradient_accumulation_steps": 4}
    assert warnings == []


@pytest.mark.parametrize("fmt", ["table", "json", "yaml", "HF", ""])
def test_unknown_format_is_bad_input(fmt):
    with pytest.raises(BadInput, match=r"choose one of hf, lightning, deepspeed, accelerate"):
        export(UNIFORM, fmt)
