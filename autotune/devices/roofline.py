"""A roofline estimate of a micro-step's time on a GPU by name, from the ops the estimate runs.

For ranks of a mixed plan that are GPUs you don't have (``estimate:A100-80GB,estimate:T4-16GB``)
nothing can be timed, so each rank's time per sample is estimated:

    time per sample = max(sum over dtypes of FLOPs / peak FLOP/s, bytes moved / bandwidth) / b

over one micro-step (forward and backward) at the rank's max micro-batch ``b``, run on
shape-only tensors as the estimate runs it (the kernels the GPU would pick included), under a
dispatch mode of its own that sees every aten op:

- FLOPs: of the matrix multiplications, convolutions and attention kernels, by
  ``torch.utils.flop_counter``'s formulas; an op whose inputs are bf16/fp16 counts at the
  preset's tensor-core peak (bf16 at the fp32 peak on a GPU without bf16 tensor cores), any
  other at its fp32 peak (no TF32: PyTorch's default for matmuls);
- bytes moved: the input and output tensors of every op that reads or writes data (views and
  other aliases move none), each once.

The peaks and bandwidths are the vendors' (see :mod:`autotune.devices.presets`). The model
leaves out the optimizer step (once per optimizer step, not per micro-step), kernel launch
gaps, caches and whatever keeps a kernel below its peak; it is meant to compare GPUs with
each other on the same work, not to predict seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from ..compat import TorchDispatchMode, tree_flatten
from ..workload import Workload
from .base import Device, Session, own_random_state
from .presets import GpuPreset, find_preset

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class OpCounts:
    """FLOPs (by the precision they run in: fp32, fp16, bf16) and bytes moved by one micro-step."""

    flops: dict[str, int]
    bytes: int
    ops: int = 0  # aten ops that ran (views included): each one a kernel launch or a dispatch


class Counting(TorchDispatchMode):
    """Counts FLOPs (matmul, conv, attention) and bytes moved of every aten op that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = {}
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        if getattr(func, "is_view", False):
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in inputs + outputs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            dtype = next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)
            key = str(dtype).removeprefix("torch.") if dtype in HALF else "float32"
            self.flops[key] = self.flops.get(key, 0) + int(formula(*args, **kwargs, out_val=out))
        return out


def count_micro_step(workload: Workload, device: Device, batch: int, seed: int = 0) -> OpCounts:
    """FLOPs and bytes of one micro-step (forward and backward) of ``workload`` at micro-batch ``batch``, on the
    estimate that stands in for ``device`` (no memory, no compute)."""
    counting = Counting()

    def work(session: Session) -> None:
        with own_random_state(session.torch_device, seed):
            model = session.model(workload.make_model)
            model.train()
            data = session.batch(workload.make_batch, batch, torch.Generator().manual_seed(seed))
            with counting:
                workload.loss(model, data).backward()

    device.estimator().measure(work)
    return OpCounts(flops=dict(counting.flops), bytes=counting.bytes, ops=counting.ops)


def seconds(counts: OpCounts, preset: GpuPreset) -> float:
    """The roofline time of the counted work on ``preset``: compute time or memory time, whichever is longer."""
    compute = 0.0
    for dtype, flops in counts.flops.items():
        tensor = dtype == "float16" or (dtype == "bfloat16" and preset.bf16)
        compute += flops / (preset.tensor_flops if tensor else preset.fp32_flops)
    return max(compute, counts.bytes / preset.bandwidth)


def preset_of(device: Device) -> GpuPreset | None:
    """The GPU preset an ``estimate:NAME`` device stands in for; None for any other device."""
    name = str(getattr(device, "name", ""))
    if not getattr(device, "estimated", False) or not name.startswith("estimate:"):
        return None
    return find_preset(name.removeprefix("estimate:"))


def seconds_per_sample(workload: Workload, device: Device, batch: int) -> float | None:
    """The roofline time per sample of ``workload`` at micro-batch ``batch`` on ``device``, a GPU by name
    (``estimate:NAME``); None for a device with no preset (nothing is known of its speed)."""
    preset = preset_of(device)
    if preset is None:
        return None
    return seconds(count_micro_step(workload, device, batch), preset) / batch
