"""docs/noise-scale-and-ramp.md, "Growing the batch with the noise scale": its code blocks run here as written,
on the CPU."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import autotune

from .. import docs

PAGE = "noise-scale-and-ramp.md"


def blocks(heading: str) -> list[str]:
    """The python code blocks under the heading on docs/noise-scale-and-ramp.md."""
    return docs.blocks(PAGE, heading)


def run(code: str, namespace: dict) -> dict:
    return docs.run(code, namespace, PAGE)


def test_the_loop_is_at_most_five_lines():
    (loop,) = blocks("In your own loop")
    assert len(loop.strip().splitlines()) <= 5


@pytest.mark.slow
def test_your_own_loop(tmp_path, monkeypatch):
    import torch
    from torch.utils.data import DataLoader

    from .tokens import TokenNet, pad, sequences, token_loss

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.py").write_text(
        "import torch, autotune\n"
        "from tests.integrations.tokens import TokenNet, pad, sequences, token_loss\n"
        "def build():\n"
        "    return autotune.Workload(name='tokens', model=TokenNet, loss=token_loss,\n"
        "                             batch=lambda n, g: pad(sequences([12] * n, seed=int(g.initial_seed()))))\n")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    torch.manual_seed(0)
    model = TokenNet()
    user = types.SimpleNamespace(  # the user's autotune, on a CPU whose memory holds 64 sequences of 12 tokens
        plan=lambda target, probe: autotune.plan(target, probe=probe, device="cpu", memory_budget="700KiB"),
        Accumulator=autotune.Accumulator, RampConfig=autotune.RampConfig)
    done = run(blocks("In your own loop")[0], {
        "autotune": user, "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
        "my_loss": token_loss, "dataset": sequences([12] * 3000), "collate": pad, "DataLoader": DataLoader})
    plan, ramp = done["plan"], done["step"].ramp
    assert plan.target_batch == 1024 and plan.max_micro_batch < 512
    sizes = [p.effective_batch for p in ramp.phases]
    assert sizes[0] == plan.max_micro_batch + 1 and sizes == sorted(sizes) and all(s <= 1024 for s in sizes)
    assert all(p.micro_batch <= plan.max_micro_batch for p in ramp.phases)


@pytest.mark.slow
def test_lightning():
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from autotune.integrations.lightning import AutotuneBatchSize

    from .lightning_models import Sequences, TinyLM, trainer

    pl.seed_everything(0, verbose=False)
    datamodule = Sequences([6] * 1024)
    seen = {}

    def Trainer(callbacks):  # yours, with the test's settings
        seen["callback"] = callbacks[0]
        return trainer(callbacks=callbacks, max_steps=-1, max_epochs=2)

    callback = run(blocks("Lightning")[0], {"Trainer": Trainer, "AutotuneBatchSize": lambda *a, **k: AutotuneBatchSize(
        *a, memory_budget="300KiB", **k), "autotune": autotune, "model": TinyLM(), "datamodule": datamodule})
    phases = seen["callback"].ramp.ramp.phases
    assert callback["trainer"].global_step > 0 and phases[0].effective_batch < 256
