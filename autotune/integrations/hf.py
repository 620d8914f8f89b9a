"""The Hugging Face Trainer: TrainingArguments whose batch settings give exactly the target batch.

    from autotune.integrations.hf import plan_training_args
    args, plan = plan_training_args(args, model, train_dataset, target_batch=1024, data_collator=collator)
    Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=collator).train()

The probe trains copies of ``model`` with what the Trainer will use: the
optimizer ``args`` names (``Trainer.get_optimizer_cls_and_kwargs``, with the
Trainer's weight-decay groups), the model's own loss (``model(**batch).loss``),
autocast under ``bf16``/``fp16``, activation checkpointing when ``args`` asks for
it, and the **worst case the collator can produce**: the longest examples of
the dataset, with the columns the Trainer keeps, padded as the collator pads
them. A probe on a typical batch is how a batch size that fits at the start runs
out of memory hours later, on the first long batch.

With a flattening collator (``DataCollatorWithFlattening``, TRL's ``padding_free``) a micro-batch is
``per_device_train_batch_size`` examples packed into one row (:mod:`autotune.integrations.packed`).

The Trainer runs equal micro-batches, so the plan is uniform:
``per_device_train_batch_size x gradient_accumulation_steps x world size ==
target_batch``, with micro-batches of at least about half the largest that fits;
a target with no such split raises PlanError naming the nearest targets that
have one. The Trainer takes one per-device batch size, so ranks that differ
(mixed GPUs, memory held by others) all run the smallest rank's
(``uniform_ranks``). Needs ``transformers`` (``pip install autotune[hf]``).

The Trainer cannot change the effective batch during training, so a batch ramp
(``AutotuneBatchRamp``, :mod:`autotune.integrations.hf_ramp`) refuses at the start
of ``train()`` and says where one runs instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import inspect
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import api, options
from ..devices import Device
from ..errors import BadInput, NoUniformPlan, user_code
from ..planning.exports import no_equal_split
from ..workload import Workload
from ..workload.hf import autocast_loss as _autocast
from .common import short_dataset
from .packed import cache_note, is_packed, packed_workload

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from ..results.plan import Plan

def __getattr__(name: str) -> Any:
    if name == "AutotuneBatchRamp":  # a TrainerCallback: defined where transformers is imported
        from .hf_ramp import AutotuneBatchRamp

        return AutotuneBatchRamp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: An iterable dataset (no length) is scanned this far for its longest examples.
SCAN_ITERABLE = 10_000
#: The worst-case batch is collated from this many of the longest examples; micro-batches cycle through them.
LONGEST = 8


def plan_training_args(args: TrainingArguments, model: nn.Module, train_dataset: Any, *, target_batch: int,
                       data_collator: Callable[[list[Any]], Any] | None = None, device: Device | str = "auto",
                       memory_budget: int | str | None = None,
                       margin: float = options.MARGIN) -> tuple[TrainingArguments, Plan]:
    """A copy of ``args`` with ``per_device_train_batch_size x gradient_accumulation_steps x world size ==
    target_batch``, and the Plan it comes from.

    ``data_collator``: the one you give the Trainer (default: transformers' ``default_data_collator``,
    as the Trainer's when it has no tokenizer). ``device``, ``memory_budget`` and ``margin`` are
    :func:`autotune.plan`'s. The world size is the Trainer's: its processes (``args.world_size``)
    times the GPUs each one drives with DataParallel (``args.n_gpu``).
    """
    from transformers import TrainingArguments, default_data_collator

    if not isinstance(args, TrainingArguments):
        raise BadInput(f"args must be transformers.TrainingArguments, got {type(args).__name__}")
    collator = data_collator if data_collator is not None else default_data_collator
    batch = worst_case_batch(train_dataset, collator, columns=_kept_columns(args, model),
                             forward=f"{type(model).__name__}.forward{inspect.signature(model.forward)}")
    workload = trainer_workload(args, model, batch)
    if is_packed(batch):  # a flattening collator: per_device_train_batch_size examples packed into one row
        workload = packed_workload(workload, batch)
    world = max(1, args.world_size) * max(1, args.n_gpu)
    try:
        plan = api.plan(target_batch, probe=workload, device=device, memory_budget=memory_budget, margin=margin,
                        world_size=world, uniform=True, uniform_ranks=True)
    except NoUniformPlan as exc:
        raise no_equal_split(exc, "hf", target_name="target_batch") from None
    plan = short_dataset(plan, train_dataset, "the Trainer", warn=args.process_index == 0)
    if is_packed(batch) and (note := cache_note(model)) is not None:
        plan = dataclasses.replace(plan, notes=plan.notes + (note,))
    planned = dataclasses.replace(args, per_device_train_batch_size=plan.micro_batch,
                                  gradient_accumulation_steps=plan.accumulation_steps)
    return planned, plan


def trainer_workload(args: TrainingArguments, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> Workload:
    """The Workload of ``model`` as the Trainer trains it with ``args`` on batches like ``batch``."""
    base = Workload.from_model(model, batch, optimizer=trainer_optimizer(args, model), name=type(model).__name__)
    checkpointing = bool(getattr(args, "activation_checkpointing", False) or
                         getattr(args, "gradient_checkpointing", False))
    model_factory = base.model

    def build() -> nn.Module:
        copy = model_factory()
        if checkpointing:
            _enable_checkpointing(copy, args)
        return copy

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    return dataclasses.replace(base, model=build, loss=_autocast(base.loss, dtype) if dtype else base.loss)


def trainer_optimizer(args: TrainingArguments, model: nn.Module) -> Callable[[Iterable[nn.Parameter]], Any]:
    """A factory of the optimizer ``Trainer.create_optimizer`` builds, for copies of ``model``: the class and
    settings ``args`` names, ``args.weight_decay`` on the Trainer's decay parameters and 0 on the rest."""
    from transformers import Trainer

    trainer: Any = Trainer  # its static methods take any nn.Module (and None for self)
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
    builds_own = sorted(set(kwargs) & {"params", "model", "optimizer_dict"})
    if builds_own or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise BadInput(f"optim {args.optim!r} builds its parameter groups from the model itself, which a probe "
                       "cannot reproduce on copies: plan with a standard optimizer (e.g. optim='adamw_torch') and "
                       "train with yours, keeping the margin for its state")
    decay = set(trainer.get_decay_parameter_names(None, model))
    names = [name for name, _ in model.named_parameters()]

    def factory(params: Iterable[nn.Parameter]) -> Any:
        named = list(zip(names, params))  # a copy's parameters, in the model's order
        trained = [(n, p) for n, p in named if p.requires_grad]
        groups = [{"params": [p for n, p in trained if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0}]
        return cls(groups, **kwargs)

    return factory


def worst_case_batch(dataset: Any, collator: Callable[[list[Any]], Any], *, columns: set[str] | None = None,
                     forward: str = "the model's forward") -> dict[str, torch.Tensor]:
    """The batch of the longest examples in ``dataset``, as ``collator`` makes it.

    An example's length is that of its longest sequence field (``input_ids`` and
    the like). ``columns``: the fields the Trainer keeps, ``forward``'s parameters and the
    label names (the rest are dropped before collating, as ``remove_unused_columns`` does);
    when that leaves the collator nothing to work with, BadInput names the columns dropped.
    """
    examples = _longest(dataset, LONGEST)
    if not examples:
        raise BadInput("train_dataset is empty: give the dataset the Trainer will train on")
    dropped, why = "", ""
    if columns is not None:
        dropped = ", ".join(sorted({k for e in examples if isinstance(e, Mapping) for k in e} - columns))
        examples = [{k: v for k, v in e.items() if k in columns} if isinstance(e, Mapping) else e for e in examples]
        why = (f"the Trainer keeps only the parameters of {forward} and the label names ({', '.join(sorted(columns))})"
               "; set remove_unused_columns=False in TrainingArguments to keep them")
    if dropped and all(isinstance(e, Mapping) and not e for e in examples):
        raise BadInput(f"remove_unused_columns drops every column of train_dataset ({dropped}): {why}")
    # The user's collator, whatever it raises: with columns dropped, say which ones it never saw.
    with user_code(lambda exc: BadInput(f"data_collator failed ({type(exc).__name__}: {exc}) on examples without "
                                        f"the columns remove_unused_columns drops ({dropped}): {why}")) \
            if dropped else contextlib.nullcontext():
        batch = collator(examples)
    if not isinstance(batch, Mapping):
        raise BadInput(f"data_collator returned {type(batch).__name__}, not a dict of tensors: the Trainer calls "
                       "model(**batch)")
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise BadInput("data_collator returned no tensors, and the Trainer calls model(**batch)" + (
            f"; remove_unused_columns drops the columns {dropped}: {why}" if dropped else ""))
    return tensors


def example_length(example: Any) -> int:
    """The length of an example's longest sequence field (0 when it has none)."""
    values = example.values() if isinstance(example, Mapping) else [example]
    return max((_length(v) for v in values), default=0)


def _length(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 0
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        return 0
    return len(value)


def _longest(dataset: Any, count: int) -> list[Any]:
    """The ``count`` longest examples, longest first (the first of equals first)."""
    try:
        size = len(dataset)
    except TypeError:  # an iterable dataset: its first examples
        examples = list(itertools.islice(iter(dataset), SCAN_ITERABLE))
        return heapq.nlargest(count, examples, key=example_length)
    top = heapq.nlargest(count, range(size), key=lambda i: (example_length(dataset[i]), -i))
    return [dataset[i] for i in top]


def _kept_columns(args: TrainingArguments, model: nn.Module) -> set[str] | None:
    """The example fields the Trainer passes to the collator: the forward's parameters and the label names."""
    if not args.remove_unused_columns:
        return None
    from transformers.utils import find_labels

    labels = args.label_names if args.label_names is not None else find_labels(type(model))
    return set(inspect.signature(model.forward).parameters) | {"label", "label_ids", *labels}


def _enable_checkpointing(model: nn.Module, args: TrainingArguments) -> None:
    """Activation checkpointing as the Trainer enables it."""
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or
                  getattr(args, "gradient_checkpointing_kwargs", None) or {})
    every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every, offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)  # type: ignore[operator]
