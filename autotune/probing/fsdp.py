"""FSDP (``fully_shard``): the fit rule per rank of a sharded model, for any world size, from one process.

Under FSDP each rank holds its shard of the parameters, gradients and optimizer
state, and for a while the whole parameters of the units in flight (the one
computing and the next one being all-gathered), the reduce-scatter buffers,
and between micro-steps that do not synchronise, the unsharded gradients. The
fit rule runs PyTorch's own ``fully_shard`` (FSDP2), so every buffer FSDP holds
is counted where FSDP allocates it; only the gradient synchronisation differs
from the plain rule: off for every micro-step but the last.

The process group. Memory per rank depends on the world size, not on what the
other ranks send, so the rule runs on a private fake process group of the
planned size (PyTorch's ``FakeProcessGroup``: every collective completes at once
and moves no data), made for one measurement and gone after it. It is never the
default group: an estimate on a laptop leaves no process group behind, and under
torchrun it sits beside the real group without touching it (no ``new_group``,
so no rank waits for another). Every rank thus probes on its own, and a rank
that runs out of memory cannot leave the others waiting in a collective.
``real_group=True`` runs the rule on the real default group instead: the
per-rank measurement under torchrun that the estimate is checked against.

Shape-only estimates run on the meta engine: ``fully_shard`` places its units
on ``meta`` there (its buffers ``meta`` tensors, its streams the CPU's, see
:func:`~autotune.devices.session.fsdp_on_meta`), so every all-gather, copy and
reduce-scatter FSDP makes is counted as on the CPU; under ``FakeTensorMode``
(the fallback) on the CPU device FSDP sees there. A real run with the fake
group computes on all-gathered parameters whose other ranks' parts are left
unset: the values are meaningless, the memory is the rank's own.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import compat, options
from ..devices.base import Session
from ..devices.estimate import EstimateDevice
from ..devices.meta import NeedsFakeTensors
from ..devices.session import fake_mesh, fsdp_on_meta, shape_propagation_uncounted, strided_flag_read_once
from ..errors import undo_on_failure
from ..results.request import FitRule
from ..workload import Workload
from .fsdpoffload import Host, host_apart

__all__ = ["Sharding", "fake_engine", "fake_mesh", "real_mesh", "release",
           "shape_propagation_uncounted", "shard", "sharded_model", "sharding_note", "skeleton"]

def real_mesh(device_type: str) -> Any:
    """The DeviceMesh of the active default process group (under torchrun)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    with compat.unset_fake_temporarily():
        world: Any = dist.group.WORLD
        return DeviceMesh.from_group(world, device_type)


def mixed_precision(precision: str) -> Any:
    """FSDP's policy for ``precision``: all-gathered parameters and compute in bf16/fp16, gradients
    reduced and kept in fp32; fp32 is no policy at all."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = options.precision(precision)
    if precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard(model: nn.Module, units: list[nn.Module], mesh: Any, precision: str = "fp32", offload: bool = False
          ) -> nn.Module:
    """``fully_shard`` every unit, then the root: the usual FSDP2 wrapping, in place, with collectives whose
    buffers are freed when FSDP lets go of them (:mod:`autotune.probing.fsdpcomm`); ``offload``: with FSDP2's
    ``CPUOffloadPolicy`` (the shards and the optimizer on the host, :mod:`autotune.probing.fsdpoffload`)."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    from .fsdpcomm import release_on_caller
    from .fsdpoffload import offload_policy

    policy = mixed_precision(precision)
    where = offload_policy(mesh.device_type) if offload else OffloadPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=where)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=where)
    release_on_caller(model)
    return model


