"""The fixes a refusal of micro-batch 1 names: none that the model already has."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autotune import api
from autotune.errors import DoesNotFit
from autotune.probing.fixes import fixes
from autotune.probing.lowering import checkpointed
from probes import gpt

from .blockmodels import llama_blocks

ALL = ("use bf16, enable activation checkpointing, shrink the model or the sequence length, or use a device with more "
       "memory")


def _refused(workload) -> str:
    with pytest.raises(DoesNotFit) as info:
        api.probe(workload, device="estimate", memory_budget="641MiB")
    return str(info.value)


def test_an_fp32_model_without_checkpointing_is_told_every_fix():
    said = _refused(gpt.build())
    assert said.endswith(f": {ALL}"), said
    assert fixes(gpt.build()) == ALL


def test_a_bf16_model_is_not_told_to_use_bf16():
    said = _refused(replace(gpt.build(), model=lambda: gpt.build().make_model().to(torch.bfloat16)))
    assert said.endswith(": enable activation checkpointing, shrink the model or the sequence length, or use a "
                         "device with more memory"), said


@pytest.mark.parametrize("how", ["Hugging Face's gradient_checkpointing_enable", "a module's checkpointing flag",
                                 "autotune's checkpointed blocks"])
def test_a_model_already_checkpointed_is_not_told_to_checkpoint(how):
    pytest.importorskip("transformers")
    workload = {"Hugging Face's gradient_checkpointing_enable": lambda: llama_blocks(True),
                "a module's checkpointing flag": lambda: gpt.build().configure(checkpointing=True),
                "autotune's checkpointed blocks": lambda: checkpointed(gpt.build(), "blocks.*")}[how]()
    assert fixes(workload) == "use bf16, shrink the model or the sequence length, or use a device with more memory"
    bf16 = llama_blocks(True, torch.bfloat16)
    assert fixes(bf16) == "shrink the model or the sequence length, or use a device with more memory"


def test_a_model_that_cannot_be_built_on_meta_is_told_every_fix():
    def model() -> torch.nn.Module:
        raise RuntimeError("builds only on a real device")

    assert fixes(replace(gpt.build(), model=model)) == ALL


def test_a_refusal_works_out_its_fixes_only_when_its_message_is_read(monkeypatch):
    """A settings search reads only the facts of each setting's refusal: none of them builds the model for its
    fixes; the refusal read (or sent to another process) says them."""
    import pickle

    from autotune.probing import finder

    built: list[object] = []
    real = finder.fixes
    monkeypatch.setattr(finder, "fixes", lambda workload: built.append(workload) or real(workload))
    with pytest.raises(DoesNotFit) as info:
        api.probe(gpt.build(), device="estimate", memory_budget="641MiB")
    refusal = info.value
    assert refusal.facts.startswith("micro-batch 1 needs") and refusal.needed and built == []
    again = pickle.loads(pickle.dumps(refusal))
    assert str(again) == str(refusal) == f"{refusal.facts}: {ALL}" and len(built) == 1
    assert (again.facts, again.needed) == (refusal.facts, refusal.needed)
