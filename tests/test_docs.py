"""docs/your-model.md (and README's loop, the same block), and README's "What you see": the examples run here as
written, on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import autotune
from autotune.cli import main

from . import docs
from .integrations.tokens import TokenNet, pad, plan_loader, sequences, token_loss, tokens

PAGE = "your-model.md"

#: MyModel, from a module beside the probe file, as the page says it may come
MINE = """import torch


class MyModel(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
"""


@pytest.mark.slow
def test_a_probe_file_and_a_request(tmp_path, monkeypatch, capsys):
    probe_file, request = docs.blocks(PAGE, "Your own model")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(MINE)
    (tmp_path / "my_model.py").write_text("from mine import MyModel\n" + probe_file)
    command = re.search(r"`autotune (plan [^`]*--probe my_model\.py[^`]*)`", docs.path(PAGE).read_text())
    assert command is not None
    assert main(command.group(1).split()) == 0
    planned = autotune.load_plan("plan.json")
    assert planned.target_batch == 1024 and "my-model" in capsys.readouterr().out
    done = docs.run(request, {"autotune": autotune}, PAGE)
    plan, smaller = done["plan"], done["smaller"]
    assert plan.target_batch == 1024 and plan.probe.device.estimated and "H100" in plan.probe.device.name
    assert smaller.margin == 0.2 and smaller.max_micro_batch <= plan.probe.max_micro_batch


@pytest.mark.slow
def test_your_own_training_loop(tmp_path, monkeypatch):
    (loop,) = docs.blocks(PAGE, "Your own training loop")
    assert docs.blocks("README.md", "Your own training loop") == [loop]  # README's example is this block
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    (tmp_path / "my_model.py").write_text(
        "import autotune\n"
        "from tests.integrations.tokens import TokenNet, pad, sequences, token_loss\n"
        "def build():\n"
        "    return autotune.Workload(name='tokens', model=TokenNet, loss=token_loss,\n"
        "                             batch=lambda n, g: pad(sequences([12] * n, seed=int(g.initial_seed()))))\n")
    # a CPU whose memory holds 64 sequences of 12 tokens: 96 takes two micro-steps
    assert main(["plan", "--target-batch", "96", "--probe", "my_model.py", "--device", "cpu",
                 "--memory-budget", "700KiB", "--output", "plan.json"]) == 0
    data = sequences([2 + (7 * i) % 13 for i in range(192)])
    torch.manual_seed(0)
    model = TokenNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = plan_loader(data, autotune.load_plan("plan.json"))
    done = docs.run(loop, {"autotune": autotune, "model": model, "optimizer": optimizer, "my_loss": token_loss,
                           "count_tokens": tokens, "loader": loader}, PAGE)
    assert done["plan"].accumulation_steps == 2 and isinstance(done["loss"], float)
    # what it must equal: SGD on the whole effective batch, the gradient clipped once per step
    torch.manual_seed(0)
    reference = TokenNet().double()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        token_loss(reference, pad(data[step * 96:(step + 1) * 96])).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.detach().double(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_accumulators_parts():
    from autotune.planning.planner import make_plan

    (block,) = docs.blocks(PAGE, "The Accumulator's parts")
    torch.manual_seed(0)
    model = TokenNet()
    done = docs.run(block, {"autotune": autotune, "model": model, "plan": make_plan(48, 16),
                            "optimizer": torch.optim.SGD(model.parameters(), lr=0.5), "my_loss": token_loss,
                            "count_tokens": tokens}, PAGE)
    step = done["step"]
    data = sequences([2 + (7 * i) % 13 for i in range(48 * 4)])
    for i in range(4):
        assert step.step(pad(data[i * 48:(i + 1) * 48])).micro_steps == 3
    assert (step.precision, step.max_norm, step.noise_scale.every) == ("bf16", 1.0, 4)
    assert [h.step for h in step.noise_scale.history] == [0]  # every 4th step measured
    with pytest.raises(DeprecationWarning, match=r"Accumulator\(precision=\) is deprecated"):
        docs.run("autotune.Accumulator(model, optimizer, plan, loss=my_loss, precision='bf16')", done, PAGE)


@pytest.mark.slow
def test_what_you_see_is_what_the_command_prints(capsys):
    """README's first console example: the command as written prints the result lines shown (the progress lines,
    with their seconds, go to stderr)."""
    (console,) = docs.blocks("README.md", "What you see", lang="console")
    command, *shown = console.splitlines()
    assert command.startswith("$ autotune ")
    assert main(command.split()[2:]) == 0
    assert capsys.readouterr().out.splitlines() == [line for line in shown if not line.startswith("  ")]