def skeleton(host: nn.Module, device: torch.device | str = "meta") -> nn.Module:
    """A copy of ``host`` (ties kept) whose parameters and buffers are new, unset tensors on ``device``
    (``meta`` by default): what FSDP shards before the shards are allocated."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(host.parameters(), host.buffers()):
        empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(host, memo)


def sharded_model(session: Session, factory: Callable[[], nn.Module], units: Callable[[nn.Module], list[nn.Module]],
                  mesh: Any, precision: str = "fp32", offload: bool = False, offloaded: Host | None = None
                  ) -> nn.Module:
    """A model sharded by ``fully_shard`` with only this rank's shards on the session's device.

    The model is built on the host and sharded on ``meta`` (no dispatch mode
    sees that: it is not device work); then only the shards and the buffers
    are allocated on the device, counted as parameters, and filled with this
    rank's part of the host model's values (an estimate has none: its device
    tensors are fakes of the session's ``FakeTensorMode``). ``offload``: FSDP's
    CPU offload; ``offloaded``: the host where its shards are told apart from the device's
    memory (:func:`autotune.probing.fsdpoffload.host_apart`): kept there, not counted.
    """
    tracker, device = session.tracker, session.torch_device
    host = session.host_model(factory)
    estimate = any(p.is_meta for p in itertools.chain(host.parameters(), host.buffers()))
    fake_mode = compat.active_fake_mode()
    if estimate and fake_mode is None and not session.on_meta:
        raise NeedsFakeTensors("fully_shard refuses meta parameters outside an estimate's meta engine")
    with compat.disable_current_modes():
        model = skeleton(host)
        shard(model, units(model), mesh, precision, offload)
    tracker.placing(model)
    with _fakes_of_meta(fake_mode):  # the meta engine's shards are new meta tensors, made as a device's are
        model.to_empty(device="meta" if session.on_meta else device)
    if not estimate:
        with tracker.paused(), torch.no_grad():
            _copy_values(host, model, mesh.get_coordinate()[0], mesh.size())
    del host
    if offloaded is not None:  # what FSDP copies to the device for an all-gather (on meta: the shards FSDP made)
        offloaded.keep(itertools.chain(model.parameters(), (getattr(param, "_sharded_param_data", None)
                                                            for group in _param_groups(model)
                                                            for param in group.fsdp_params)))
    tracker.register(model.buffers() if offloaded is not None else
                     itertools.chain(model.parameters(), model.buffers()), "parameters", model=model)
    return model


@contextlib.contextmanager
def _fakes_of_meta(fake_mode: Any) -> Iterator[None]:
    """Let ``fake_mode`` (if any) make fakes from ``meta`` tensors: ``to_empty`` reads only their shapes."""
    if fake_mode is None or fake_mode.allow_non_fake_inputs:
        yield
        return
    fake_mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        fake_mode.allow_non_fake_inputs = False


def _copy_values(host: nn.Module, model: nn.Module, rank: int, world_size: int) -> None:
    """This rank's part of every host parameter (FSDP's dim-0 chunks) and every buffer, into ``model``."""
    from torch.distributed.tensor import DTensor

    params = dict(host.named_parameters())
    for name, p in model.named_parameters():
        value = params[name].detach()
        target: torch.Tensor = p
        if isinstance(p, DTensor):
            chunks = torch.chunk(value, world_size, dim=0) if value.dim() else (value,)
            value = chunks[rank] if rank < len(chunks) else value[:0]
            target = p.to_local()
        target.copy_(value)
    buffers = dict(host.named_buffers())
    for name, b in model.named_buffers():
        b.copy_(buffers[name])


@dataclass(frozen=True)
class Sharding:
    """How the fit rule runs under FSDP: how the model is placed and when gradients synchronise.

    The fit rule itself is one record, :class:`~autotune.results.request.FitRule` (torch-free, as every
    request is); this is its runtime part where it shards, made by :meth:`of`, with the torch that places
    the model. A FitRule under DDP needs no runtime part: its ``buckets`` is the fit-rule run's
    ``data_parallel``.

    ``world_size`` ranks, measured as ``rank``; ``precision`` picks the
    mixed-precision policy; ``real_group``: shard over the active default
    process group instead of a private fake one (its size and rank then hold);
    ``sync_every``: reduce-scatter the gradients after every micro-step (they
    accumulate in their shards) instead of at the last micro-step only (the
    unsharded gradients then live from the first micro-step to the last);
    ``offload``: FSDP2's CPU offload, the shards and the optimizer state on the
    host (:mod:`autotune.probing.fsdpoffload`); an estimate standing in for a GPU
    counts the host apart from the device, and ``host_apart`` asks the same of
    any device (a CPU run counted as a GPU would see it).
    """

    world_size: int
    rank: int = 0
    precision: str = "fp32"
    real_group: bool = False
    sync_every: bool = False
    offload: bool = False
    host_apart: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} must be in [0, world_size={self.world_size})")

    @classmethod
    def of(cls, rule: FitRule, precision: str = "fp32") -> Sharding | None:
        """How ``rule`` shards (None when it does not), all-gathered in ``precision`` (``fsdp_sync`` "auto" is
        measured as "last": :func:`autotune.probing.fsdpsync.probe_chosen` measures both and picks)."""
        if not rule.sharded:
            return None
        return cls(rule.world_size, rule.rank, precision, sync_every=rule.fsdp_sync == "every", offload=rule.offload)

    @contextlib.contextmanager
    def scope(self, session: Session) -> Iterator[Callable[[Workload], nn.Module]]:
        """For one measurement: a process group and a function placing a workload's model, sharded.

        When the work fails (an out-of-memory error mid-step), every model placed
        here gives back what FSDP holds beyond its shards before the error
        leaves: the unsharded parameters, unsharded gradients, communication
        buffers; a probe's next trial starts from the baseline.
        """
        device = session.torch_device
        placed: list[nn.Module] = []
        with contextlib.ExitStack() as stack:
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            stack.enter_context(shape_propagation_uncounted(session.tracker))
            if not self.real_group and not torch.distributed.is_available():
                raise NeedsFakeTensors("this torch build has no torch.distributed, which FSDP needs")
            with session.tracker.paused():
                mesh = real_mesh(device.type) if self.real_group else \
                    stack.enter_context(fake_mesh(self.world_size, self.rank, device.type))
            if session.on_meta:
                if self.precision != "fp32" and not session.cuda_like:
                    raise NeedsFakeTensors(f"FSDP's {self.precision} units on the CPU: the CPU's reduced-precision "
                                           "kernels (layer norm's statistics in bf16) are not stood in for on meta")
                stack.enter_context(fsdp_on_meta())
            stack.enter_context(strided_flag_read_once())
            host = stack.enter_context(host_apart(session.tracker, on_meta=session.on_meta)) \
                if self.apart(session) else None

            def place(workload: Workload) -> nn.Module:
                model = sharded_model(session, workload.make_model, workload.shard_units, mesh, self.precision,
                                      self.offload, host)
                placed.append(model)
                return model

            def release_placed() -> None:
                for model in placed:
                    release(model)

            try:
                with undo_on_failure(release_placed):
                    yield place
            finally:
                placed.clear()

    def apart(self, session: Session) -> bool:
        """Is the host told apart from the device here: offload, on an estimate standing in for a GPU (CUDA does it
        itself) or as ``host_apart`` asks."""
        return self.offload and (self.host_apart or (session.cuda_like and session.torch_device.type != "cuda"))

    def sync(self, model: nn.Module, *, last: bool) -> None:
        """Gradients are reduce-scattered on the last micro-step only, or on every one (``sync_every``)."""
        model.set_requires_gradient_sync(last or self.sync_every)  # type: ignore[operator]

    @staticmethod
    def tag_gradients(session: Session, model: nn.Module) -> None:
        """The sharded gradients and the unsharded ones kept between micro-steps."""
        session.tag_gradients(model)
        session.tracker.tag(_unsharded_gradients(model), "gradients")


def _param_groups(model: nn.Module) -> Iterator[Any]:
    """FSDP's parameter groups of every sharded module of ``model`` (FSDP2 internals)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield from compat.fsdp_param_groups(module)


