"""Run under torchrun (2 CPU processes, gloo) by tests/integrations/test_ddp.py, after ddp_worker.py's cases in
the same job; rank 0 prints one JSON line.

A plan for ranks that differ (rank 0 two micro-batches of 7 and 8, rank 1 three of 2), run by Lightning's DDP
strategy with autotune's manual-optimization ``accumulator``, and by Accelerate with its ``accumulator``, each
rank fed its share by ``PlanSampler``; then each again with a planted fault: every rank weights its micro-batches
by its own items (the mean over its own samples, as a plain DDP loop does), which DDP's average makes right only
when the ranks hold as many items.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from autotune.planning.mixed import make_mixed_plan  # noqa: E402
from autotune.results.ranks import RankShare  # noqa: E402
from autotune.training import Accumulator  # noqa: E402
from autotune.training.distributed import RoundCounter, parameter_digest  # noqa: E402
from tests.integrations.lightning_models import ManualLM, trainer  # noqa: E402
from tests.integrations.tokens import (  # noqa: E402
    MIXED,
    TokenNet,
    flat_grad,
    max_error,
    plan_loader,
    reference_run,
    relative_error,
    sequences,
    token_loss,
    tokens,
)
from tests.training.rank_exit import run_then_exit  # noqa: E402

#: Ranks of max micro-batch 8 and 2, balanced by memory: 21 = (7 + 8) + (2 + 2 + 2).
PLAN = make_mixed_plan(21, [RankShare(device="cpu", max_micro_batch=m, usable_bytes=2**20) for m in (8, 2)])


class Fetched(torch.utils.data.Dataset):
    """The test's sequences, keeping the index of every one the loader fetched."""

    def __init__(self) -> None:
        self.data = sequences(MIXED)
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.seen.append(index)
        return self.data[index]


class LocalItems(Accumulator):
    """Fault: every rank weights its micro-batches by its own items, not the effective batch's."""

    def total_items(self, local: int) -> int:
        self.local = local
        return super().total_items(local)  # the collective still runs: the ranks stay paired

    def weight(self, n_items: int, total_items: int) -> float:
        return n_items / self.local


def gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def report(model, data: Fetched, outcomes, grads, rounds) -> dict:
    """What every rank fed, ran and stepped with, against the full-batch float64 run."""
    parameters, reference = reference_run(data.data, 21, steps=2)
    fields = ("samples", "micro_steps", "items", "total_items")
    return {"seen": gathered(data.seen), "rounds": gathered(rounds),
            **{name: gathered([getattr(o, name) for o in outcomes]) for name in fields},
            "grad_error": gathered([relative_error(g, r) for g, r in zip(grads, reference, strict=True)]),
            "max_error": max_error(model, parameters), "digests": gathered(parameter_digest(model))}


class Recorded(ManualLM):
    """autotune's Lightning accumulator, keeping each step's outcome and the gradient the optimizer steps with."""

    def __init__(self, fault: bool):
        super().__init__(PLAN, "autotune")
        self.fault = fault
        self.outcomes: list = []
        self.grads: list[torch.Tensor] = []

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.fault:
            self.accumulate.__class__ = LocalItems
        self.optimizers().optimizer.register_step_pre_hook(lambda *_: self.grads.append(flat_grad(self)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.outcomes.append(self.accumulate.step(batch))
        self.rounds.append(self._communicated)
        self._communicated = 0


def with_lightning(fault: bool) -> dict:
    pl.seed_everything(0, verbose=False)
    model, data = Recorded(fault), Fetched()
    t = trainer(devices=2, strategy=DDPStrategy(process_group_backend="gloo"), use_distributed_sampler=False)
    t.fit(model, train_dataloaders=plan_loader(data, PLAN))
    return {**report(model, data, model.outcomes, model.grads, model.rounds), "global_step": t.global_step}


def with_accelerate(fault: bool) -> dict:
    from accelerate import Accelerator

    from autotune.integrations.accelerate import accumulator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TokenNet()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    grads: list[torch.Tensor] = []
    optimizer.optimizer.register_step_pre_hook(lambda *_: grads.append(flat_grad(model)))
    counter, data = RoundCounter(model), Fetched()
    step = accumulator(accelerator, model, optimizer, PLAN, loss=token_loss, items=tokens)
    if fault:
        step.__class__ = LocalItems
    outcomes, rounds = [], []
    for batch in plan_loader(data, PLAN):
        outcomes.append(step.step(batch))
        rounds.append(counter.take())
    return {**report(model, data, outcomes, grads, rounds), "type": str(accelerator.distributed_type)}


def main() -> None:
    warnings.filterwarnings("ignore")
    results = {"schedule": [list(row) for row in PLAN.schedule]}
    for name, run in (("lightning", with_lightning), ("accelerate", with_accelerate)):
        results[name], results[f"{name}_local_items"] = run(False), run(True)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    run_then_exit(main)
