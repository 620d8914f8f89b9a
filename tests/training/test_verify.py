"""Verification catches the faults it exists for, and passes the correct runner."""

from __future__ import annotations

import copy

import pytest
import torch

from autotune.planning.planner import make_plan
from autotune.training import MixedPrecision, NoiseScale
from autotune.training.accumulate import Accumulator
from autotune.training.verify import count_check, gradient_check, memory_check
from autotune.workload import load_workload

from .accumulators import ClipsEveryMicroStep, CountsASampleTwice, DropsASample, NaiveOneOverK, PerSequenceMeans


def check(workload, sizes, accumulation=Accumulator, max_norm=None, seed=0, precision="fp32"):
    """The gradient check of ``accumulation`` (autotune's, or a planted fault) over a copy of a fresh model."""
    torch.manual_seed(seed)
    model = workload.model()
    batch = workload.batch(sum(sizes), torch.Generator().manual_seed(seed))
    trained = copy.deepcopy(model)
    acc = accumulation(trained, torch.optim.SGD(trained.parameters(), lr=0.0), sizes, loss=workload.loss,
                       items=workload.items, max_norm=max_norm,
                       parts=[NoiseScale(measure=False), MixedPrecision(precision)])
    return gradient_check(acc, model, batch)


def test_correct_accumulation_passes_uniform_uneven_and_token_weighted(mlp, gpt):
    for workload, sizes in [(mlp, make_plan(1024, 300).schedule[0]), (mlp, make_plan(1021, 300).schedule[0]),
                            (gpt, [5, 5, 6])]:
        result = check(workload, sizes)
        assert result.passed, result.message
        assert result.value < 1e-6  # ~1e-7 in fp32 against fp64
        assert "relative error" in result.message


@pytest.mark.parametrize("fault,workload,sizes,words", [
    (NaiveOneOverK, "mlp", (255, 255, 255, 256), "do not add up"),
    (PerSequenceMeans, "gpt", (5, 5, 6), "do not add up"),
    (DropsASample, "mlp", (30, 30, 34), "do not add up"),
    (CountsASampleTwice, "mlp", (30, 30, 34), "do not add up"),
])
def test_planted_faults_are_caught(fault, workload, sizes, words):
    result = check(load_workload(workload), list(sizes), accumulation=fault)
    assert not result.passed and result.value > result.limit
    assert words in result.message


def test_clipping_every_micro_step_is_caught(mlp):
    sizes = [40, 40, 48]
    assert check(mlp, sizes, max_norm=0.05).passed
    result = check(mlp, sizes, accumulation=ClipsEveryMicroStep, max_norm=0.05)
    assert not result.passed and "do not add up" in result.message


def test_fp16_on_the_cpu_is_held_to_its_own_rounding_and_still_catches_a_wrong_weighting(mlp):
    # R17: the mlp's ReLUs make fp16 rounding alone move its gradient by ~1.4e-2 (one pass, no accumulation at
    # all), above the table's 1e-2; the limit is twice that rounding, measured, and a wrong weighting stays caught.
    for sizes in ([128] * 4, [80, 81], [384, 128]):
        good = check(mlp, sizes, precision="fp16")
        assert good.passed, good.message
        assert good.limit > 1e-2 and good.details["rounding"] > 1e-2
        assert "one fp16 pass" in good.message
    bad = check(mlp, [384, 128], accumulation=NaiveOneOverK, precision="fp16")
    assert not bad.passed and bad.value > 10 * bad.limit and "do not add up" in bad.message
    dropped = check(mlp, [128] * 4, accumulation=DropsASample, precision="fp16")
    assert not dropped.passed and "do not add up" in dropped.message
    assert check(mlp, [128] * 4, precision="bf16").passed


def test_naive_weighting_is_right_when_sizes_and_items_are_equal(mlp):
    # 1/k equals n_i/N for equal micro-batches of samples: the check does not cry wolf.
    assert check(mlp, [64, 64, 64, 64], accumulation=NaiveOneOverK).passed


def test_batchnorm_is_named_with_the_difference_and_fixes():
    convnet = load_workload("convnet")
    result = check(convnet, [8, 8])
    assert not result.passed and result.value > 1e-3
    assert "BatchNorm2d" in result.message and "GroupNorm" in result.message
    assert result.details["running_statistics"]
    assert check(convnet, [16]).passed  # one micro-batch: nothing to differ


def test_dropout_is_disabled_for_the_check_and_said(gpt):
    result = check(gpt, [4, 4])
    assert result.passed and "dropout disabled for this check only" in result.details["dropout"]


def test_the_check_leaves_the_accumulator_training_and_the_model_as_they_were(gpt):
    torch.manual_seed(0)
    model = gpt.make_model()
    before = [p.detach().clone() for p in model.parameters()]
    trained = copy.deepcopy(model).train()
    acc = Accumulator(trained, torch.optim.SGD(trained.parameters(), lr=0.1), [3, 5], loss=gpt.loss,
                      items=gpt.items, parts=[NoiseScale(measure=False)])
    assert gradient_check(acc, model, gpt.make_batch(8, torch.Generator().manual_seed(0))).passed
    assert all(m.training for m in trained.modules())  # dropout back on for training
    assert all(p.grad is None for p in trained.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_memory_check():
    assert memory_check(90, 100, 90).passed
    over = memory_check(120, 100, 90)
    assert not over.passed and "over budget" in over.message and "1.333" in over.message


def test_count_check_names_the_step():
    assert count_check([(64, 64), (64, 64)], 64, [64, 64]).passed
    bad = count_check([(64, 64), (63, 63)], 64, [64, 64])
    assert not bad.passed and "step 2 consumed 63 samples" in bad.message and "dropped or counted twice" in bad.message


def test_the_on_device_reference_catches_the_same_faults(mlp, monkeypatch):
    # Models too big for a float64 copy are checked against a different partition of the same samples.
    import autotune.training.verify as verify

    monkeypatch.setattr(verify, "FP64_REFERENCE_LIMIT", 0)
    sizes = [255, 255, 255, 256]
    good = check(mlp, sizes)
    assert good.passed and "different partition" in good.details["reference"]
    bad = check(mlp, sizes, accumulation=NaiveOneOverK)
    assert not bad.passed and "do not add up" in bad.message


class TwiceTheWeight(Accumulator):
    """Fault: every micro-step weighted twice its share, in whatever partition."""

    def weight(self, n_items, total_items):
        return 2 * super().weight(n_items, total_items)


def test_the_on_device_reference_is_autotunes_accumulation_not_the_one_under_test(mlp, monkeypatch):
    # A fault that is wrong the same way in every partition would agree with itself.
    import autotune.training.verify as verify

    monkeypatch.setattr(verify, "FP64_REFERENCE_LIMIT", 0)
    bad = check(mlp, [30, 30, 34], accumulation=TwiceTheWeight)
    assert not bad.passed and bad.value == pytest.approx(1.0, rel=1e-4)