def _unsharded_gradients(model: nn.Module) -> Iterator[torch.Tensor | None]:
    for group in _param_groups(model):
        for param in group.fsdp_params:
            yield getattr(param, "unsharded_accumulated_grad", None)
            unsharded = compat.unsharded_param(param)
            yield None if unsharded is None else unsharded.grad


#: What FSDP's own checks raise on a unit that a failed step left half way (its asserts, torch's errors).
_MID_STEP = (RuntimeError, AssertionError)


def release(model: nn.Module) -> None:
    """Give back what FSDP holds beyond the shards after a step that did not finish: reshard
    every unit, drop unsharded and sharded gradients, all-gather results and reduce-scatter buffers."""
    for group in _param_groups(model):
        with contextlib.suppress(*_MID_STEP):
            group.reshard()
        compat.drop_all_gather_result(group)
        context = getattr(group, "comm_ctx", None)
        if context is not None:
            context.all_gather_state = None
            getattr(context, "reduce_scatter_states", []).clear()
        for param in group.fsdp_params:
            param.unsharded_accumulated_grad = None
            unsharded = compat.unsharded_param(param)
            if unsharded is not None:
                unsharded.grad = None
            with contextlib.suppress(*_MID_STEP):
                param.free_unsharded_param()
    for p in model.parameters():
        p.grad = None


def fake_engine(device: EstimateDevice) -> EstimateDevice:
    """``device`` estimating under FakeTensorMode (the meta engine's fallback)."""
    if device.engine == "fake":
        return device
    other = copy.copy(device)
    other.engine = "fake"
    return other


def sharding_note(sharding: Sharding) -> str:
    """What the probe's figures are, under FSDP."""
    group = "the process group" if sharding.real_group else "a fake process group"
    held = ("gradients reduce-scattered after every micro-step" if sharding.sync_every else
            "the unsharded gradients kept until the last micro-step synchronises")
    shards = ("the shards of the parameters, gradients and optimizer state on the host (CPU offload), their copies "
              "to the device for each all-gather" if sharding.offload else
              "its shards of the parameters, gradients and optimizer state")
    return (f"FSDP: the fit rule of rank {sharding.rank} of {sharding.world_size} with fully_shard ({group}): "
            f"{shards}, the unsharded units in flight, {held}, the reduce-scatter buffers")
