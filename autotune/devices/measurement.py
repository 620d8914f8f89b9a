"""One measured piece of work: the :class:`Session` it runs in, the :class:`Measurement` it gives.

A device runs a piece of work inside a :class:`Session` and returns what the
work returned together with a :class:`Measurement` of its peak memory. The
session is where the device-specific parts live: how a model and a batch get
onto the device, and which tracker counts them. :func:`timed_measure` runs it
inside an :class:`~autotune.devices.session.EstimateSession`, which owns every
change a measurement makes to torch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from ..compat import buffer_slots, import_compiler, parameter_slots, tree_flatten, tree_map
from .compiled import compiled_parts
from .nested import make_view_dummy
from .session import EstimateSession
from .tracker import LiveStorageTracker

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """Peak device memory of one piece of work, and where it went at the peak.

    ``peak_bytes`` decides whether the work fits: the live tensor bytes on the
    CPU, the caching allocator's reserved peak on CUDA (measured on a GPU,
    simulated by an estimate standing in for one). ``tracked_peak_bytes`` is
    the peak of live tensor-storage bytes the tracker counted (``breakdown``
    and ``timeline`` are of those). Where a caching allocator decides,
    ``allocated_peak_bytes`` is its allocated peak (blocks handed to tensors
    and kernels) and ``alloc_retries`` how often it had to free its cache and
    retry a cudaMalloc; None elsewhere. ``notes``: what an estimate bounded or
    assumed. ``unknown_reads``: values of shape-only tensors an estimate had to
    guess in the forward and backward (they depend on parameters, or were too
    large to keep); ``answered_reads``: those it answered exactly from values
    computed from the batch alone, and ``answered_shapes`` the data-dependent
    output shapes it took from them; ``unknown_origin``: where the first value it guessed came from, in words
    (None: nothing said). ``replay_seconds``: the part of ``seconds`` an estimate spent
    replaying its trace through the allocator simulation, ``trace`` that trace (``(key, nbytes, stream)``
    per allocation, ``nbytes`` -1 per free; empty where nothing was simulated).
    """

    peak_bytes: int
    tracked_peak_bytes: int
    breakdown: dict[str, int]
    seconds: float
    timeline: tuple[int, ...] = field(repr=False, default=())
    unknown_reads: int = 0  # values an estimate had to guess in the forward and backward
    answered_reads: int = 0  # values an estimate read exactly: computed from the batch alone
    answered_shapes: int = 0  # data-dependent output shapes an estimate took from such values
    unknown_origin: str | None = None
    allocated_peak_bytes: int | None = None
    alloc_retries: int | None = None
    notes: tuple[str, ...] = ()
    replay_seconds: float = 0.0
    trace: tuple[tuple[int, int, int], ...] = field(repr=False, default=(), compare=False)

    def __post_init__(self) -> None:
        if self.peak_bytes < 0 or self.tracked_peak_bytes < 0 or self.seconds < 0:
            raise ValueError(f"measurement figures must be >= 0: {self}")
        if (self.allocated_peak_bytes or 0) < 0 or (self.alloc_retries or 0) < 0:
            raise ValueError(f"allocator figures must be >= 0: {self}")


_CPU = torch.device("cpu")


class Session:
    """One measured piece of work on a device: puts models and batches there.

    ``move`` turns a host tensor into a device tensor (identity on the CPU,
    ``.to(cuda)`` on a GPU, a fake or meta tensor for estimates);
    ``build_model`` and ``build_batch`` wrap the host-side code that makes
    models and batches (estimates build them without real memory).
    ``compiled`` names what the work runs compiled (``torch.compile``): the
    model's compiled modules, found as it is built, and what the work reports
    through :meth:`found_compiled`; ``on_compiled()`` is called at the first.
    ``on_meta``: the work's device tensors are ``meta`` tensors (an estimate's meta engine).
    """

    def __init__(self, tracker: LiveStorageTracker, *, move: Callable[[torch.Tensor], torch.Tensor],
                 move_model: Callable[[nn.Module], nn.Module] | None = None,
                 build_batch: Callable[[Callable[[], Any]], Any] | None = None,
                 build_model: Callable[[Callable[[], Any]], Any] | None = None, cuda_like: bool = False,
                 torch_device: torch.device = _CPU, on_compiled: Callable[[], None] | None = None,
                 on_meta: bool = False):
        self.tracker = tracker
        self.compiled: list[str] = []
        self._on_compiled = on_compiled
        self._move = move
        self._move_model = move_model or (lambda m: _move_module(m, move))
        self._build_batch = build_batch
        self._build_model = build_model
        self.cuda_like = cuda_like
        self.torch_device = torch_device
        self.on_meta = on_meta

    def move(self, tree: Any) -> Any:
        """Move every tensor of a pytree to the device and count it."""
        moved = tree_map(lambda t: self._move(t) if isinstance(t, torch.Tensor) else t, tree)
        self.tracker.register(leaf for leaf in tree_flatten(moved)[0] if isinstance(leaf, torch.Tensor))
        return moved

    def host_model(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """Build a model on the host, not counted (an estimate builds it on ``meta``)."""
        with self.tracker.paused():
            model = self._build_model(factory) if self._build_model is not None else factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def model(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """Build a model on the host (not counted), move it, count its parameters and buffers."""
        model = self._move_model(self.host_model(factory))
        self.tracker.register(_tensors(model), "parameters", model=model)
        self.found_compiled(*compiled_parts(model))
        return model

    def found_compiled(self, *names: str) -> None:
        """The work runs these compiled (``torch.compile``)."""
        if names and not self.compiled and self._on_compiled is not None:
            self._on_compiled()
        self.compiled += [n for n in names if n not in self.compiled]

    def optimizer(self, factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                  model: nn.Module) -> torch.optim.Optimizer:
        opt = factory(model.parameters())
        if self.cuda_like:
            # Stand in for a CUDA device faithfully: there, optimizers left at
            # foreach=None take the multi-tensor path, whose temporaries differ.
            for group in opt.param_groups:
                if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                    group["foreach"] = True
        return opt

    def batch(self, fn: Callable[[int, torch.Generator], Any], size: int, generator: torch.Generator) -> Any:
        """Build a micro-batch on the host (not counted), then move it to the device (counted)."""
        if self._build_batch is not None:
            host = self._build_batch(lambda: fn(size, generator))
        else:
            with self.tracker.paused():
                host = fn(size, generator)
        return self.move(host)

    def tag_gradients(self, model: nn.Module) -> None:
        self.tracker.tag((p.grad for p in model.parameters()), "gradients")

    def tag_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.tracker.tag(_state_tensors(opt), "optimizer_state")


def _tensors(model: nn.Module) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _state_tensors(opt: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def _move_module(model: nn.Module, move: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """Apply ``move`` to every parameter and buffer in place (the CPU and fake paths).

    A parameter shared by several modules (tied weights) becomes one moved
    parameter, shared as before.
    """
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        params = parameter_slots(module)
        for name, param in list(params.items()):
            if param is None:
                continue
            if id(param) not in done:
                moved = move(param)  # not param.data: that would dispatch a detach under fake mode
                done[id(param)] = param if moved is param else nn.Parameter(moved, requires_grad=param.requires_grad)
            params[name] = done[id(param)]
        buffers = buffer_slots(module)
        for name, buf in list(buffers.items()):
            if buf is not None:
                buffers[name] = move(buf)
    return model


def timed_measure(tracker: LiveStorageTracker, session: Session, work: Callable[[Session], T],
                  *, peak: Callable[[], int] | None = None) -> tuple[T, Measurement]:
    """Run ``work`` under ``tracker`` and package what it saw."""
    _load_dispatch_machinery()
    with EstimateSession():
        start = time.perf_counter()
        with tracker:
            result = work(session)
        seconds = time.perf_counter() - start
    snap = tracker.snapshot()
    return result, Measurement(
        peak_bytes=peak() if peak is not None else snap.peak_bytes,
        tracked_peak_bytes=snap.peak_bytes,
        breakdown=snap.breakdown,
        seconds=seconds,
        timeline=snap.timeline,
        unknown_reads=snap.unknown_reads,
    )


@functools.cache
def _load_dispatch_machinery() -> None:
    """PyTorch imports its compiler stack (over a second) on the first op dispatched
    through any Python mode; that happens here once, before any measurement's clock starts."""
    import_compiler()  # all of it: a function mode (the CUDA stand-in's) imports more of it than a dispatch mode
    make_view_dummy()  # nested tensors' view dummy, made once per process: before any measurement counts it
    with LiveStorageTracker():
        torch.empty(0)
