"""Estimates: the fit rule on fake tensors, no real compute, no real memory.

Nothing real is allocated for weights or activations, so a whole training step
of a billion-parameter model is estimated here in under a second; the tracker
counts what the real device would hold. Two engines run the fit rule:

- ``meta`` (the default): every tensor lives on the ``meta`` device, ops run
  through memoised meta kernels (:mod:`autotune.devices.meta`), and composite
  ops choose their kernels as on the CPU. Several times faster.
- ``fake``: every tensor is a ``FakeTensorMode`` fake on the CPU device (its
  storage on ``meta``), which behaves as a CPU tensor throughout. A workload the
  meta engine cannot run (CPU autocast, code that insists on a CPU tensor, a
  recurrent layer standing in for a GPU) falls back to it, once, and stays
  there; the description says why. ``AUTOTUNE_ESTIMATE_ENGINE=fake`` makes it
  the default.

On both engines the batch is built for real on the host, as the real run
builds it, and what is computed from it and from constants alone carries its
value (:mod:`autotune.devices.values`): reads of such values and the shapes
they decide (:mod:`autotune.devices.shaperules`) are exact; sizes that depend
on parameters are taken at their upper bound, or stop the estimate when they
have none.

Standing in for a CUDA device (``cuda_like``):

- the allocation trace (every storage created and freed, with its exact size)
  is replayed through :class:`~autotune.devices.allocator.CachingAllocator`, a
  simulation of CUDA's caching allocator, with the GPU's capacity and the
  allocator settings read when the device was made (``PYTORCH_CUDA_ALLOC_CONF``,
  else ``PYTORCH_ALLOC_CONF``, as torch reads them); the simulated
  *reserved* peak is the peak that decides (``Measurement.peak_bytes``), next to
  the allocated peak and the release-and-retry count;
- the kernels CUDA would choose run instead of the CPU's
  (:mod:`autotune.devices.cudakernels`: attention backends, cuBLAS workspaces,
  backward scratch buffers);
- optimizers left at ``foreach=None`` take the multi-tensor path CUDA would pick,
  and a stated allowance for the CUDA context and libraries is taken off the
  GPU's memory.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..compat import FakeTensor, FakeTensorMode, tree_flatten, unset_fake_temporarily
from ..errors import BadInput, WorkloadError
from ..results.device import DeviceInfo
from ..units import format_bytes
from .allocator import AllocatorConfig
from .allocconf import conf_from_environment, describe_conf
from .compiled import eager_compiled, eager_note
from .cpukernels import CpuKernelChoices
from .cudakernels import CudaKernelChoices, CudaTarget
from .cudastandin import DeviceLists, GpuAnswers, StandIn
from .measurement import Measurement, Session, T, _move_module, timed_measure
from .meta import META_ERRORS, MetaKernels, NeedsFakeTensors, meta_cannot_run
from .nested import NotShapeOnly, is_jagged, nested_on_meta, to_meta
from .presets import CONTEXT_ALLOWANCE, DEFAULT_CAPABILITY, GpuPreset
from .replay import Event, Replay, replay
from .session import EstimateSession, fakes_not_traced, optimizer_lists
from .shaperules import rule_kernels
from .tracker import LiveStorageTracker
from .values import BATCH_LIMIT, KnownValues, Unbounded, batch_bytes

#: What a CUDA process holds outside PyTorch's allocator: the context, cuBLAS and
#: cuDNN handles. Typical of torch 2.x with lazy module loading (see presets).
CUDA_CONTEXT_ALLOWANCE = CONTEXT_ALLOWANCE
CUDA_ROUNDING = 512  # the caching allocator's smallest block (kMinBlockSize), which the simulation applies
ENGINES = ("meta", "fake")
#: What the meta engine's inability is raised as (:func:`~autotune.devices.meta.meta_cannot_run` decides).
_FALLBACK_ERRORS = (NeedsFakeTensors, WorkloadError, *META_ERRORS)
ENGINE_VARIABLE = "AUTOTUNE_ESTIMATE_ENGINE"
_MEASURED_BY = {
    "meta": "live tensor-storage bytes of meta tensors (no real compute)",
    "fake": "live tensor-storage bytes under FakeTensorMode (no real compute)",
}
_SIMULATED_BY = {
    "meta": "reserved peak of a simulated CUDA caching allocator replaying the allocations of meta tensors "
            "(no real compute)",
    "fake": "reserved peak of a simulated CUDA caching allocator replaying the allocations of FakeTensorMode "
            "tensors (no real compute)",
}


class EstimateDevice:
    """A device that exists only as an estimate (``estimated = True``).

    ``capacity`` is the memory of the device stood in for, ``allowance`` what is
    taken off it for memory outside PyTorch's allocator. With ``cuda_like`` it
    stands in for a CUDA GPU: ``target`` (compute capability, library versions,
    cuBLAS settings) picks the kernels, and unless ``simulate`` is False the
    allocation trace is replayed through the caching-allocator simulation under
    ``alloc_conf`` (default: ``$PYTORCH_CUDA_ALLOC_CONF``, else ``$PYTORCH_ALLOC_CONF``, when the device
    is made; ``alloc_conf_variable`` names the variable a given one came from), ``device_total`` being
    the GPU's whole memory. ``model`` names the GPU (a preset); ``budget_given``: the capacity is the
    user's memory budget.
    """

    estimated = True

    torch_device = torch.device("meta")  # where the work's tensors live; no allocator can run out

    def __init__(self, *, capacity: int, round_to: int = 1, cuda_like: bool = True,
                 allowance: int = 0, name: str = "estimate", engine: str | None = None, guess: int = 0,
                 target: CudaTarget | None = None, alloc_conf: str | None = None, device_total: int | None = None,
                 model: str | None = None, budget_given: bool = True, simulate: bool = True,
                 alloc_conf_variable: str | None = None, real_gpu: bool = False):
        if capacity - allowance <= 0:
            raise ValueError(
                f"memory budget {format_bytes(capacity)} leaves nothing after the "
                f"{format_bytes(allowance)} allowance for the CUDA context"
            )
        engine = default_engine() if engine is None else engine
        if engine not in ENGINES:
            raise BadInput(f"unknown estimate engine {engine!r}; use one of {', '.join(ENGINES)}")
        self.name = name
        self.capacity = capacity  # the memory of the device stood in for; capacity_bytes() is what PyTorch may use
        self.allowance = allowance
        self.round_to = round_to
        self.cuda_like = cuda_like
        self.engine = engine
        self.fallback: str | None = None  # why the meta engine gave way to FakeTensorMode
        self.guess = guess  # which answers unknown values get (see LiveStorageTracker)
        self.target = target if target is not None else CudaTarget.from_environment(DEFAULT_CAPABILITY)
        self.model = model
        self.budget_given = budget_given
        self.device_total = device_total if device_total is not None else capacity
        # The allocator settings as they are now: the allocator the training process will run with.
        self.alloc_conf, self.alloc_conf_variable = conf_from_environment() if alloc_conf is None else \
            (alloc_conf, alloc_conf_variable)
        self.allocator: AllocatorConfig | None = None
        self.not_simulated: str | None = None  # why the allocator is not simulated, when it is not
        self.simulate = simulate
        self.real_gpu = real_gpu  # stands in for this machine's GPU: torch.cuda answers for it itself
        self.cpu_moves: list[str] = []  # where the user's code moved a device tensor to the CPU (file:line)
        if cuda_like and simulate:
            self.allocator, self.not_simulated = _allocator_config(self.alloc_conf, self.alloc_conf_variable)
        if cuda_like and self.allocator is None:  # no simulation: at least CUDA's 512-byte rounding
            self.round_to = max(round_to, CUDA_ROUNDING)
        self._kernels = MetaKernels()
        self._nested_batches = False  # the batch holds a nested tensor of jagged layout: built for real only

    def _settings(self) -> dict[str, Any]:
        return dict(capacity=self.capacity, round_to=self.round_to, cuda_like=self.cuda_like, allowance=self.allowance,
                    name=self.name, engine=self.engine, target=self.target, alloc_conf=self.alloc_conf,
                    device_total=self.device_total, model=self.model, budget_given=self.budget_given,
                    simulate=self.simulate, alloc_conf_variable=self.alloc_conf_variable, real_gpu=self.real_gpu)

    def with_other_guesses(self) -> EstimateDevice:
        """This estimate, answering every value it cannot know differently: when a run's peak
        changes with the answers, the values decide shapes and the estimate cannot be trusted."""
        other = EstimateDevice(**self._settings(), guess=1 - self.guess)
        other.fallback = self.fallback
        return other

    @classmethod
    def for_gpu(cls, budget: int, engine: str | None = None) -> EstimateDevice:
        """The ``estimate`` device of the CLI: a CUDA GPU with ``budget`` bytes of memory."""
        return cls(capacity=budget, cuda_like=True, allowance=CUDA_CONTEXT_ALLOWANCE, engine=engine)

    @classmethod
    def for_preset(cls, preset: GpuPreset, memory_budget: int | None = None,
                   engine: str | None = None) -> EstimateDevice:
        """``estimate:NAME``: the GPU ``preset`` (its NVML memory, or ``memory_budget`` when given)."""
        total = memory_budget if memory_budget is not None else preset.total_bytes
        return cls(capacity=total, cuda_like=True, allowance=preset.allowance_bytes, engine=engine,
                   name=f"estimate:{preset.name}", target=CudaTarget.from_environment(preset.capability),
                   device_total=preset.total_bytes, model=preset.model, budget_given=memory_budget is not None)

    @property
    def simulates(self) -> bool:
        """Does the caching-allocator simulation decide the peak?"""
        return self.allocator is not None

    def capacity_bytes(self) -> int:
        capped = self.fraction_cap()
        return self.capacity - self.allowance if capped is None else capped

    def fraction_cap(self) -> int | None:
        """What ``per_process_memory_fraction`` lets the allocator reserve (the fraction of the GPU's total memory,
        as ``torch.cuda.set_per_process_memory_fraction`` caps it), where that is less than the memory the CUDA
        context leaves; else None."""
        fraction = self.allocator.per_process_memory_fraction if self.allocator is not None else 1.0
        if fraction >= 1.0:
            return None
        capped = int(fraction * self.device_total)
        return capped if capped < self.capacity - self.allowance else None

    def measure(self, work: Callable[[Session], T], *, enforce_capacity: bool = False) -> tuple[T, Measurement]:
        # Estimates never emulate an OOM: they measure the whole step and compare. Everything an estimate
        # changes in torch lives in one session, one measurement at a time.
        with EstimateSession(quiet=True), eager_compiled():
            if self.engine == "fake":
                return self._measure_fake(work)
            try:
                return self._measure_meta(work)
            except _FALLBACK_ERRORS as exc:
                reason = meta_cannot_run(exc)
                if reason is None:
                    raise  # the work's own error: it surfaces as it is, the engine stays
                del exc
            try:
                result = self._measure_fake(work)  # the workload's own error, if it fails here
            except NotShapeOnly as exc:  # nor can FakeTensorMode: both reasons
                raise NotShapeOnly(f"{exc}; and the meta engine cannot run this workload ({reason})") from None
            self.engine, self.fallback = "fake", reason  # the meta engine cannot run it: FakeTensorMode can
            return result

    def _tracker(self, **kwargs: Any) -> LiveStorageTracker:
        return LiveStorageTracker(round_to=self.round_to, fake_scalars=True, guess=self.guess,
                                  record=self.simulates, **kwargs)

    def _kernel_choices(self, tracker: LiveStorageTracker, *, fake: bool) -> Any:
        """CUDA's kernel choices when standing in for a GPU (on FakeTensorMode's CPU-faked tensors too);
        the CPU's on the meta engine otherwise (FakeTensorMode makes the CPU's itself)."""
        if self.cuda_like:
            return CudaKernelChoices(tracker, self.target, key="AutogradCPU" if fake else "AutogradMeta")
        return contextlib.nullcontext() if fake else CpuKernelChoices(tracker.paused)

    def _stand_in(self, device: str) -> StandIn | None:
        """The CUDA GPU this estimate stands in for, as the user's code sees it, on ``device``; None when it
        stands in for no GPU."""
        if not self.cuda_like:
            return None
        answers = None
        if not (self.real_gpu and torch.cuda.is_available()):
            answers = GpuAnswers(name=self.model or "CUDA GPU (estimate)", capability=self.target.capability,
                                 total_bytes=self.device_total, free_bytes=self.capacity_bytes())
        return StandIn(torch.device(device), answers, self.cpu_moves)

    def standing_in(self) -> Any:
        """A block in which the user's code sees the GPU this estimate stands in for (its model factory run
        outside a measurement, as the probe checks it), with ``"cuda"`` tensors on ``meta``; nothing when it
        stands in for no GPU."""
        return _installed(self._stand_in("meta"))

    def importing(self) -> Any:
        """A block in which a probe file is imported as on the GPU this estimate stands in for, where this machine
        has none: ``torch.cuda`` answers for it, so a device chosen at import (``"cuda" if
        torch.cuda.is_available() else "cpu"``) is the GPU's, as when the file runs there, and ``"cuda"`` tensors
        made at import are shape-only; nothing otherwise (a real GPU answers for itself; the CPU is the CPU)."""
        stand_in = self._stand_in("meta")
        return _installed(stand_in if stand_in is not None and stand_in.answers is not None else None)

    def _finish(self, m: Measurement, tracker: LiveStorageTracker, choices: Any,
                stand_in: StandIn | None = None) -> Measurement:
        """The simulated allocator's figures for the recorded trace, and what the kernels and values bounded."""
        notes = tuple(getattr(choices, "notes", ())) + (stand_in.notes() if stand_in is not None else ())
        values = tracker.values
        if values is not None:
            notes += values.notes()
            m = replace(m, answered_reads=values.reads, answered_shapes=values.shapes,
                        unknown_origin=values.unknown_origin)
        if self.not_simulated:
            notes += (self.not_simulated,)
        if tracker.trace is None or self.allocator is None:
            return replace(m, notes=notes)
        return self.replayed(replace(m, notes=notes), tracker.trace)

    def replayed(self, m: Measurement, trace: Sequence[Event]) -> Measurement:
        """``m`` with the caching-allocator simulation's figures for ``trace`` (its reserved peak deciding), the
        seconds of the replay added (this estimate simulates one)."""
        r = self.replay(trace)
        notes = m.notes
        if r.out_of_memory:
            notes += (f"the simulated caching allocator runs out of memory at {format_bytes(self.capacity_bytes())}"
                      f" even after freeing its cache; it would reserve {format_bytes(r.reserved_peak)}",)
        return replace(m, peak_bytes=r.reserved_peak, allocated_peak_bytes=r.allocated_peak, alloc_retries=r.retries,
                       notes=notes, seconds=m.seconds + r.seconds, replay_seconds=r.seconds, trace=tuple(trace))

    def replay(self, trace: Sequence[Event]) -> Replay:
        """``trace`` replayed through this estimate's caching-allocator simulation (it simulates one)."""
        assert self.allocator is not None
        return replay(trace, capacity=self.capacity_bytes(), conf=self.allocator, device_total=self.device_total)

    def _measure_meta(self, work: Callable[[Session], T]) -> tuple[T, Measurement]:
        values = KnownValues(self._kernels, cpu=not self.cuda_like)
        tracker = self._tracker(kernel=values, values=values)

        def build_model(factory: Callable[[], Any]) -> Any:
            with values.suspended(), torch.device("meta"):
                return factory()

        stand_in = self._stand_in("meta")

        def build_batch(make: Callable[[], Any]) -> Any:
            with tracker.paused(), _on_host(stand_in):
                if self._nested_batches:  # FakeTensorMode cannot build a nested tensor: no shape-only try
                    return make()
                reads = tracker.unknown_reads
                batch = _build_batch(FakeTensorMode(allow_non_fake_inputs=True), make, values)
                if values.shape_only_batch is None:  # built for real: what its shape-only build read is void
                    tracker.unknown_reads = reads
                self._nested_batches = any(isinstance(t, torch.Tensor) and is_jagged(t)
                                           for t in tree_flatten(batch)[0])
                return batch

        def move_model(model: Any) -> Any:
            with tracker.paused():  # counted by the session, parameters first, as on a real device
                return _move_module(model, _on_meta)

        def move(t: torch.Tensor) -> torch.Tensor:
            if is_jagged(t):  # a nested tensor's parts, moved as a real device's clone() moves them
                with tracker.paused():
                    mirror = to_meta(t, _meta_copy, values.move)
                return mirror.clone()
            return values.move(t, _meta_copy(t))

        session = Session(tracker, move=move, move_model=move_model, build_model=build_model,
                          build_batch=build_batch, cuda_like=self.cuda_like, on_meta=True)
        choices = self._kernel_choices(tracker, fake=False)
        nested = nested_on_meta("cuda" if self.cuda_like else "cpu", values.move)
        with _meta_installed(stand_in), choices, rule_kernels(values, "AutogradMeta"), nested:
            result, m = timed_measure(tracker, session, work)
        return result, _said_eager(self._finish(m, tracker, choices, stand_in), session)

    def _measure_fake(self, work: Callable[[Session], T]) -> tuple[T, Measurement]:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        values = KnownValues(fake_mode=fake_mode, cpu=not self.cuda_like)
        tracker = self._tracker(kernel=values, values=values)

        def move(t: torch.Tensor) -> torch.Tensor:
            # A copy, as moving to a real device makes: a view of a host dataset
            # then counts as its own elements, not as the whole dataset.
            if is_jagged(t):
                raise NotShapeOnly("FakeTensorMode cannot hold a nested tensor of jagged layout (its ragged size "
                                   "needs a shape environment)")
            return values.move(t, (t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t)).clone())

        def build_model(factory: Callable[[], Any]) -> Any:
            # On meta, outside FakeTensorMode (deep copies and dtype changes of fake
            # parameters trip it); move_model then makes CPU fakes of them.
            with values.suspended():
                try:
                    with unset_fake_temporarily(), torch.device("meta"):
                        return factory()
                except _FALLBACK_ERRORS as exc:
                    if meta_cannot_run(exc) is None:
                        raise
                return factory()  # code that needs real data, on FakeTensorMode's CPU fakes

        def move_model(model: Any) -> Any:
            faked: dict[int, torch.Tensor] = {}  # one fake per tensor: shared buffers stay shared

            def fake(t: torch.Tensor) -> torch.Tensor:
                if isinstance(t, FakeTensor):
                    return t
                if not t.is_meta:
                    return fake_mode.from_tensor(t)
                if id(t) not in faked:
                    faked[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                return faked[id(t)]

            with tracker.paused():  # counted by the session, parameters first, as on a real device
                return _move_module(model, fake)

        stand_in = self._stand_in("cpu")

        def build_batch(make: Callable[[], Any]) -> Any:
            with tracker.paused(), _on_host(stand_in):
                tracker.fake_scalars = False
                try:
                    return _build_batch(None, make, values)
                finally:
                    tracker.fake_scalars = True

        session = Session(tracker, move=move, move_model=move_model, build_model=build_model, build_batch=build_batch,
                          cuda_like=self.cuda_like)
        choices = self._kernel_choices(tracker, fake=True)
        with _installed(stand_in), fake_mode, choices, rule_kernels(values, "AutogradCPU"), fakes_not_traced():
            result, m = timed_measure(tracker, session, work)
        return result, _said_eager(self._finish(m, tracker, choices, stand_in), session)

    def cleanup(self) -> None:
        gc.collect()

    def estimator(self) -> EstimateDevice:
        return self

    def describe(self) -> DeviceInfo:
        if self.model is not None:
            what = f"{self.model} ({format_bytes(self.device_total)} as NVML reports it"
            what += f", planned with a memory budget of {format_bytes(self.capacity)})" if self.budget_given else ")"
            lines = [f"estimate for {what}"]
        else:
            lines = [f"estimate for a {'CUDA GPU' if self.cuda_like else 'device'} with {format_bytes(self.capacity)}"]
        if self.cuda_like:
            lines[0] += f", compute capability {self.target.capability[0]}.{self.target.capability[1]}"
        if self.allowance:
            lines.append(f"{format_bytes(self.allowance)} allowed for the CUDA context and libraries")
        if self.simulates:
            settings = describe_conf(self.alloc_conf, self.alloc_conf_variable)
            lines.append(f"CUDA's caching allocator simulated ({settings})")
        elif self.round_to > 1:
            lines.append(f"allocations rounded up to {self.round_to} bytes")
        source = "memory budget" if self.budget_given else "NVML total of the GPU"
        source += " less the CUDA context allowance" if self.allowance else ""
        if self.fraction_cap() is not None:
            assert self.allocator is not None
            source = (f"per_process_memory_fraction {self.allocator.per_process_memory_fraction:g} x the GPU's "
                      f"{format_bytes(self.device_total)}; below the {format_bytes(self.capacity - self.allowance)} "
                      f"from the {source}")
            lines.append(f"the allocator may reserve {format_bytes(self.capacity_bytes())} ({source})")
        measured_by = (_SIMULATED_BY if self.simulates else _MEASURED_BY)[self.engine]
        return DeviceInfo(
            name=self.name, kind="estimate", estimated=True, capacity_bytes=self.capacity_bytes(),
            capacity_source=source,
            budget_bytes=self.capacity if self.budget_given else None, measured_by=measured_by,
            summary="; ".join(lines), torch=torch.__version__, allowance_bytes=self.allowance, round_to=self.round_to,
            cuda_like=self.cuda_like, engine=self.engine, engine_fallback=self.fallback, model=self.model,
            total_bytes=self.device_total if self.cuda_like else None,
            allocator_conf=self.alloc_conf if self.cuda_like else None,
            allocator_conf_variable=self.alloc_conf_variable if self.cuda_like else None,
            compute_capability=f"{self.target.capability[0]}.{self.target.capability[1]}" if self.cuda_like else None,
            note=self.not_simulated,
        )


def _allocator_config(conf: str, variable: str | None) -> tuple[AllocatorConfig | None, str | None]:
    """The conf the simulation runs with, or None and why it cannot simulate this one (a conf torch
    itself would refuse is refused here, naming the variable it came from, else ``alloc_conf``)."""
    try:
        config = AllocatorConfig.parse(conf)
    except BadInput as exc:
        if "cudaMallocAsync" in conf:
            return None, (f"{variable or 'alloc_conf'}={conf}: CUDA's own pool allocator (cudaMallocAsync) is not "
                          "simulated; the estimate counts live tensor bytes rounded to 512 bytes")
        raise BadInput(f"{variable or 'alloc_conf'}={conf!r} cannot be used: {exc}") from None
    if config.per_process_memory_fraction <= 0.0:
        raise BadInput(f"{variable or 'alloc_conf'}={conf!r}: per_process_memory_fraction 0 lets the allocator "
                       "reserve nothing, so no micro-batch fits: set it above 0 "
                       "(e.g. per_process_memory_fraction:0.5), or leave it out")
    return config, None


def _said_eager(m: Measurement, session: Session) -> Measurement:
    """An estimate of compiled code measured its eager program: say so, with the figure compiling may change."""
    if not session.compiled:
        return m
    return replace(m, notes=m.notes + (eager_note(session.compiled, m.breakdown.get("activations", 0),
                                                  m.peak_bytes),))


def default_engine() -> str:
    """``$AUTOTUNE_ESTIMATE_ENGINE`` (``meta`` or ``fake``), else ``meta``."""
    engine = os.environ.get(ENGINE_VARIABLE, "").strip() or "meta"
    if engine not in ENGINES:
        raise BadInput(f"{ENGINE_VARIABLE}={engine!r} is not an estimate engine; use one of {', '.join(ENGINES)}")
    return engine


def _build_fake(fake_mode: FakeTensorMode | None, make: Callable[[], Any]) -> Any:
    """Build a batch as fake tensors (no memory) in ``fake_mode`` (None: the active one);
    a batch whose shapes depend on its values is built for real instead."""
    try:
        if fake_mode is None:
            return make()
        with fake_mode:
            return make()
    except (RuntimeError, Unbounded, AssertionError):  # what FakeTensorMode refuses (a value read, a
        # data-dependent shape, .numpy()), all RuntimeErrors, a shape sized by values the estimate does not know
        # (a graph batch's repeat_interleave), or a nested tensor's ragged size (a nested int needs a shape
        # environment: AssertionError); the real build reproduces the batch code's own error, if that is what it was
        with unset_fake_temporarily():
            return make()


def _build_batch(fake_mode: FakeTensorMode | None, make: Callable[[], Any], values: KnownValues) -> Any:
    """The batch built for real on the host, its values known, when it holds at most ``BATCH_LIMIT`` bytes
    (measured on a shape-only build first, which leaves the generator as it was); else shape-only."""
    shaped = _build_fake(fake_mode, make)
    leaves = [t for t in tree_flatten(shaped)[0] if isinstance(t, torch.Tensor)]
    if not any(isinstance(t, FakeTensor) for t in leaves):
        return shaped  # built for real already: its shapes depend on its values
    size = batch_bytes(leaves)
    if size > BATCH_LIMIT:
        values.shape_only_batch = size
        return shaped
    with unset_fake_temporarily():
        return make()


def _installed(stand_in: StandIn | None) -> Any:
    return stand_in.installed() if stand_in is not None else contextlib.nullcontext()


def _meta_installed(stand_in: StandIn | None) -> Any:
    """On meta tensors: the CUDA GPU stood in for; estimating the CPU, the CPU's fused optimizer kernels take
    them (the optimizers' device lists hold ``meta`` beside ``cpu``)."""
    if stand_in is not None:
        return stand_in.installed()
    return optimizer_lists(DeviceLists(torch.device("meta"), beside="cpu"))


def _on_host(stand_in: StandIn | None) -> Any:
    """Batches are built on the host, ``"cuda"`` tensors of the batch code's too (the session moves them)."""
    return stand_in.devices.on_host() if stand_in is not None else contextlib.nullcontext()


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else _meta_copy(t)


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as ``t.clone()`` would be: what a move to a device allocates."""
    if _dense(t.shape, t.stride()):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Do these strides cover exactly ``numel`` elements, none twice (in any dimension order)?"""
    expected = 1
    for size, step in sorted(zip(shape, stride), key=lambda p: p[1]):
        if size == 0:
            return True
        if size != 1:
            if step != expected:
                return False
            expected *= size
    return True
