"""Identical blocks estimated through the model cut to 2, 3 and 4 of them: exact to the byte, or not taken."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import autotune
from autotune.devices import get_device
from autotune.probing import trials
from autotune.probing.blockreplay import replayed_trial
from autotune.probing.blocks import MIN_BLOCKS, identical_blocks
from autotune.probing.blocktrace import canonical
from autotune.probing.fitrule import isolate, run_trial
from autotune.probing.fsdp import Sharding
from autotune.probing.stepreuse import OptimizerSteps
from autotune.workload import Workload
from probes import gpt

from .blockmodels import BIG
from .blockmodels import gpt_blocks as _gpt
from .blockmodels import llama_blocks as _llama


def _both(workload: Workload, batch: int, sharding: Sharding | None = None, device: str = "estimate:H100-80GB",
          identical: bool = True, steps: OptimizerSteps | None = None):
    """The whole model's estimate at ``batch`` and the replayed one (None where it was not taken); with
    ``identical=False`` the blocks may differ, and where nothing is replayed there is nothing to compare: (None,
    None), the whole model not evaluated. ``steps``: the replayed one's optimizer steps, as a probe keeps them from
    size to size."""
    workload = isolate(workload)
    with torch.device("meta"):
        blocks, why = identical_blocks(workload.make_model())
    assert blocks is not None or not identical, why
    estimate = get_device(device).estimator()
    replayed = None if blocks is None else replayed_trial(estimate, workload, blocks, batch, BIG, source="estimate",
                                                          sharding=sharding, optimizer_steps=steps)
    if replayed is None and not identical:
        return None, None
    full = run_trial(estimate, workload, batch, BIG, source="estimate", capacity_guard=False, sharding=sharding)
    return full.measurement, None if replayed is None else replayed.measurement


def _every_second_checkpointed() -> Workload:
    from autotune.probing.lowering import checkpointed

    return checkpointed(_gpt(layers=12), "blocks.*", every=2)


CASES = {
    "gpt": lambda: (_gpt(), None),
    "gpt, every 2nd block checkpointed (a group of 2 repeats), FSDP x4": lambda: (_every_second_checkpointed(),
                                                                                  Sharding(4)),
    "gpt, checkpointing": lambda: (_gpt(checkpointing=True), None),
    "gpt, FSDP x4": lambda: (_gpt(), Sharding(4)),
    "gpt, FSDP x4, sync every micro-step": lambda: (_gpt(), Sharding(4, sync_every=True)),
    "llama": lambda: (_llama(False), None),
    # a bf16 block's input dies once the next block returns (its RMSNorm saves a float32 copy, not the input)
    "llama, bf16 weights": lambda: (_llama(False, torch.bfloat16), None),
    "llama, checkpointing, FSDP x8": lambda: (_llama(True), Sharding(8)),
}


@pytest.mark.parametrize("case", [c if c == "gpt" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_the_replayed_estimate_is_the_whole_models_to_the_byte(case):
    """Trace, reserved and allocated peaks, live-bytes peak and its breakdown: the same as evaluating every
    block, with and without checkpointing and FSDP; at the second size with the cut models' optimizer steps made
    again from the first (:mod:`autotune.probing.stepreuse`), as a probe does."""
    if case.startswith("llama"):
        pytest.importorskip("transformers")
    workload, sharding = CASES[case]()
    steps = OptimizerSteps()
    for batch in (2, 5):
        full, replayed = _both(workload, batch, sharding, steps=steps)
        assert replayed is not None, f"{case} at {batch}: not replayed"
        assert canonical(replayed.trace, {}) == canonical(full.trace, {})
        assert (replayed.peak_bytes, replayed.allocated_peak_bytes, replayed.alloc_retries) == \
            (full.peak_bytes, full.allocated_peak_bytes, full.alloc_retries)
        assert replayed.tracked_peak_bytes == full.tracked_peak_bytes
        assert replayed.breakdown == full.breakdown
    assert steps.replayed == 6  # the 2-, 3- and 4-block models' two steps, at 5


def test_a_model_with_one_block_that_differs_is_not_replayed():
    model = _gpt().make_model()
    model.blocks[3].fc = nn.Linear(32, 96)  # one block's MLP narrower
    model.blocks[3].out = nn.Linear(96, 32)
    blocks, why = identical_blocks(model)
    assert blocks is None and why == "block 3 of blocks differs from block 0"


def test_a_block_with_a_setting_of_its_own_or_a_hook_is_not_replayed():
    model = _gpt().make_model()
    model.blocks[2].heads = 4
    assert identical_blocks(model) == (None, "block 2 of blocks differs from block 0")
    model = _gpt().make_model()
    model.blocks[4].fc.register_forward_hook(lambda *a: None)
    assert identical_blocks(model)[0] is None


def test_blocks_that_alternate_repeat_in_groups():
    from autotune.probing.lowering import checkpointed

    with torch.device("meta"):
        blocks, why = identical_blocks(checkpointed(_gpt(layers=12), "blocks.*", every=2).make_model())
    assert blocks is not None and (blocks.period, blocks.groups) == (2, 6), why
    assert str(blocks) == "12 Block blocks, repeating every 2"
    with torch.device("meta"):
        assert identical_blocks(checkpointed(_gpt(layers=12), "blocks.*", every=5).make_model())[0] is None


def test_each_blocks_own_index_is_not_a_difference():
    model = _gpt().make_model()
    for i, block in enumerate(model.blocks):
        block.layer_idx = i
    assert identical_blocks(model)[0] is not None


class _Odd(gpt.Block):
    """A block that does more work where its own index says so (what the signature cannot see)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_idx == 2:
            x = x + torch.zeros_like(x).repeat(1, 4, 1)[:, : x.shape[1]]
        return super().forward(x)


