"""Run under torchrun (2 CPU processes, gloo) by tests/integrations/test_ddp.py; rank 0 prints one JSON line,
then mixed_worker.py's cases run in the same job (it costs seconds to start) and print theirs.

Lightning's DDP strategy, one Trainer each: AutotuneBatchSize with automatic optimization; manual
optimization with autotune's accumulator, with a plain Accumulator that claims to synchronise
(Sync(external=True)) but does not, and with a plain Accumulator left to its own check. Then Accelerate:
a prepared model and optimizer, the Accumulator with accelerator.backward.
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

from autotune import Accumulator  # noqa: E402
from autotune.errors import BadInput  # noqa: E402
from autotune.integrations.lightning import AutotuneBatchSize  # noqa: E402
from autotune.planning import make_plan  # noqa: E402
from autotune.training import MixedPrecision  # noqa: E402
from autotune.training.distributed import RoundCounter, parameter_digest  # noqa: E402
from tests.integrations.lightning_models import ManualLM, Sequences, TinyLM, trainer  # noqa: E402
from tests.integrations.tokens import (  # noqa: E402
    MIXED,
    TokenNet,
    max_error,
    plan_loader,
    reference_parameters,
    sequences,
    token_loss,
    tokens,
)
from tests.training.rank_exit import run_then_exit  # noqa: E402

BUDGET = sys.argv[1]
PLAN = make_plan(21, 4, world_size=2)  # ranks 10 and 11 samples, 3 micro-steps each, uneven
DATA = sequences(MIXED)


def ddp_trainer(**kwargs) -> pl.Trainer:
    return trainer(devices=2, strategy=DDPStrategy(process_group_backend="gloo"), **kwargs)


def gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def with_callback() -> dict:
    pl.seed_everything(0, verbose=False)
    seen: list[int] = []

    class Seen(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(int(batch.shape[0]))

    tune = AutotuneBatchSize(40, memory_budget=BUDGET)
    data = Sequences([40] * 4 + [6] * 100)  # the long ones first: the scan meets them
    t = ddp_trainer(callbacks=[tune, Seen()])
    model = TinyLM()
    t.fit(model, datamodule=data)
    plan = tune.plan
    return {"arithmetic": gathered(plan.arithmetic), "batch_size": gathered(data.batch_size),
            "accumulate": gathered(t.accumulate_grad_batches), "global_step": gathered(t.global_step),
            "seen": gathered(seen), "digests": gathered(parameter_digest(model)),
            "probe_ranks": list(plan.probe.ranks)}


def manual(how: str) -> dict:
    pl.seed_everything(0, verbose=False)
    model = ManualLM(PLAN, how)
    t = ddp_trainer(use_distributed_sampler=False)
    try:
        t.fit(model, train_dataloaders=plan_loader(DATA, PLAN))
    except BadInput as exc:
        return {"error": str(exc)}
    return {"digests": gathered(parameter_digest(model)), "rounds": gathered(model.rounds),
            "global_step": t.global_step, "max_error": max_error(model, reference_parameters(DATA, 21, steps=2))}


def with_accelerate() -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TokenNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = RoundCounter(model)
    step = Accumulator(model, optimizer, PLAN, loss=token_loss, items=tokens,
                       parts=[MixedPrecision(backward=accelerator.backward)])
    rounds = []
    for batch in plan_loader(DATA, PLAN):
        step(batch)
        rounds.append(counter.take())
    return {"type": str(accelerator.distributed_type), "digests": gathered(parameter_digest(model)),
            "rounds": gathered(rounds), "max_error": max_error(model, reference_parameters(DATA, 21, steps=2))}


def main() -> None:
    warnings.filterwarnings("ignore")
    results = {"callback": with_callback(), "plan": PLAN.arithmetic}
    for how in ("autotune", "naive", "checked", "every"):
        results[how] = manual(how)
    results["accelerate"] = with_accelerate()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))


def main_then_mixed_ranks() -> None:
    from tests.integrations import mixed_worker

    main()
    mixed_worker.main()


if __name__ == "__main__":
    run_then_exit(main_then_mixed_ranks)
