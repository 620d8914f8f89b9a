"""The settings search, run: each setting of :mod:`autotune.planning.settings_search` probed by estimate (no real
run), planned, timed by the time model, ranked; on a real device the winner and the runner-up then timed by
real optimizer steps (as ``--tune`` times them: :mod:`autotune.training.settings_confirm`).

A setting is applied to what the probe takes: checkpointing wraps the chosen repeated blocks in
``torch.utils.checkpoint`` (:func:`autotune.probing.lowering.checkpointed`), FSDP is the fit rule's
sharding (with CPU offload: :mod:`autotune.probing.fsdpoffload`), the allocator setting is the simulated
allocator's, ``bf16-mixed`` runs the loss under autocast, ``bf16`` and ``lora`` are a model by name's own
settings (``--dtype bf16``, ``--lora``). The same :func:`apply` gives the runner the workload it trains with
``autotune run --settings``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import log, options
from ..devices.base import Device, Session
from ..devices.estimate import EstimateDevice
from ..devices.presets import GpuPreset, find_preset
from ..devices.roofline import preset_of, seconds
from ..errors import AutotuneError, BadInput, DoesNotFit, first_line
from ..planning.probed import plan_probed
from ..planning.settings_search import (
    ADAM_PASSES,
    ALLOCATOR,
    HOST_LINKS,
    LAUNCH,
    LINKS,
    Rank,
    StepTime,
    Work,
    candidates,
    ranked,
    step_time,
)
from ..results.model import ModelSpec, is_model_spec
from ..results.plan import Plan
from ..results.probe import ProbeResult
from ..results.request import FitRule, PlanRequest, ProbeRequest
from ..results.search import SettingRow, TrainSetting
from ..workload import Workload, load_workload
from .blockcounts import counted_micro_step
from .lowering import checkpoint_blocks, checkpointed

Probe = Callable[[ProbeRequest, Workload, Device], ProbeResult]
#: The GPU a plain ``estimate`` device (a budget, no name) is timed as.
STAND_IN = "A100-80GB"


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What the search needs of the model: its repeated blocks (pattern, how many), parameter bytes (all, and
    those with gradients), and how many parameters have gradients."""

    blocks: str | None
    count: int
    param_bytes: int
    trainable_bytes: int
    trainable_count: int = 0


def shape_of(workload: Workload, device: Device) -> Shape:
    """The repeated blocks FSDP would shard as units (``blocks.*``) and the parameter bytes of ``workload``'s
    model, built on the estimate (no memory)."""
    found: list[Shape] = []

    def work(session: Session) -> None:
        model = session.model(workload.make_model)
        names = {id(m): n for n, m in model.named_modules()}
        units = [names[id(u)] for u in workload.shard_units(model) if id(u) in names]
        parents = {u.rpartition(".")[0] for u in units}
        blocks = f"{parents.pop()}.*" if len(parents) == 1 and len(units) > 1 and all(
            u.rpartition(".")[2].isdigit() for u in units) else None
        params = list(model.parameters())
        found.append(Shape(blocks=blocks, count=len(units) if blocks else 0,
                           param_bytes=sum(p.numel() * p.element_size() for p in params),
                           trainable_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
                           trainable_count=sum(p.numel() for p in params if p.requires_grad)))

    device.estimator().measure(work)
    return found[0]


