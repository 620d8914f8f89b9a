"""The settings search on the CPU: settings whose costs differ measurably (checkpointing every block, every 2nd,
none, on a model of repeated blocks under a budget where the target batch fits one micro-step only with
checkpointing: without it, 2 micro-steps of 12). Whether the predicted order of samples/s is the measured one is
timed in ``bench/settings_order.py``, not here."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import autotune
from autotune.api import GivenObjects, plan_for
from autotune.devices import get_device
from autotune.planning.requests import plan_request
from autotune.probing.fitrule import run_trial
from autotune.probing.settings import apply
from autotune.results.search import SettingsAsk
from autotune.units import parse_size
from autotune.workload import Workload

WIDTH, TOKENS, BLOCKS, TARGET = 128, 16, 6, 24
BUDGET = "21MiB"
pytestmark = pytest.mark.slow  # real optimizer steps are timed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def stack() -> Workload:
    return Workload(name="stack", model=Stack,
                    batch=lambda n, g: torch.randn(n, TOKENS, WIDTH, generator=g),
                    loss=lambda m, x: m(x).pow(2).mean())


def searched(budget: str = BUDGET, target: int = TARGET, **ask: object) -> autotune.Plan:
    wl, dev = stack(), get_device("cpu", memory_budget=parse_size(budget))
    request = plan_request(target, probe=wl, device=dev, memory_budget=budget)
    return plan_for(replace(request, search=SettingsAsk(**ask)), given=GivenObjects(wl, dev))


@pytest.fixture(scope="module")
def plan() -> autotune.Plan:
    return searched(confirm=False)


def test_the_search_tries_checkpointing_and_ranks_by_predicted_samples_per_second(plan: autotune.Plan) -> None:
    rows = plan.settings
    assert [r.setting.checkpoint_every for r in rows if r.fits] == [0, 2, 1]  # recompute costs
    assert [r.max_micro_batch for r in rows] == sorted(r.max_micro_batch for r in rows)  # and fits more
    assert all(a.samples_per_second >= b.samples_per_second for a, b in zip(rows, rows[1:]))
    assert plan.setting == rows[0].setting and "fastest" in rows[0].why
    assert all("slower by" in r.why for r in rows[1:])


def test_the_chosen_plans_memory_is_the_estimates(plan: autotune.Plan) -> None:
    dev = get_device("cpu", memory_budget=parse_size(BUDGET))
    assert plan.probe is not None and plan.probe.estimated
    assert plan.setting is not None
    again = autotune.probe(apply(stack(), plan.setting, spec=None, cuda=False), device=dev.estimator())
    assert plan.predicted_peak_bytes == again.predicted_peak_at(plan.micro_batch) == plan.settings[0].peak_bytes


def test_no_setting_predicted_to_fit_runs_out_of_memory(plan: autotune.Plan) -> None:
    dev = get_device("cpu", memory_budget=parse_size(BUDGET))
    assert plan.probe is not None
    for row in plan.settings:
        trial = run_trial(dev, apply(stack(), row.setting, spec=None, cuda=False), row.micro_batch,
                          plan.probe.usable_bytes, source="real")
        assert trial.fits, (row.setting.label, trial.why)


def test_no_number_changing_setting_without_allow(plan: autotune.Plan) -> None:
    assert all(not r.setting.changes for r in plan.settings)
    allowed = searched(confirm=False, allow=("bf16-mixed",))
    assert {r.setting.changes for r in allowed.settings} == {(), ("bf16-mixed",)}


def test_unknown_allowed_names_are_refused() -> None:
    with pytest.raises(autotune.errors.BadInput, match="not a setting the search can allow"):
        SettingsAsk(allow=("fp8",))


def test_a_hugging_face_model_checkpointed_under_fsdp_is_estimated() -> None:
    """Its KV cache is off under checkpointing (as transformers turns it off), so the recompute sees what the forward
    saw: the estimate of FSDP with checkpointed decoder layers runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autotune.probing.lowering import checkpointed

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    wl = Workload(name="llama", model=lambda: LlamaForCausalLM(config),
                  batch=lambda n, g: torch.randint(0, 256, (n, 64), generator=g),
                  loss=lambda m, ids: m(input_ids=ids, labels=ids).loss)
    found = autotune.probe(checkpointed(wl, "model.layers.*"), device="estimate:H100-80GB", parallel="fsdp",
                           world_size=8, fsdp_sync="last", max_batch=2)
    assert found.max_micro_batch == 2


class Wide(nn.Module):
    """Three blocks of 2.1M parameters each: AdamW's state and gradients beside the parameters (16 bytes a
    parameter, 100 MB) exceed a GPU budget that holds two blocks in flight (too few blocks to replay: each
    setting's model is evaluated whole, which for so small a model is the cheaper)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
                                    for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_on_a_gpu_where_nothing_else_fits_offload_is_chosen_and_says_so() -> None:
    wl = Workload(name="wide", model=Wide, batch=lambda n, g: torch.randn(n, 4, 512, generator=g),
                  loss=lambda m, x: m(x).pow(2).mean())
    budget = "740MiB"  # 640 MiB of it a CUDA context's
    dev = get_device("estimate:A10G-24GB", memory_budget=parse_size(budget))
    request = plan_request(8, probe=wl, device=dev, memory_budget=budget)
    plan = plan_for(replace(request, search=SettingsAsk(confirm=False)), given=GivenObjects(wl, dev))
    assert plan.setting is not None and plan.setting.offload and plan.parallel == "fsdp"
    assert plan.settings[0].why.endswith("nothing fits without CPU offload")
    assert all(not r.fits for r in plan.settings[1:] if not r.setting.offload)
    assert plan.probe is not None and any("CPU offload" in n for n in plan.probe.notes)


def test_the_confirmation_does_not_time_an_fsdp_row_unsharded() -> None:
    from autotune.results.search import SettingRow, TrainSetting
    from autotune.training.settings_confirm import confirmed

    rows = [SettingRow(setting=TrainSetting(parallel="fsdp", fsdp_sync="every", offload=True), fits=True,
                       max_micro_batch=4, micro_batch=4, accumulation_steps=2, samples_per_second=9.0, why="fastest"),
            SettingRow(setting=TrainSetting(), fits=True, max_micro_batch=2, micro_batch=2, accumulation_steps=4,
                       samples_per_second=5.0, why="slower by 80%")]
    order, note = confirmed(rows, {r.setting: None for r in rows}, stack(), get_device("cpu"), None)
    assert order == rows and "not confirmed by real steps" in note and "fsdp(sync every) + offload" in note