def _odd_model(c: gpt.Config) -> nn.Module:
    model = gpt.GPT(c)
    model.blocks = nn.ModuleList(_Odd(c) for _ in range(c.layers))
    for i, block in enumerate(model.blocks):
        block.layer_idx = i
    return model


def test_blocks_whose_work_differs_by_index_fall_back_to_the_whole_model():
    """The signature calls them identical; the cut traces do not repeat as one pattern, so nothing is taken."""
    c = gpt.Config(vocab=256, seq_len=16, d_model=32, heads=2, layers=6)
    workload = Workload(name="odd", model=functools.partial(_odd_model, c),
                        batch=functools.partial(gpt.make_batch, c=c), loss=gpt.loss)
    full, replayed = _both(workload, 2)
    assert full is not None and replayed is None


@pytest.mark.slow
def test_a_probe_replays_its_blocks_and_finds_what_the_whole_model_gives(monkeypatch):
    """The probe's estimate evaluations go through the cut models, with the same answer and peaks as
    evaluating every block (the planted switch: no blocks found)."""
    workload = _gpt(layers=6)  # (the fewest blocks a probe replays)
    found = autotune.probe(workload, device="estimate:A10G-24GB", memory_budget="1GiB")
    assert any("6 Block blocks estimated through the model cut to 2, 3 and 4 blocks" in note for note in found.notes)
    monkeypatch.setattr(trials, "found_blocks", lambda device, workload: None)  # (the planted switch)
    whole = autotune.probe(workload, device="estimate:A10G-24GB", memory_budget="1GiB")
    assert not any("estimated through the model cut" in note for note in whole.notes)
    assert found.max_micro_batch == whole.max_micro_batch
    assert {t.batch: t.peak_bytes for t in found.trials} == {t.batch: t.peak_bytes for t in whole.trials}


LAYERS = {"gpt2": "n_layer", "t5": "num_layers"}
SETTINGS = {"full": {}, "checkpointing, bf16-mixed": {"gradient_checkpointing": True, "dtype": "bf16-mixed"},
            "QLoRA (peft's adapters on NF4 base weights by shape)": {"lora": "r=4,alpha=8,bits=4"}}


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_model_by_name_is_replayed_to_the_byte_or_evaluated_whole(tmp_path, setting):
    """Each kind of Hugging Face model ``--model`` builds, with 6 layers (the fewest a replay takes): where its
    blocks replay, the estimate is the whole model's to the byte; where they do not (T5's first block holds the
    relative position bias; Gemma 2's layers alternate sliding and full attention; a pattern that does not rebuild
    the cut traces, as Mistral's at some settings), nothing is taken. The Llama and Qwen 2 kinds replay in every
    setting (the check is not vacuous)."""
    pytest.importorskip("transformers")
    from autotune.results.model import ModelSpec
    from autotune.workload import load_workload

    from ..workload.hf_configs import CONFIGS, write_config

    replayed = []
    for kind in CONFIGS:
        if setting != "full" and CONFIGS[kind][3] != "causal-lm":
            continue
        layers = {LAYERS.get(kind, "num_hidden_layers"): MIN_BLOCKS, "layer_types": None}  # (made again for them)
        folder = write_config(tmp_path / kind, kind, **layers)
        spec = ModelSpec(name=str(folder), seq_len=None if kind == "vit" else 16, **SETTINGS[setting])
        full, rebuilt = _both(load_workload(spec.spec()), 2, identical=False)
        if rebuilt is None:
            continue
        replayed.append(kind)
        assert canonical(rebuilt.trace, {}) == canonical(full.trace, {}), kind
        assert (rebuilt.peak_bytes, rebuilt.allocated_peak_bytes, rebuilt.tracked_peak_bytes, rebuilt.breakdown) == \
            (full.peak_bytes, full.allocated_peak_bytes, full.tracked_peak_bytes, full.breakdown), kind
    assert {"llama", "qwen2"} <= set(replayed), replayed


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_micro_steps_counts_through_the_cut_models_are_the_whole_models(checkpointing, monkeypatch):
    """The roofline's FLOPs, bytes and ops of a micro-step, taken on the line through the model cut to 2, 3 and
    4 blocks, equal counting the whole model; blocks whose work differs by index are counted whole."""
    from autotune.devices.roofline import count_micro_step
    from autotune.probing import blockcounts

    device = get_device("estimate:H100-80GB")
    workload = isolate(_gpt(layers=7, checkpointing=checkpointing))
    counted: list[int] = []
    monkeypatch.setattr(blockcounts, "count_micro_step", lambda w, d, b: counted.append(b) or count_micro_step(w, d, b))
    assert blockcounts.counted_micro_step(workload, device, 3) == count_micro_step(workload, device, 3)
    assert len(counted) == 3  # the three cut models, not the whole one
    c = gpt.Config(vocab=256, seq_len=16, d_model=32, heads=2, layers=7)
    odd = isolate(Workload(name="odd", model=functools.partial(_odd_model, c),
                           batch=functools.partial(gpt.make_batch, c=c), loss=gpt.loss))
    counted.clear()
    assert blockcounts.counted_micro_step(odd, device, 3) == count_micro_step(odd, device, 3)
    assert len(counted) == 4  # the cut models' counts are no line: the whole model counted