def apply(workload: Workload, setting: TrainSetting, *, spec: str | None, cuda: bool, real: bool = False) -> Workload:
    """``workload`` as ``setting`` runs it: its number-changing ``changes`` (a model by name ``spec`` rebuilt with
    bf16 weights or LoRA; the loss under autocast for bf16-mixed, on CUDA when ``cuda``) and checkpointing (for a
    ``real`` run, recomputing with the random state of the forward: the same dropout)."""
    wl = workload
    if {"bf16", "lora"} & set(setting.changes):
        if spec is None or not is_model_spec(spec):
            raise BadInput(f"{' and '.join(c for c in setting.changes if c != 'bf16-mixed')} apply to a model by name "
                           "({model})", field="allow", fix="drop them from {allow}, or give {model}")
        model = ModelSpec.parse(spec)
        model = replace(model, dtype="bf16" if "bf16" in setting.changes else model.dtype,
                        lora=(model.lora or "r=16") if "lora" in setting.changes else model.lora)
        wl = load_workload(model.spec())
    if "bf16-mixed" in setting.changes:
        wl = replace(wl, loss=_autocast(wl.loss, "cuda" if cuda else "cpu"))
    if setting.checkpoint_every and setting.blocks:
        wl = checkpointed(wl, setting.blocks, every=setting.checkpoint_every, preserve_rng_state=real)
    return wl


