"""The fixes a refusal of micro-batch 1 names: each one the model does not have already.

The model is built on ``meta`` (no memory) and read: most of its parameters in
a 16-bit (or smaller) type need no "use bf16"; activation checkpointing already
on (Hugging Face's ``gradient_checkpointing_enable``, a module's own
``checkpointing`` or ``gradient_checkpointing`` flag, blocks checkpointed by
autotune) needs no "enable activation checkpointing". A model that cannot be
built there is told every fix.
"""

from __future__ import annotations

import functools

import torch

from ..errors import AutotuneError
from ..workload import Workload

LOW_PRECISION = (torch.bfloat16, torch.float16, torch.uint8, torch.int8)  # uint8: 4-bit weights, packed


def fixes(workload: Workload) -> str:
    """What may make a micro-batch of 1 fit, as one phrase."""
    try:
        with torch.device("meta"):
            model = workload.make_model()
    except AutotuneError:  # the user's factory failed on meta (a model built only on a real device): nothing known
        model = None
    said = []
    if model is None or not _low_precision(model):
        said.append("use bf16")
    if model is None or not _checkpointed(model):
        said.append("enable activation checkpointing")
    said += ["shrink the model or the sequence length", "or use a device with more memory"]
    return ", ".join(said)


def _low_precision(model: torch.nn.Module) -> bool:
    """Are most of the model's parameters 16-bit or smaller?"""
    low = sum(p.numel() for p in model.parameters() if p.dtype in LOW_PRECISION)
    return 2 * low > sum(p.numel() for p in model.parameters())


def _checkpointed(model: torch.nn.Module) -> bool:
    """Does some module of the model run its forward under activation checkpointing?"""
    from .lowering import _checkpointed as by_autotune

    if getattr(model, "is_gradient_checkpointing", False) is True:
        return True
    for module in model.modules():
        if any(getattr(module, flag, False) is True for flag in ("checkpointing", "gradient_checkpointing")):
            return True
        forward = getattr(module.forward, "__func__", None)
        if isinstance(forward, functools.partial) and forward.func is by_autotune:
            return True
    return False
