"""FSDP's CPU offload (``fully_shard(offload_policy=CPUOffloadPolicy())``) as a GPU's memory sees it.

Under offload the sharded parameters, the sharded gradients and the optimizer state live on the host. Before
each all-gather FSDP copies the unit's parameter shards to the device; after each reduce-scatter it copies the
gradient shards to the host (adding them there to those of earlier micro-steps); the optimizer steps on the
CPU. The device holds those copies while they are gathered, the reduce-scatter's output until its shards are
copied out, and whatever FSDP holds without offload (the unsharded units in flight, the unsharded gradients
between micro-steps that do not sync, the buffers).

On CUDA the device tells the two memories apart itself, and on the CPU they are one memory: FSDP runs there as
it is. An estimate standing in for a GPU runs FSDP's own offload code on its shape-only tensors with the host
told apart (:func:`host_apart`): the shards are not counted; FSDP's copy of a gradient shard to the host is a host
tensor, not counted; its copy of a parameter shard to the device is a device tensor, counted; and the optimizer
step counts nothing. A real CPU run under the same accounting is what the estimate is checked against.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import compat
from ..devices.session import EstimateSession

#: The host of the FSDP run being measured, while one is (the estimate session's lock keeps it to one at a time).
_ACTIVE: list[Host] = []


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s data (a DTensor's local shard)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class Host:
    """The storages that live on the host (by identity, while they live), the bytes they hold now and the most
    they held at once."""

    def __init__(self, tracker: Any):
        self.tracker = tracker
        self._held: dict[int, weakref.ref] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def keep(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """These tensors' storages are on the host from now on (the tracker does not count them)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = _local(t).untyped_storage()
                if not self._holds(storage):
                    self._held[id(storage)] = weakref.ref(storage, functools.partial(
                        self._gone, id(storage), storage.nbytes()))
                    self.current_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _gone(self, key: int, nbytes: int, ref: weakref.ref) -> None:
        if self._held.get(key) is ref:
            del self._held[key]
        self.current_bytes -= nbytes

    def _holds(self, storage: torch.UntypedStorage) -> bool:
        ref = self._held.get(id(storage))
        return ref is not None and ref() is storage

    def holds(self, t: torch.Tensor) -> bool:
        return self._holds(_local(t).untyped_storage())

    def copy_out(self, t: torch.Tensor) -> torch.Tensor:
        """FSDP's copy of a device tensor to the host: a host tensor, not counted."""
        with self.tracker.paused():
            out = t.clone()
        self.keep([out])
        return out


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """The device ``Tensor.to(*args, **kwargs)`` copies to (None: a cast only)."""
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (torch.device, str)):
            target = a
            break
    return None if target is None else torch.device(target)


class _Copies(TorchFunctionMode):
    """Inside FSDP's copy-in of the parameter shards (``to_device``) or its reduce-scatter: ``Tensor.to`` of a
    host shard to the device is a counted device copy; ``Tensor.to`` of a device tensor to the CPU a host copy."""

    def __init__(self, host: Host):
        super().__init__()
        self.host = host

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and isinstance(args[0], torch.Tensor):
            target = _device_of(args, kwargs)
            if target is not None and self.host.holds(args[0]):
                return args[0].clone()  # the shard copied to the device: counted there
            if target is not None and target.type == "cpu":
                return self.host.copy_out(args[0])
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_apart(tracker: Any, *, on_meta: bool) -> Iterator[Host]:
    """While inside, FSDP's offload copies are counted as a GPU's memory sees them (see the module); the
    :class:`Host` to keep the sharded parameters in. ``on_meta``: the shards are ``meta`` tensors, which FSDP's
    check that they were made on the CPU is told to let through."""
    host = Host(tracker)
    (param, gather), (group_module, reduce), (group, check) = compat.fsdp_offload_places()
    gathered = getattr(param, gather)
    reducing = getattr(group_module, reduce)

    @property  # type: ignore[misc]
    def inputs(self: Any) -> Any:
        with _Copies(host):
            return gathered.fget(self)

    @functools.wraps(reducing)
    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        with _Copies(host):
            return reducing(*args, **kwargs)

    saved = [(param, gather, gathered), (group_module, reduce, reducing), (group, check, getattr(group, check))]
    with EstimateSession():
        setattr(param, gather, inputs)
        setattr(group_module, reduce, reduce_scatter)
        if on_meta:
            setattr(group, check, lambda self: None)
        _ACTIVE.append(host)
        try:
            yield host
        finally:
            _ACTIVE.remove(host)
            for owner, name, original in saved:
                setattr(owner, name, original)


def offloading() -> bool:
    """Does an optimizer step now run on the host (inside :func:`host_apart`)?"""
    return bool(_ACTIVE)


@contextlib.contextmanager
def optimizer_on_host(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer step of an offloaded model, inside :func:`host_apart`: it runs on the host (nothing it
    makes is counted), and its state is kept there. Outside one, nothing changes."""
    if not _ACTIVE:
        yield
        return
    host = _ACTIVE[-1]
    with host.tracker.paused():
        yield
    host.keep(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def offload_policy(device_type: str) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for shards computed on ``device_type``: host memory pinned for CUDA's copies
    (pinning needs an accelerator: not on the CPU or an estimate)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type == "cuda")