def _autocast(loss: Callable[[torch.nn.Module, Any], torch.Tensor], where: str) -> Callable[..., torch.Tensor]:
    @functools.wraps(loss)
    def run(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast(where, dtype=torch.bfloat16):
            return loss(model, batch)

    return run


def with_allocator(device: EstimateDevice, setting: str) -> EstimateDevice:
    """``device`` whose simulated allocator also runs with ``setting`` (``expandable_segments:True``)."""
    conf = ",".join(c for c in (device.alloc_conf, setting) if c)
    return EstimateDevice(**{**device._settings(), "alloc_conf": conf,
                             "alloc_conf_variable": "PYTORCH_CUDA_ALLOC_CONF"})


def usable_changes(allow: tuple[str, ...], spec: str | None) -> tuple[tuple[str, ...], str | None]:
    """The allowed changes that apply here (bf16 weights and LoRA: a model by name only), and a note on the rest."""
    model = spec is not None and is_model_spec(spec)
    dropped = tuple(a for a in allow if a in ("bf16", "lora") and not model)
    note = f"allowed {', '.join(dropped)} not tried: they apply to a model by name" if dropped else None
    return tuple(a for a in allow if a not in dropped), note


@functools.cache
def cpu_preset() -> GpuPreset:
    """This CPU as the roofline sees a device: fp32 FLOP/s of a 512 x 512 matmul and the bytes/s of a 64 MiB
    copy, each timed by ``torch.utils.benchmark``."""
    from torch.utils.benchmark import Timer

    a, src = torch.randn(512, 512), torch.empty(16 << 20)
    dst = torch.empty_like(src)
    mm = Timer("a @ a", globals={"a": a}).blocked_autorange(min_run_time=0.2).median
    copy = Timer("dst.copy_(src)", globals={"dst": dst, "src": src}).blocked_autorange(min_run_time=0.2).median
    flops, bandwidth = 2 * 512 ** 3 / mm, 2 * src.numel() * 4 / copy
    return GpuPreset(name="cpu", model="cpu", total_bytes=0, capability=(0, 0), fp32_flops=flops,
                     tensor_flops=flops, bandwidth=bandwidth, bf16=False)


class _Probe(torch.nn.Module):
    """A small stack of residual MLP blocks, the work :func:`cpu_overheads` times: its ops do next to nothing."""

    BLOCKS = 4

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(self.BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


@functools.cache
def cpu_overheads() -> tuple[float, float]:
    """Seconds this CPU spends on each op of a training step beyond its work, and on each checkpointed block beyond
    its ops: a forward and backward of :class:`_Probe` on one sample, plain and with every block checkpointed (as
    the runner checkpoints: non-reentrant, the random state kept), each the best of three timings by
    ``torch.utils.benchmark``, over the ops the roofline counts (views included)."""
    from torch.utils.benchmark import Timer

    from ..devices.roofline import Counting

    x = torch.randn(1, 8)
    measured = []
    for every in (0, 1):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = checkpoint_blocks(_Probe(), "blocks.*") if every else _Probe()

        def step(model: torch.nn.Module = model) -> None:
            model(x).pow(2).mean().backward()

        counting = Counting()
        with counting:
            step()
        timer = Timer("step()", globals={"step": step})
        measured.append((counting.ops, min(timer.blocked_autorange(min_run_time=0.1).median for _ in range(3))))
    (ops, plain), (ops_ckpt, ckpt) = measured
    per_op = plain / ops
    return per_op, max(0.0, (ckpt - plain - (ops_ckpt - ops) * per_op) / _Probe.BLOCKS)


def speed_of(device: Device) -> tuple[GpuPreset, Rank, str]:
    """The roofline's figures for ``device`` and the link to its peers, and where they come from."""
    preset = preset_of(device)
    if preset is not None:
        return preset, _gpu(preset), f"{preset.name} preset"
    if device.torch_device.type == "cpu" and not device.estimated:  # the CPU is its own host: offload copies memory
        cpu, (per_op, per_region) = cpu_preset(), cpu_overheads()
        return cpu, Rank(bandwidth=cpu.bandwidth, link=cpu.bandwidth, host_link=cpu.bandwidth,
                         host_adam=cpu.bandwidth / (ADAM_PASSES * 4), per_op=per_op, per_region=per_region), \
            "this CPU, measured"
    stand = find_preset(STAND_IN)
    return stand, _gpu(stand), f"timed as an {STAND_IN} (no preset named)"


def _gpu(preset: GpuPreset) -> Rank:
    """A GPU preset's rank: its links to its peers and to the host (:data:`LINKS`, :data:`HOST_LINKS`)."""
    return Rank(bandwidth=preset.bandwidth, link=LINKS.get(preset.name, 32e9),
                host_link=HOST_LINKS.get(preset.name, 25e9), per_op=LAUNCH)


@dataclass
class Search:
    """One search: the request, its workload and device, how to probe, and what it found so far."""

    request: PlanRequest
    workload: Workload
    device: Device
    probe: Probe
    found: list[tuple[SettingRow, Plan | None, StepTime | None]]

    def __post_init__(self) -> None:
        self.estimate = self.device if self.device.estimated else self.device.estimator()
        self.preset, self.rank, self.speed = speed_of(self.device)
        self.shapes: dict[tuple[str, ...], Shape] = {}

    def shape(self, setting: TrainSetting, wl: Workload) -> Shape:
        if setting.changes not in self.shapes:
            self.shapes[setting.changes] = shape_of(wl, self.estimate)
        return self.shapes[setting.changes]

    def evaluate(self, setting: TrainSetting) -> None:
        """Probe ``setting`` by estimate, plan it, time it by the model; one more row of :attr:`found`."""
        req, world = self.request, self.request.world_size
        cuda = isinstance(self.estimate, EstimateDevice) and self.estimate.cuda_like
        changed = apply(self.workload, replace(setting, blocks=None, checkpoint_every=0), spec=req.probe.workload,
                        cuda=cuda)
        shape = self.shape(setting, changed)  # the blocks as this setting's model names them (peft renames them)
        if setting.checkpoint_every and shape.blocks:
            setting = replace(setting, blocks=shape.blocks)
        wl = apply(changed, replace(setting, changes=()), spec=None, cuda=cuda)
        dev: Device = self.estimate
        if setting.allocator and isinstance(dev, EstimateDevice):
            dev = with_allocator(dev, setting.allocator)
        rule = FitRule.of(setting.parallel, world, fsdp_sync=setting.fsdp_sync or options.DEFAULT_FSDP_SYNC,
                          offload=setting.offload)
        log.progress(f"settings search: {setting.label}")
        try:
            result = self.probe(replace(req.probe, rule=rule), wl, dev)
        except AutotuneError as exc:  # this setting does not fit, or the estimate cannot run the model so
            why = "does not fit" if isinstance(exc, DoesNotFit) else "cannot be estimated"
            self.found.append((SettingRow(setting=setting, fits=False, max_micro_batch=0,
                                          why=f"{why}: {getattr(exc, 'facts', None) or first_line(exc)[:200]}"),
                               None, None))
            return
        plan = plan_probed(req.target_batch, result, world_size=world, world_size_source=req.world_size_source,
                           multiple_of=req.multiple_of, uniform=req.uniform)
        counts = counted_micro_step(wl, dev, plan.micro_batch)
        regions = len(range(0, shape.count, setting.checkpoint_every)) if setting.checkpoint_every else 0
        t = step_time(setting, Work(micro_seconds=seconds(counts, self.preset), micro_batch=plan.micro_batch,
                                    steps=plan.accumulation_steps, param_bytes=shape.param_bytes,
                                    trainable_bytes=shape.trainable_bytes, trainable_count=shape.trainable_count,
                                    ops=counts.ops, regions=regions),
                      self.rank, world)
        self.found.append((SettingRow(setting=setting, fits=True, max_micro_batch=result.max_micro_batch,
                                      micro_batch=plan.micro_batch, accumulation_steps=plan.accumulation_steps,
                                      peak_bytes=plan.predicted_peak_bytes, step_seconds=t.total,
                                      samples_per_second=req.target_batch / t.total), plan, t))

    def best(self) -> tuple[SettingRow, Plan | None, StepTime | None] | None:
        fitting = [f for f in self.found if f[0].fits]
        return max(fitting, key=lambda f: f[0].samples_per_second) if fitting else None


#: Runs the winner and runner-up for real: (the order, the plans, the workload, the device, its spec) to the order
#: as measured and a note saying so (:func:`autotune.training.settings_confirm.confirmed`).
Confirm = Callable[[list[SettingRow], dict[TrainSetting, "Plan | None"], Workload, Device, "str | None"],
                   tuple[list[SettingRow], str]]


def search_settings(request: PlanRequest, workload: Workload, device: Device, probe: Probe, *,
                    allow: tuple[str, ...] = (), confirm: Confirm | None = None) -> Plan:
    """The plan of the fastest setting by the time model, carrying every setting's row (best first) and the
    chosen one; on a real device (one rank) the winner and runner-up confirmed by a real run of the fit rule and
    timed, and the faster one measured kept (see the module)."""
    start = time.process_time()
    search = Search(request=request, workload=workload, device=device, probe=probe, found=[])
    changes, dropped = usable_changes(allow, request.probe.workload)
    base = shape_of(workload, search.estimate)
    gpu = getattr(search.estimate, "cuda_like", False) or device.torch_device.type == "cuda"
    for setting in candidates(request.world_size, base.blocks, base.count, changes, offload=gpu):
        search.evaluate(setting)
    best = search.best()
    if best is not None and getattr(search.estimate, "simulates", False):  # the allocator moves only the max
        for conf in ALLOCATOR:
            search.evaluate(replace(best[0].setting, allocator=conf))
    found = search.found
    order = ranked([f[0] for f in found], {i: f[2] for i, f in enumerate(found) if f[2] is not None})
    plans = {f[0].setting: f[1] for f in found}
    if not order[0].fits:
        each = "; ".join(f"{r.setting.label}: {r.why[:160]}" for r in order)
        raise DoesNotFit(f"no setting fits a micro-batch of 1 ({len(order)} tried: {each}): use more ranks or a "
                         "larger memory budget, or allow bf16 or lora ({allow='bf16,lora'})")
    notes = [f"settings search: {len(order)} settings by estimate, timed by the stated model "
             f"(autotune.planning.settings_search; {search.speed}), {time.process_time() - start:.1f} CPU-s"]
    if dropped:
        notes.append(dropped)
    if not gpu:
        notes.append("CPU offload not tried: on the CPU the host is the device, offload has nothing to move")
    if confirm is not None and not device.estimated and request.world_size == 1:
        order, said = confirm(order, plans, workload, device, request.probe.workload)
        notes.append(said)
    chosen = order[0]
    plan = plans[chosen.setting]
    assert plan is not None
    return replace(plan, setting=chosen.setting, settings=tuple(order),
                   notes=plan.notes + (f"setting chosen: {chosen.setting.label}", *notes))
