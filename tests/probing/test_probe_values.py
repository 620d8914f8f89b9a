"""The probe on the training setups people run most (tests/realistic.py), where the batch's values decide shapes
and control flow: padded Hugging Face models (transformers reads the padding mask), packed sequences, CTC with
tensor lengths, and routing that depends on parameters. The estimate answers from the batch's values (or an upper
bound), and the user pays what the rule promises: real runs and out-of-memory errors are counted."""

from __future__ import annotations

import functools
import warnings

import pytest

from autotune.devices import get_device
from autotune.probing.finder import find_max_micro_batch
from autotune.probing.fitrule import run_trial

from .. import realistic

pytestmark = pytest.mark.slow

EXACT = ["hf-llama-padded", "hf-gpt2-padded", "hf-t5-padded", "peft-lora-qwen2", "packed-gru", "ctc"]

#: Smaller than tests/realistic.py's: the GRU's estimate walks every time step, so its sequences here are 4 to 20
#: tokens (not 40), under a budget where the search ends at micro-batch 38 (3 MiB) rather than 97 (12 MiB); the
#: batch's lengths decide its shapes alike.
BUILDS = {"packed-gru": (functools.partial(realistic.packed_gru, longest=20), 3 << 20)}


def _build(name: str):
    build, budget, category = realistic.CASES[name]
    build, budget = BUILDS.get(name, (build, budget))
    if name.startswith("peft") and not realistic.has_peft():
        pytest.skip("peft is not installed (it is in the test extra)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(), get_device("cpu", memory_budget=budget), category


def _fits(workload, device, result, batch: int) -> bool:
    """Does ``batch`` fit for real (from the probe's own real run when it made one there)?"""
    for t in result.trials:
        if t.source == "real" and t.batch == batch:
            return t.fits
    return run_trial(device, workload, batch, result.usable_bytes, source="real", capacity_guard=False).fits


def _misses(result) -> int:
    """Real runs that did not fit (an out-of-memory error, or a peak over the usable memory)."""
    return sum(not t.fits for t in result.trials if t.source == "real")


def _assert_the_max(workload, device, result) -> None:
    answer = result.max_micro_batch
    assert _fits(workload, device, result, answer) and not _fits(workload, device, result, answer + 1), answer


@pytest.mark.parametrize("name", EXACT)
def test_the_estimate_from_the_batchs_values_is_the_real_peak(name):
    workload, device, _ = _build(name)
    estimator = device.estimator()
    for batch in (5, 17):
        estimated = run_trial(estimator, workload, batch, 2**40, source="estimate")
        real = run_trial(device, workload, batch, 2**40, source="real", capacity_guard=False)
        assert estimated.peak_bytes == real.peak_bytes, (name, batch)
        assert estimated.measurement.unknown_reads == 0


@pytest.mark.parametrize("name", EXACT)
def test_setups_whose_shapes_come_from_the_batch_take_two_real_runs_and_no_miss(name):
    workload, device, _ = _build(name)
    result = find_max_micro_batch(workload, device, max_batch=4096)
    assert result.real_runs <= 2 and _misses(result) == 0, [(t.batch, t.fits) for t in result.trials]
    _assert_the_max(workload, device, result)
    assert any("values computed from the batch alone answered" in n for n in result.notes), result.notes
    assert not any("not trusted" in n or "the estimate cannot run" in n for n in result.notes), result.notes


def test_parameter_routing_is_estimated_at_its_bound_within_four_real_runs():
    workload, device, _ = _build("moe")
    result = find_max_micro_batch(workload, device, max_batch=4096)
    assert result.real_runs <= 4 and _misses(result) <= 1, [(t.batch, t.fits) for t in result.trials]
    _assert_the_max(workload, device, result)
    assert any("upper bound" in n and "nonzero" in n for n in result.notes), result.notes
