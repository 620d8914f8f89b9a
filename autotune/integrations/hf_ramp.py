"""The batch ramp and the Hugging Face Trainer: ``AutotuneBatchRamp`` refuses, and says why and what to do.

The Trainer fixes the batch when ``train()`` starts: the dataloader's batch
size, ``gradient_accumulation_steps``, the optimizer steps of each epoch and
``max_steps`` (and the learning-rate schedule over them) are computed once, and
inside an epoch it decides when to step the optimizer from a running count of
micro-batches modulo ``gradient_accumulation_steps``. A callback that changed the
accumulation during training would step the optimizer in the middle of an
accumulation and leave the epoch's step count and the schedule as they were, so
no step's effective batch would be the one asked for. This callback stops
``train()`` at its start with that reason instead.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..errors import BadInput
from ..results.ramp import RampConfig


class AutotuneBatchRamp(TrainerCallback):
    """Asks the Trainer for a batch ramp and refuses at ``on_train_begin``: the Trainer cannot change the
    effective batch during training (see the module docstring)."""

    def __init__(self, ramp: RampConfig | None = None):
        self.ramp = ramp if ramp is not None else RampConfig()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        raise BadInput(
            f"the Hugging Face Trainer cannot follow a batch ramp: it fixed per_device_train_batch_size="
            f"{args.per_device_train_batch_size}, gradient_accumulation_steps={args.gradient_accumulation_steps} and "
            f"{state.max_steps} optimizer steps (with the learning-rate schedule over them) when train() started, and "
            "counts micro-batches modulo gradient_accumulation_steps to decide when to step, so a change during "
            "training would step in the middle of an accumulation. Train with a fixed target "
            "(autotune.integrations.hf.plan_training_args), or ramp in your own loop or in Lightning: "
            "autotune.Accumulator(model, optimizer, plan, loss=..., parts=[autotune.RampConfig()]), "
            "AutotuneBatchSize(target, ramp=autotune.RampConfig())")
