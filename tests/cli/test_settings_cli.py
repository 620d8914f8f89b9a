"""``autotune plan --search-settings`` and ``autotune run --settings FILE|best`` on the CPU."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from autotune.cli import main

pytestmark = pytest.mark.slow  # probes of several settings, and real training steps

STACK = '''
import torch
from torch import nn
from autotune import Workload

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(128, 512), nn.Linear(512, 128)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

def build():
    return Workload(name="stack", model=Stack, batch=lambda n, g: torch.randn(n, 16, 128, generator=g),
                    loss=lambda m, x: m(x).pow(2).mean())
'''


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stack_flags(folder) -> list[str]:
    path = folder / "stack.py"
    path.write_text(STACK)
    # 14 MiB: without checkpointing not even a micro-batch of 1 fits
    return ["--probe", str(path), "--device", "cpu", "--memory-budget", "14MiB", "--quiet"]


@pytest.fixture
def stack(tmp_path) -> list[str]:
    return stack_flags(tmp_path)


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> tuple[int, str, Path]:
    """One ``plan --search-settings`` (a probe of each setting, the best two timed) for the tests that read its
    plan: its exit code, its JSON on stdout, and the same plan written by ``--output``."""
    folder = tmp_path_factory.mktemp("searched")
    plan = folder / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["plan", "--target-batch", "48", *stack_flags(folder), "--search-settings", "--json",
                     "--output", str(plan)])
    return code, out.getvalue(), plan


def test_plan_json_lists_every_setting_best_first_beside_the_plan(searched) -> None:
    code, out, _ = searched
    data = json.loads(out)
    assert code == 0 and data["setting"] == data["settings"][0]["setting"]
    assert data["setting"]["checkpoint_every"] > 0 and data["micro_batch"] == data["settings"][0]["micro_batch"]
    assert [set(r) >= {"setting", "fits", "max_micro_batch", "samples_per_second", "why"} for r in data["settings"]]
    assert data["settings"][-1]["fits"] is False and "does not fit" in data["settings"][-1]["why"]


def test_run_settings_file_trains_under_the_chosen_setting_and_verifies(capsys, searched) -> None:
    code, out, plan = searched
    assert code == 0 and json.loads(plan.read_text()) == json.loads(out)  # --output writes what --json prints
    code, out, _ = cli(capsys, "run", "--settings", str(plan), "--steps", "2", "--json", "--quiet")
    data = json.loads(out)
    assert code == 0 and data["passed"] is True
    peak = next(c for c in data["verification"]["checks"] if c["name"] == "memory")
    grad = next(c for c in data["verification"]["checks"] if c["name"] == "gradient_equivalence")
    assert peak["passed"] and grad["passed"]


def test_run_settings_best_searches_first(capsys, stack) -> None:
    code, out, _ = cli(capsys, "run", "--settings", "best", "--target-batch", "48", *stack, "--steps", "1")
    assert code == 0 and "verification PASSED" in out


@pytest.mark.parametrize(("argv", "words"), [
    (["plan", "--target-batch", "8", "--allow", "lora"], "--allow 'lora' names settings for the settings search"),
    (["plan", "--target-batch", "8", "--search-settings", "--allow", "fp8"], "not a setting the search can allow"),
    (["run", "--settings", "best", "--steps", "1"], "--settings best searches the settings for a target batch"),
    (["plan", "--target-batch", "8", "--search-settings", "--tune"], "--search-settings and --tune each choose"),
    (["plan", "--target-batch", "8", "--search-settings", "--allow", "fp8,lora"], "--allow 'fp8' is not a setting"),
])
def test_settings_flags_refused_in_one_line(capsys, argv: list[str], words: str) -> None:
    code, _, err = cli(capsys, *argv, "--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB")
    assert code == 2 and words in err and "Traceback" not in err


def test_the_api_refuses_a_search_beside_tune_naming_the_field() -> None:
    import autotune

    with pytest.raises(autotune.errors.BadInput) as refused:
        autotune.plan(8, probe="mlp", device="cpu", memory_budget="3MB", search_settings=True, tune=True)
    assert refused.value.field == "search_settings" and "search_settings and tune each choose" in str(refused.value)
