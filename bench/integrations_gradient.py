"""Each framework path's accumulated gradient against a full-batch float64 reference.

    python bench/integrations_gradient.py        # about a minute on 2 cores

One tiny GPT-2 built from a config (no dropout), one dataset of examples of 4 to 64
tokens, one effective batch: every path trains from the same initial weights up to
its first optimizer step, where its accumulated gradient is taken. The reference is
the gradient of the mean loss over every real target token of the very examples the
path consumed, in one float64 batch. Micro-batches hold different token counts, as
real data does, so a path that averages per-micro-batch means (equal weights) is off
by more than rounding; exact weighting (n_i / N, items = tokens) is off by float32
rounding only, the same as one float32 full batch. Error = ||g - g_ref|| / ||g_ref||
over all parameters. Paths that probe (autotune.plan, plan_training_args,
AutotuneBatchSize) do so under one emulated CPU budget; their plans are printed.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Callable

import torch
from common import machine
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import autotune
from autotune.planning import make_plan

TARGET, UNEVEN, BUDGET = 24, 23, "6MiB"
MAX = 8  # what the probes find under BUDGET; the paths that take a plan get one for it


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=128, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def dataset(n: int = 96) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 65, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(3, 64, (k,), generator=g).tolist()} for k in lengths]


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def plan_loader(data: list[dict], plan) -> torch.utils.data.DataLoader:
    sampler = autotune.PlanSampler(len(data), plan, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collate)


class Watch:
    """The micro-batches ``model`` trains on and its gradients at its first optimizer step, taken right after
    the step (SGD leaves them as they are; Lightning's closure runs the last micro-batch inside ``step``).
    Probe copies and their optimizers are not ``model``'s, and are left alone."""

    def __init__(self, model: nn.Module):
        self.batches: list[dict] = []
        self.grads: list[torch.Tensor] | None = None
        params = list(model.parameters())
        first = params[0]

        def seen(module, args, kwargs):  # a plain function: a deep copy of the model shares it, harmlessly
            if module is model and self.grads is None and torch.is_grad_enabled():
                self.batches.append({k: kwargs[k].detach().clone() for k in ("input_ids", "attention_mask",
                                                                             "labels")})

        def stepping(optimizer, args, kwargs):
            mine = any(p is first for group in optimizer.param_groups for p in group["params"])
            if mine and self.grads is None:
                self.grads = [torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double().clone()
                              for p in params]

        self.handles = [model.register_forward_pre_hook(seen, with_kwargs=True),
                        register_optimizer_step_post_hook(stepping)]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def reference(batches: list[dict]) -> list[torch.Tensor]:
    """The float64 gradient of the token-mean loss over every example in ``batches``, as one batch."""
    rows = [{"input_ids": b["input_ids"][i, :int(b["attention_mask"][i].sum())].tolist()}
            for b in batches for i in range(len(b["input_ids"]))]
    model = gpt2().double()
    model(**collate(rows)).loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def error(watch: Watch) -> tuple[float, int]:
    assert watch.grads is not None, "no optimizer step"
    ref = reference(watch.batches)
    diff = torch.sqrt(sum(((g - r) ** 2).sum() for g, r in zip(watch.grads, ref)))
    norm = torch.sqrt(sum((r ** 2).sum() for r in ref))
    return float(diff / norm), sum(len(b["input_ids"]) for b in watch.batches)


# ---- the paths: each returns (its plan, in words) and leaves the gradient in the Watch ----------------


def full_batch(model, watch, target):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hf_loss(model, collate(dataset()[:target])).backward()
    opt.step()
    return f"{target} in one batch"


def plain_accumulator(model, watch, target):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    workload = autotune.Workload.from_model(model, collate(dataset()), optimizer=opt)
    plan = autotune.plan(target, probe=workload, device="cpu", memory_budget=BUDGET)
    step = autotune.Accumulator(model, opt, plan, loss=hf_loss, items=tokens)
    step(next(iter(plan_loader(dataset(), plan))))
    return plan.arithmetic


def hf_trainer(model, watch, target, tmp, loss_type: str | None = None):
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from autotune.integrations.hf import plan_training_args

    args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=1, save_strategy="no",
                             disable_tqdm=True, max_grad_norm=0.0, optim="sgd", learning_rate=0.1)
    args, plan = plan_training_args(args, model, dataset(), target_batch=target, data_collator=collate,
                                    device="cpu", memory_budget=BUDGET)
    if loss_type is not None:
        model.loss_type = loss_type  # the Trainer then counts the shifted labels its causal LM loss averages over
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), data_collator=collate)
    trainer.remove_callback(PrinterCallback)  # the metrics line on stdout
    trainer.train()
    return plan.arithmetic


