"""The fingerprint of a probe: a digest of everything its answer depends on.

Two probes with the same fingerprint find the same max micro-batch, so the
store may answer the second with the first's result. The digest covers:

- the workload's graph, traced on shape-only tensors (the estimate's own
  engine: ``meta``, or ``FakeTensorMode`` where ``meta`` cannot run it), with no
  real memory or compute: the module tree (every module's class and settings),
  every parameter's and buffer's name, shape, dtype and ``requires_grad``; the
  batch's structure, shapes and dtypes at micro-batches 2 and 3 (the sizes the
  estimate measures); the optimizer's class, defaults and param groups; and the
  aten ops that the loss's forward and backward run at micro-batch 2, in order,
  each with its output shapes and dtypes (recorded by a dispatch mode of its
  own, above the estimate's tracker); the workload's name and chosen options;
- the device as it describes itself: the GPU model, its total memory and
  driver, the budget when one was given (an estimate's budget, allowance,
  rounding and engine), never what changes from minute to minute (free memory,
  other processes: a confirm run checks those); in a job whose ranks differ,
  every rank's device the same way, in rank order (the plans kept beside the
  probe are that job's);
- torch's and autotune's versions, the allocator settings torch reads
  (``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``), the precision,
  world size, parallel strategy and how the fit rule runs (whether it holds
  DDP's gradient buckets), the fit rule's steps and what it holds besides the
  model (the runner's loss sum and noise-measurement buffer), and the margin.

The probe's ``max_batch`` is not part of it: a maximum that memory set
answers every larger limit (see :meth:`autotune.store.schema.Entry.answers`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch

from ..compat import TorchDispatchMode, tree_flatten
from ..devices.allocconf import conf_from_environment
from ..devices.base import Device, Session, own_random_state
from ..errors import first_line
from ..probing.fitrule import MICRO_STEPS, OPTIMIZER_STEPS
from ..probing.fsdp import Sharding
from ..results.device import DeviceInfo
from ..results.request import ProbeRequest
from ..workload import Workload
from ..workload.bookkeeping import noise_buffer_numel

#: The micro-batches whose batch shapes are part of the fingerprint (the estimate's two sizes);
#: the ops are traced at the first.
SIZES = (2, 3)
#: DeviceInfo fields that change while the device stays the same.
VOLATILE = ("summary", "free_bytes", "other_processes", "note", "engine_fallback", "capacity_source", "torch",
            "allocator_conf", "allocator_conf_variable")


class Untraceable(Exception):
    """The workload cannot be built on shape-only tensors, so it has no fingerprint."""


@dataclass(frozen=True)
class Fingerprint:
    """The digest, and what went into it (for people: large parts appear as their own digests)."""

    digest: str
    components: dict[str, Any] = field(repr=False)
    seconds: float = 0.0

    @property
    def short(self) -> str:
        return self.digest[:12]


def fingerprint(workload: Workload, device: Device, request: ProbeRequest,
                ranks: Sequence[DeviceInfo] | None = None) -> Fingerprint:
    """The fingerprint of probing ``workload`` on ``device`` as ``request`` asks: its margin, precision and
    fit rule (its world size, parallel strategy, DDP's buckets or this rank's FSDP shard) count; the request's
    names and max_batch do not (``workload`` and ``device`` are what they name). ``ranks``: every rank's device, in rank
    order, in a job whose ranks differ (then a part ``ranks``, each as the ``device`` part is; jobs whose ranks
    are alike have no such part, and their fingerprints are as before).

    Raises :class:`Untraceable` when the model cannot be built, or its batch made,
    on shape-only tensors.
    """
    import autotune

    start = time.perf_counter()
    graph = trace(workload, device)
    components = {
        "workload": {"name": workload.name, "options": plain(dict(workload.chosen))},
        **graph,
        "device": device_part(device.describe()),
        "torch": str(torch.__version__),
        "autotune": autotune.__version__,
        "alloc_conf": conf_from_environment()[0],  # the settings decide, not the name they were given under
        "precision": request.precision,
        "world_size": request.rule.world_size,
        "rule": rule_part(request),
        "parallel": request.rule.parallel,
        "margin": float(request.margin),
        "fit_rule": {"optimizer_steps": OPTIMIZER_STEPS, "micro_steps": MICRO_STEPS,
                     "holds": {"loss_sum": True, "noise_buffer": noise_buffer_numel(0)}},
    }
    if ranks:
        components["ranks"] = [device_part(info) for info in ranks]
    return Fingerprint(digest=_digest(components), components=components, seconds=time.perf_counter() - start)


#: How an FSDP fit rule is keyed in the fingerprint: the qualified name its runtime class had when the first entries
#: were stored, kept so that they are still found whatever the class is called now.
SHARDING_KEY = "autotune.probing.fsdp.FsdpRule"
#: Fields of the FSDP rule added since the first entries were stored: written only when set, so that those entries
#: (none of them offloaded) are still found.
ADDED_LATER = ("offload", "host_apart")


def rule_part(request: ProbeRequest) -> dict[str, Any]:
    """What the fingerprint holds of the request's fit rule: DDP's buckets (``data_parallel``), or FSDP's
    sharding with every field of its runtime part (world size, rank, precision, process group, gradient sync)."""
    sharding = Sharding.of(request.rule, request.precision)
    if sharding is None:
        return {"data_parallel": request.rule.buckets}
    return {"sharding": {SHARDING_KEY: {f.name: plain(getattr(sharding, f.name)) for f in fields(sharding)
                                        if f.name not in ADDED_LATER or getattr(sharding, f.name)}}}


def device_part(info: DeviceInfo) -> dict[str, Any]:
    """What identifies a device for the answer: its description less what changes by the minute. A real
    device's capacity is part of it only when a budget set it (free memory is checked by a confirm run);
    a GPU's index is not (any GPU of the model gives the same answer)."""
    part = {k: v for k, v in info.to_dict().items() if k not in VOLATILE}
    if info.kind != "estimate" and info.budget_bytes is None:
        part.pop("capacity_bytes", None)
    if info.kind == "cuda":
        part.pop("name", None)
    return plain(part)