def hf_trainer_causal(model, watch, target, tmp):
    return hf_trainer(model, watch, target, tmp, loss_type="ForCausalLM")


def lightning_module(model, manual_plan=None):
    import lightning.pytorch as pl

    from autotune.integrations.lightning import accumulator

    class GPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.automatic_optimization = manual_plan is None
            self.batch_size = 2

        def training_step(self, batch, batch_idx):
            if manual_plan is None:
                return hf_loss(self.model, batch)
            if not hasattr(self, "accumulate"):
                self.accumulate = accumulator(self, self.optimizers(), manual_plan,
                                              loss=lambda m, b: hf_loss(m.model, b), items=tokens)
            self.accumulate(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            if manual_plan is not None:
                return plan_loader(dataset(), manual_plan)
            return torch.utils.data.DataLoader(dataset(), batch_size=self.batch_size, collate_fn=collate)

    return GPT()


def lightning_trainer(**kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def lightning_callback(model, watch, target):
    from autotune.integrations.lightning import AutotuneBatchSize

    tune = AutotuneBatchSize(target, memory_budget=BUDGET)
    lightning_trainer(callbacks=[tune]).fit(lightning_module(model))
    assert tune.plan is not None
    return tune.plan.arithmetic


def lightning_manual(model, watch, target):
    plan = make_plan(target, MAX)
    lightning_trainer().fit(lightning_module(model, manual_plan=plan))
    return plan.arithmetic


def accelerate_accumulator(model, watch, target):
    from accelerate import Accelerator

    from autotune.integrations.accelerate import accumulator

    accelerator = Accelerator(cpu=True)
    plan = make_plan(target, MAX)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accumulator(accelerator, model, opt, plan, loss=hf_loss, items=tokens)(next(iter(plan_loader(dataset(), plan))))
    return plan.arithmetic


def accelerate_own(model, watch, target):
    from accelerate import Accelerator

    plan = make_plan(target, MAX)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=plan.accumulation_steps)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = next(iter(plan_loader(dataset(), plan)))
    start = 0
    for n in plan.schedule[0]:
        micro = {k: v[start:start + n] for k, v in batch.items()}
        start += n
        with accelerator.accumulate(model):
            accelerator.backward(hf_loss(model, micro))
            opt.step()
            opt.zero_grad()
    return plan.arithmetic


PATHS: list[tuple[str, str, Callable, tuple[int, ...]]] = [
    ("full batch, float32", "one backward", full_batch, (TARGET, UNEVEN)),
    ("plain PyTorch", "Workload.from_model + Accumulator", plain_accumulator, (TARGET, UNEVEN)),
    ("Hugging Face", "plan_training_args + Trainer", hf_trainer, (TARGET,)),
    ("Hugging Face", "the same, model.loss_type = 'ForCausalLM'", hf_trainer_causal, (TARGET,)),
    ("Lightning", "AutotuneBatchSize (automatic optimization)", lightning_callback, (TARGET,)),
    ("Lightning", "accumulator (manual optimization)", lightning_manual, (TARGET, UNEVEN)),
    ("Accelerate", "accumulator (accelerator.backward)", accelerate_accumulator, (TARGET, UNEVEN)),
    ("Accelerate", "its own accelerator.accumulate()", accelerate_own, (TARGET, UNEVEN)),
]


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="paths whose name contains one of these words")
    wanted = parser.parse_args().only
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    print(machine())
    print(f"# tiny GPT-2, examples of 4-64 tokens, memory budget {BUDGET}; error = ||g - g_ref|| / ||g_ref|| at the "
          "first optimizer step, g_ref in float64 over the same examples as one batch")
    print(f"| {'framework':<20} | {'path':<45} | {'plan':<44} | {'examples':>8} | {'gradient error':>14} |")
    print(f"|{'-' * 22}|{'-' * 47}|{'-' * 46}|{'-' * 10}|{'-' * 16}|")
    for framework, path, run, targets in PATHS:
        if wanted and not any(w.lower() in f"{framework} {path}".lower() for w in wanted):
            continue
        for target in targets:
            model = gpt2()
            watch = Watch(model)
            with tempfile.TemporaryDirectory() as tmp:
                args = (model, watch, target, tmp) if run in (hf_trainer, hf_trainer_causal) else (model, watch, target)
                plan = run(*args)
            watch.close()
            err, seen = error(watch)
            print(f"| {framework:<20} | {path:<45} | {plan:<44} | {seen:>8} | {err:>14.2e} |", flush=True)


if __name__ == "__main__":
    main()