def trace(workload: Workload, device: Device) -> dict[str, Any]:
    """The workload's graph on the estimate that stands in for ``device``."""
    seen: dict[str, Any] = {}

    def work(session: Session) -> None:
        seen.clear()
        with own_random_state(session.torch_device, 0):
            generator = torch.Generator().manual_seed(0)
            model = session.model(workload.make_model)
            model.train()
            seen["model"] = _model(model)
            seen["optimizer"] = _optimizer(session.optimizer(workload.optimizer, model))
            batches = {size: session.batch(workload.make_batch, size, generator) for size in SIZES}
            seen["batch"] = {str(size): _tree(batch) for size, batch in batches.items()}
            ops = OpRecorder()
            try:
                with ops:
                    loss = workload.loss(model, batches[SIZES[0]])
                    loss.backward()
            except Exception as exc:  # whatever the workload's loss raised: recorded, then raised as it was
                seen["ops"] = {"traced": False, "why": first_line(exc)}
                raise
            seen["ops"] = {"traced": True, "count": ops.count, "digest": ops.digest()}

    estimator = device.estimator()
    try:
        estimator.measure(work)
    except Exception as exc:  # the workload's code may raise anything: what it reached is still a fingerprint
        if not {"model", "optimizer", "batch"} <= set(seen):
            raise Untraceable(first_line(exc)) from exc
        seen.setdefault("ops", {"traced": False, "why": first_line(exc)})
    seen["ops"]["engine"] = estimator.engine
    return seen


class OpRecorder(TorchDispatchMode):
    """Hashes every aten op it sees, in order, with its outputs' shapes and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self._hash = hashlib.sha256()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.count += 1
        parts = [str(func)]
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                parts.append(f"{tuple(leaf.shape)}:{leaf.dtype}")
            elif isinstance(leaf, (bool, int, float)):
                parts.append(type(leaf).__name__)
        self._hash.update(("|".join(parts) + "\n").encode())
        return out

    def digest(self) -> str:
        return self._hash.hexdigest()


def _model(model: torch.nn.Module) -> dict[str, Any]:
    tree = [(name, _kind(module), module.extra_repr()) for name, module in model.named_modules()]
    params = [(name, list(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()]
    buffers = [(name, list(b.shape), str(b.dtype)) for name, b in model.named_buffers()]
    return {
        "digest": _digest({"tree": tree, "parameters": params, "buffers": buffers}),
        "class": _kind(model),
        "modules": len(tree),
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "buffers": len(buffers),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


def _optimizer(opt: torch.optim.Optimizer) -> dict[str, Any]:
    groups = [{**{k: plain(v) for k, v in sorted(g.items()) if k != "params"},
               "params": len(g["params"]), "numel": sum(p.numel() for p in g["params"])} for g in opt.param_groups]
    return {"class": _kind(opt), "defaults": plain(dict(opt.defaults)), "param_groups": groups}


def _tree(batch: Any) -> dict[str, Any]:
    leaves, spec = tree_flatten(batch)
    return {"structure": " ".join(str(spec).split()), "leaves": [plain(leaf) for leaf in leaves]}


def plain(value: Any) -> Any:
    """``value`` as JSON that is the same in every process: tensors as shape and dtype, dataclasses as
    their fields, other objects as their class (never an address)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(str(plain(v)) for v in value)
    if is_dataclass(value) and not isinstance(value, type):  # e.g. FSDP's rule: its world size, rank, precision
        return {_kind(value): {f.name: plain(getattr(value, f.name)) for f in fields(value)}}
    return f"<{_kind(value)}>"


def _kind(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The top-level parts that differ between two fingerprints' components."""
    keys: Iterable[str] = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]
