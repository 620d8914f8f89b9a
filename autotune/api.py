"""The public API: probe a workload on a device, plan, (tune), run, for the command line and for programs.

Each verb takes what the command line takes (a probe spec such as "mlp" or "model.py:build", a device
name, a size string such as "8GiB") as well as objects (a Workload, a Device), makes one request of them
(:mod:`autotune.results.request`, every argument checked there, once, naming the parameter) and hands
it on; the command line and the service build the same requests and call the request's own verb
(:func:`probe_for`, :func:`plan_for`). The stages read as::

    result = probe_for(request.probe, store=store)     # the store is a cache around the probe
    plan = planner(result)                             # pure arithmetic
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from . import log, options
from .devices import Device, get_device
from .errors import BadInput, DoesNotFit, mention
from .planning.requests import one_device, plan_request, probe_request, this_rank
from .results.device import DeviceInfo
from .results.model import ModelSpec, named_as, run_precision, workload_or_model
from .results.probe import ProbeResult, Trial
from .results.request import PlanRequest, ProbeRequest, Snapshot
from .results.settings import keywords
from .store import cached
from .training import distributed
from .units import plural
from .workload import Workload, load_workload

if TYPE_CHECKING:
    from .planning.planner import Uniform
    from .results.plan import Plan
    from .results.ramp import RampConfig
    from .results.run import RunResult
    from .store import Store

Spec = Workload | str | None
StoreSpec: TypeAlias = "Store | str | Literal[False] | None"


@dataclass(frozen=True)
class GivenObjects:
    """Objects given to the API beside a request (which names them): a Workload, a Device."""

    workload: Workload | None = None
    device: Device | None = None

    @classmethod
    def of(cls, workload: Any = None, device: Any = None) -> GivenObjects:
        if workload is not None and not isinstance(workload, (Workload, str)):
            raise BadInput(f"workload {workload!r} is neither a Workload nor a probe spec (a built-in name such as "
                           "'mlp', a .py file, or package.module[:function])")
        return cls(workload if isinstance(workload, Workload) else None,
                   device if device is not None and not isinstance(device, (str, list, tuple)) else None)


def group() -> tuple[int, int] | None:
    """(world size, rank) of this process's process group, or None outside one."""
    return (distributed.world_size(), distributed.rank()) if distributed.active() else None


def resolve(request: ProbeRequest, given: GivenObjects = GivenObjects()) -> tuple[Workload, Device]:
    """The Workload and the Device a request names (the objects given when there are); device errors come
    before the workload is built. Under torchrun, ``auto`` is this rank's own GPU (LOCAL_RANK), else the CPU."""
    dev = given.device if given.device is not None else device_for(request)
    wl = given.workload if given.workload is not None else load_for(request.workload, dev)
    return wl, dev


def device_for(request: ProbeRequest) -> Device:
    """The Device a request names; under torchrun, ``auto`` is this rank's own GPU (LOCAL_RANK), else the CPU."""
    name = distributed.local_device_name() if request.device == "auto" and distributed.active() else request.device
    return get_device(name, memory_budget=request.memory_budget)


def importing_device(request: PlanRequest) -> Device:
    """The device a plan request's probe file is imported as on (see :func:`load_for`): its first rank's when
    it lists ranks."""
    return device_for(request.ranks[0] if request.ranks else request.probe)


def load_for(spec: str | None, device: Device) -> Workload:
    """The workload ``spec`` builds, its probe file imported as on ``device``: standing in for a GPU this machine
    does not have, ``torch.cuda`` answers for that GPU while it imports (see ``EstimateDevice.importing``)."""
    with getattr(device, "importing", contextlib.nullcontext)():
        return load_workload(spec)


def open_store(store: StoreSpec) -> Store | None:
    """The plan store to use: ``store`` itself, the one at its URL, ``$AUTOTUNE_STORE``'s when None, none when False."""
    if store is None:
        store = options.store_from_environment() or False
    if store is False:
        return None
    if isinstance(store, str):
        from .store import open_store as open_url

        return open_url(store)
    if not all(hasattr(store, a) for a in ("get", "claim", "put")):
        raise BadInput(f"store {store!r} is neither a database URL (e.g. sqlite:///plans.db) nor a Store")
    return store


# ---- probe -------------------------------------------------------------------------------------------------


def probe(probe: Spec | ProbeRequest = None, *, device: Device | str = options.DEVICE,
          memory_budget: int | str | None = None,
          margin: float = options.MARGIN, max_batch: int = options.MAX_BATCH,
          data_parallel: bool | None = None, parallel: str = options.DEFAULT_PARALLEL,
          fsdp_sync: str = options.DEFAULT_FSDP_SYNC, world_size: int | None = None, precision: str = "fp32",
          store: StoreSpec = None,
          memory_snapshot: str | os.PathLike[str] | bool | None = None, at: int | None = None,
          model: str | ModelSpec | None = None, workload: Spec | ProbeRequest = None, **settings: Any) -> ProbeResult:
    """The largest micro-batch of ``probe`` that fits ``device``: the API behind ``autotune probe``.

    ``probe``: a probe spec (a built-in name such as "mlp", a .py file, ``package.module[:function]``) or a
    Workload; ``workload`` is its former name, accepted with a DeprecationWarning until the next release.

    ``parallel``: "ddp" (every rank holds the whole model) or "fsdp" (the model
    sharded with ``fully_shard`` over ``world_size`` ranks: the process group's
    under torchrun, else ``world_size``, $WORLD_SIZE or 1; the fit rule is then
    one rank's, measured on a fake process group of that size). ``data_parallel``:
    under DDP, the fit rule holds DDP's gradient buckets; by default, whether
    there are several ranks. Under torchrun the ranks agree on the smallest maximum.
    ``fsdp_sync``: under FSDP, "every" reduce-scatters the gradients after every micro-step (accumulated in
    their shards), "last" at the last micro-step only (unsharded gradients held between micro-steps), "auto"
    probes both and takes the one with the larger max micro-batch ("last" on a tie); the result's
    ``fsdp_sync`` says which.
    ``store``: a plan store's URL (``sqlite:///plans.db``, any SQLAlchemy URL) or
    a Store: a probe it has seen is answered from it (on a real device, after one
    confirm run), a new one is kept there; by default ``$AUTOTUNE_STORE`` when
    set, and ``False`` for none.
    ``memory_snapshot``: a file to write the fit rule's allocation trace at the max micro-batch (or ``at``) to,
    in the format of ``torch.cuda.memory._snapshot()`` (True: no file); the result's ``memory`` then says
    where the peak comes from, what would lower it most, and which allocator settings fit more (see
    :func:`memory_snapshot`). On a real GPU the real snapshot of that size is written beside it.

    ``precision``: the request's (:class:`autotune.ProbeRequest` takes the same keywords); a probe measures the
    fit rule in fp32, as the workload builds its model, so only "fp32" is probed.
    ``model``: instead of ``probe``, a Hugging Face model by name (a hub id, a folder holding
    config.json, that file) or a :class:`autotune.results.model.ModelSpec` saying how it trains; weights are never
    downloaded, and the result's ``model`` says its parameter counts.

    ``settings``: any other setting of a probe (:mod:`autotune.results.settings`), checked as declared.

    ``probe`` may instead be a :class:`autotune.ProbeRequest`, which says the rest: then only ``store``,
    ``memory_snapshot`` and ``at`` may be given beside it.
    """
    settings = declared(probe_verb, settings)
    workload = workload_or_model(renamed(probe, workload, "probe"), model)
    asked = _request(probe_verb, workload, locals(), ProbeRequest,
                     "pass its probe (autotune.probe(request.probe)), or plan it with autotune.plan(request)")
    if asked is not None:
        return probe_for(asked, store=store, snapshot=Snapshot.of(memory_snapshot, at))
    if memory_snapshot is not None and memory_snapshot is not False:
        one_device(device, memory_budget, group())
    request = probe_request(workload, device=device, memory_budget=memory_budget, margin=margin,
                            max_batch=max_batch, data_parallel=data_parallel, parallel=parallel,
                            fsdp_sync=fsdp_sync, world_size=world_size, precision=precision, group=group(),
                            **settings)
    return probe_for(request, store=store, given=GivenObjects.of(workload, device),
                     snapshot=Snapshot.of(memory_snapshot, at))


probe_verb = probe  # the verb, where a keyword named probe hides it


def probe_for(request: ProbeRequest, *, store: StoreSpec = None, given: GivenObjects = GivenObjects(),
              snapshot: Snapshot | None = None) -> ProbeResult:
    """The probe a request asks for, through the plan store when there is one (a cache around the probe);
    under torchrun the ranks agree on the smallest maximum. ``snapshot``: also the memory timeline at its
    size (default: the max micro-batch)."""
    if request.precision != "fp32":
        raise BadInput(f"precision {request.precision}: a probe measures the fit rule in fp32, as the workload builds "
                       f"its model; probe in fp32 (a model built in {request.precision} is measured as built), "
                       f"then train with run(precision={request.precision!r})")
    wl, dev = resolve(request, given)
    if snapshot is not None and not dev.estimated and dev.torch_device.type == "cuda":
        from .devices.history import RecordingDevice

        dev = RecordingDevice(dev)  # the confirm run records the GPU allocator's history
    ranks = _devices_if_they_differ([dev.describe()]) if distributed.active() else None
    result = _probe_one(request, wl, dev, open_store(store), ranks)
    if distributed.active():
        result = agree_across_ranks(result)
    return explained(result, request, wl, dev, snapshot)


def _probe_one(request: ProbeRequest, wl: Workload, dev: Device, plan_store: Store | None,
               ranks: tuple[DeviceInfo, ...] | None) -> ProbeResult:
    """One device's probe as the request asks, through the store when there is one; ``ranks``: every rank's
    device when they differ (the store's fingerprint covers them)."""
    from .probing import finder
    from .probing.fsdpsync import probe_chosen

    def probed(asked: ProbeRequest) -> ProbeResult:
        rule = asked.rule
        sync = {"every": ", gradients synchronised every micro-step",
                "last": ", gradients synchronised at the last micro-step"}.get(rule.fsdp_sync, "")
        log.progress(f"probing {wl.name} on {dev.describe().summary}" +
                     (f" (FSDP over {plural(rule.world_size, 'rank')}{sync})" if rule.sharded else ""))
        return cached.probe_through_store(plan_store, asked, wl, dev, ranks=ranks)

    def one_size(asked: ProbeRequest, batch: int) -> Trial:
        return finder.fit_rule_at(wl, dev, batch, asked)

    chosen = request.rule.sharded and request.rule.fsdp_sync == "auto"  # FSDP's gradient sync, to choose
    result = probe_chosen(probed, request, estimated=dev.estimated, one_size=one_size) if chosen else \
        probed(request)
    facts = getattr(wl, "facts", None)  # a model by name says what it is, by the name the request gives it
    return replace(result, source=request.workload, model=named_as(facts(), request.workload) if callable(facts)
                   else None)


def explained(result: ProbeResult, request: ProbeRequest, wl: Workload, dev: Device,
              snapshot: Snapshot | None, *, at: int | None = None) -> ProbeResult:
    """``result`` with its memory timeline when a snapshot was asked for (at ``snapshot.at``, else ``at``,
    else the max micro-batch)."""
    if snapshot is None:
        return result
    from .probing.memory import explain

    batch = snapshot.at if snapshot.at is not None else at
    rule = request.rule if result.fsdp_sync is None else \
        replace(request.rule, fsdp_sync=options.fsdp_sync(result.fsdp_sync))
    return replace(result, memory=explain(result, wl, dev, batch=batch, path=snapshot.path, rule=rule))


def memory_snapshot(path: str | os.PathLike[str] | None, probe: Spec = None, *,
                    device: Device | str = options.DEVICE, memory_budget: int | str | None = None,
                    margin: float = options.MARGIN, at: int | None = None, max_batch: int = options.MAX_BATCH,
                    parallel: str = options.DEFAULT_PARALLEL, fsdp_sync: str = options.DEFAULT_FSDP_SYNC,
                    world_size: int | None = None, workload: Spec = None) -> ProbeResult:
    """Probe ``probe`` (``workload``: its former name, deprecated), then write the fit rule at the max
    micro-batch (or ``at``) to ``path`` as ``torch.cuda.memory._snapshot()`` does: what
    ``python -m torch.cuda._memory_viz trace_plot|segment_plot`` and pytorch.org/memory_viz open, before having
    the GPU, at sizes that would not fit. The result's
    ``memory`` holds the peak's parts, what would lower it most and the allocator settings compared.

    Standing in for a GPU the trace is the caching-allocator simulation's (its highest reserved point is the
    result's reserved peak, to the byte); on the CPU it is the tracker's (allocated memory only).
    """
    if isinstance(path, bool):  # True would mean "no file" to probe's memory_snapshot
        raise BadInput(f"path {path!r} is not a file path: give one such as 'memory.pickle', or None for the "
                       "explanation without a file")
    workload = renamed(probe, workload, "memory_snapshot")
    return probe_verb(workload, device=device, memory_budget=memory_budget, margin=margin, max_batch=max_batch,
                 parallel=parallel, fsdp_sync=fsdp_sync, world_size=world_size,
                 memory_snapshot=path if path is not None else True, at=at)


def _devices_if_they_differ(mine: list[DeviceInfo]) -> tuple[DeviceInfo, ...] | None:
    """Every rank's device (gathered under torchrun; ``mine`` lists them all otherwise), or None when they are
    alike (their kind, GPU model and capacity)."""
    from .training.ranks import gather_objects, rank_key

    infos = [i for got in gather_objects(mine) for i in got] if distributed.active() else mine
    return tuple(infos) if len({rank_key(i) for i in infos}) > 1 else None


def agree_across_ranks(result: ProbeResult) -> ProbeResult:
    """Every rank's max micro-batch; the smallest holds for all (a busier GPU sets the limit)."""
    ranks = distributed.gather_ints(result.max_micro_batch)
    low = min(ranks)
    result = replace(result, ranks=tuple(ranks))
    if low == result.max_micro_batch:
        return result
    peak = result.predicted_peak_at(low) or result.peak_bytes
    return replace(result, max_micro_batch=low, peak_bytes=peak, predicted_peak_bytes=peak, limited_by="memory",
                   notes=result.notes + (f"rank {ranks.index(low)} fits only {low}: every rank uses {low} "
                                         f"(this rank alone fits {max(ranks[distributed.rank()], low)}); "
                                         f"the peak at {low} is estimated",))


# ---- plan --------------------------------------------------------------------------------------------------


def plan(target_batch: int | PlanRequest | None = None, *, probe: Spec = None, device: Device | str = options.DEVICE,
         memory_budget: int | str | None = None, margin: float = options.MARGIN, world_size: int | None = None,
         multiple_of: int = 1, uniform: Uniform = None, tune: bool = False, trials: int = options.TRIALS,
         storage: str | None = None, study_name: str | None = None, env: dict[str, str] | None = None,
         parallel: str = options.DEFAULT_PARALLEL, fsdp_sync: str = options.DEFAULT_FSDP_SYNC,
         store: StoreSpec = None, uniform_ranks: bool = False,
         memory_snapshot: str | os.PathLike[str] | bool | None = None, at: int | None = None,
         model: str | ModelSpec | None = None, target_tokens: int | None = None,
         lengths: Sequence[int] | str | None = None, cut_samples: bool = False, precision: str = "fp32",
         search_settings: bool = False, allow: Sequence[str] | str | None = None, workload: Spec = None,
         **settings: Any) -> Plan:
    """Probe, then plan ``target_batch`` exactly: the API behind ``autotune plan``. Every keyword is a plan
    setting of :mod:`autotune.results.settings`, whose help ``autotune plan --help`` shows (``settings``: any
    other one, checked as declared); in short:

    ``probe``, ``model``, ``precision``, ``store``, ``memory_snapshot``/``at``: as for :func:`probe` (the
    snapshot at the plan's micro-batch unless ``at`` is given; ``workload``: ``probe``'s former name, deprecated).
    ``parallel``: "ddp", or "fsdp" to shard the model over the ranks (the probe then measures one rank of that
    many), its gradient sync as ``fsdp_sync`` says. ``uniform``: None the fewest steps, True equal micro-batches
    within twice the fewest steps (else NoUniformPlan, naming the nearest targets), "force" equal micro-batches
    however many steps. ``tune``: an optuna study (``trials``, ``storage``, ``study_name``) times real steps of
    candidate plans against the untuned one, and the fastest wins unless within noise.
    ``target_tokens`` instead of ``target_batch``: every step holds that many tokens (exactly with
    ``cut_samples``, else the closest whole samples, stated), samples of ``lengths`` tokens (a list or a file;
    default: what the loss counts in one sample); the plan's ``tokens`` holds every step's tokens.
    Ranks that differ: ``device`` and ``memory_budget`` once per rank (``"estimate:A100-80GB,estimate:T4-16GB"``,
    ``"estimate:H100-80GB*4,estimate:A10G-24GB*4"``, ``"8MiB,3MiB"``), each rank its own micro-batch
    (:func:`autotune.planning.mixed.make_mixed_plan`) unless ``uniform_ranks``.
    ``search_settings``: rank the settings that do not change what is computed (DDP or FSDP, FSDP's CPU offload on a
    GPU, checkpointing, the allocator's) and those ``allow`` names (``"bf16-mixed,lora"``) by estimate and a stated
    time model, and plan the fastest; the plan's ``settings`` lists them, best first, ``setting`` the one chosen.
    ``target_batch`` may instead be a :class:`autotune.PlanRequest`, which says the rest (then only ``store``,
    ``memory_snapshot`` and ``at`` beside it).
    """
    settings = declared(plan, settings)
    probe = workload = renamed(probe, workload, "plan")
    if target_tokens is not None or lengths is not None or cut_samples:
        return _in_tokens(target_batch, target_tokens, lengths, cut_samples, {
            k: v for k, v in locals().items()
            if k not in ("target_batch", "target_tokens", "lengths", "cut_samples", "workload", "settings")} | settings)
    workload = workload_or_model(workload, model)
    asked = _request(plan, target_batch, locals(), PlanRequest,
                     "wrap it, autotune.plan(autotune.PlanRequest(target_batch=N, probe=request))")
    if asked is not None:
        snapshot = Snapshot.of(memory_snapshot, at)
        return plan_for(asked if snapshot is None else replace(asked, snapshot=snapshot), store=store)
    request = plan_request(target_batch, probe=workload, device=device, memory_budget=memory_budget,
                           margin=margin, world_size=world_size, multiple_of=multiple_of, uniform=uniform,
                           uniform_ranks=uniform_ranks, parallel=parallel, fsdp_sync=fsdp_sync, tune=tune,
                           trials=trials, precision=precision, search_settings=search_settings, allow=allow,
                           storage=storage, study_name=study_name, memory_snapshot=memory_snapshot, at=at,
                           env=env, group=group(), **settings)
    return plan_for(request, store=store, given=GivenObjects.of(workload, device))


def _in_tokens(target_batch: object, target_tokens: object, lengths: object, cut: object,
               rest: dict[str, Any]) -> Plan:
    """:func:`plan` with ``target_tokens``: its arguments checked, then :func:`plan_in_tokens`."""
    if target_batch is not None:
        raise BadInput(f"{{target_batch}} {target_batch!r} and {{target_tokens}} {target_tokens!r} each say what a "
                       "step holds", field="target_tokens", fix="give one of them")
    if target_tokens is None:
        raise BadInput("{lengths} and {cut_samples} are for {target_tokens}", field="target_tokens",
                       fix="give {target_tokens} too, or drop them")
    if rest["tune"]:
        raise BadInput("{tune} times plans of a target batch, not of {target_tokens}", field="tune",
                       fix="drop {tune}, or give {target_batch}")
    return plan_in_tokens(target_tokens, lengths, workload_or_model(rest["probe"], rest["model"]),
                          lambda n: plan(n, **rest), cut=options.boolean(cut, "cut_samples"))


def plan_in_tokens(target_tokens: object, lengths: object, workload: Spec, plan_batch: Callable[[int], Plan], *,
                   cut: bool = False) -> Plan:
    """Steps of ``target_tokens`` tokens over samples of ``lengths`` (else what ``workload`` counts in one sample):
    ``plan_batch`` plans the step with the most samples, and its max micro-batch bounds each micro-batch's tokens."""
    from .planning.bytokens import lengths_of, most_samples, one_step, probed_tokens, token_steps, tokens_per_sample

    target = options.whole(target_tokens, "target_tokens", example="65536", text=False)
    if isinstance(lengths, (str, os.PathLike)):
        from .workload.hf import read_lengths

        lengths = read_lengths(os.fspath(lengths))
    sizes = lengths_of(lengths)
    wl = workload if isinstance(workload, Workload) else load_workload(workload)
    if sizes is None:
        sizes = one_step(tokens_per_sample(wl), target)
    batch_plan = plan_batch(most_samples(sizes, target, cut=cut))
    if batch_plan.world_size > 1:
        raise BadInput(f"{{target_tokens}} plans the steps of one rank, and the plan is for "
                       f"{batch_plan.world_size} ranks",
                       field="world_size", limit=1, fix="give {world_size=1}, or {target_batch}")
    tokens = token_steps(sizes, target, batch_plan.max_micro_batch, cut=cut, width=getattr(wl, "width", None),
                         probed=probed_tokens(wl, batch_plan.max_micro_batch))
    return replace(batch_plan, tokens=tokens, notes=batch_plan.notes + (tokens.note,))


def plan_for(request: PlanRequest, *, store: StoreSpec = None, given: GivenObjects = GivenObjects()) -> Plan:
    """The plan a request asks for, stage by stage: resolve the workload and the device, probe through the plan
    store (a cache around the probe: the same answer with or without one), plan (pure arithmetic), explain (the
    memory timeline, when the request asks for a snapshot). Ranks whose devices differ are each probed, then
    planned together (:func:`_plan_mixed`); a request to tune times candidate plans instead (:func:`_tuned`)."""
    if request.search is not None:
        return _searched(request, given)
    from .planning.probed import plan_probed

    plan_store = open_store(store)
    if request.tuning is not None:
        return _tuned(request, given, plan_store)
    # 1. resolve: the workload and the device (each rank's, when the ranks differ)
    resolved = resolve_plan_request(request, given)
    if resolved.ranks is not None:
        return _plan_mixed(resolved.request, resolved.workload, resolved.devices, resolved.ranks, plan_store)
    wl, dev = resolved.workload, resolved.device
    # 2. probe, through the plan store when there is one
    result = probe_for(resolved.request.probe, store=plan_store if plan_store is not None else False,
                       given=GivenObjects(wl, dev))
    # 3. plan: pure arithmetic, kept in the store beside its probe
    planned = plan_probed(request.target_batch, result, world_size=request.world_size,
                          world_size_source=request.world_size_source, multiple_of=request.multiple_of,
                          uniform=request.uniform)
    if plan_store is not None and result.fingerprint is not None:
        plan_store.put(result.fingerprint, plan=planned)
    planned = _packing_saving(planned, result, resolved.request, dev, plan_store)
    # 4. explain: the memory timeline at the plan's micro-batch, when a snapshot is asked for
    if request.snapshot is None:
        return planned
    return replace(planned, probe=explained(result, request.probe, wl, dev, request.snapshot, at=planned.micro_batch))


def _packing_saving(planned: Plan, result: ProbeResult, request: PlanRequest, dev: Device,
                    plan_store: Store | None) -> Plan:
    """A plan of samples packed into one row says what packing saves against padding to the longest: the same
    model padded, probed on the same device."""
    from .planning.packing import padded_twin, saving_note

    twin = padded_twin(request.probe.workload)
    if twin is None:
        return planned
    padded = probe_for(replace(request.probe, workload=twin), store=plan_store if plan_store is not None else False,
                       given=GivenObjects(load_workload(twin), dev))
    return replace(planned, notes=planned.notes + (saving_note(result, padded),))


@dataclass(frozen=True)
class ResolvedRequest:
    """What a plan request names, resolved: the workload and each rank's device (ranks alike share one, and
    ``request`` then lists no ranks: one probe serves them all); ``ranks``: every rank's device, when they
    differ (each is then probed), else None."""

    request: PlanRequest
    workload: Workload
    devices: dict[int, Device]
    ranks: tuple[DeviceInfo, ...] | None = None

    @property
    def device(self) -> Device:
        """The one device of ranks alike."""
        return next(iter(self.devices.values()))


def resolve_plan_request(request: PlanRequest, given: GivenObjects) -> ResolvedRequest:
    """The workload and the devices of a plan request (the objects given when there are): every rank's when a
    device list names them (each distinct device resolved once), this rank's under torchrun (the others'
    gathered, to tell whether they differ)."""
    if request.ranks:
        resolved: dict[tuple[str, int | None], tuple[Device, DeviceInfo]] = {}  # ranks alike share one device
        for r in request.ranks:
            if (r.device, r.memory_budget) not in resolved:
                dev = device_for(r)
                resolved[r.device, r.memory_budget] = dev, dev.describe()
        first = request.ranks[0]
        wl = given.workload if given.workload is not None else \
            load_for(request.probe.workload, resolved[first.device, first.memory_budget][0])
        devices = {r.rule.rank: resolved[r.device, r.memory_budget][0] for r in request.ranks}
        ranks = _devices_if_they_differ([resolved[r.device, r.memory_budget][1] for r in request.ranks])
        if ranks is not None:
            return ResolvedRequest(request, wl, devices, ranks)
        request = replace(request, ranks=())  # devices listed, all alike: one probe serves
        given = GivenObjects(wl, devices[0])
    wl, dev = resolve(request.probe, given)
    if distributed.active():
        ranks = _devices_if_they_differ([dev.describe()])
        if ranks is not None and not request.uniform_ranks:
            return ResolvedRequest(request, wl, {distributed.rank(): dev}, ranks)
    return ResolvedRequest(request, wl, {distributed.rank(): dev})


def _searched(request: PlanRequest, given: GivenObjects) -> Plan:
    """The settings search's plan: every setting probed by estimate (no store), the fastest planned."""
    from .probing.settings import search_settings

    assert request.search is not None
    wl, dev = resolve(request.probe, given)
    from .training.settings_confirm import confirmed

    return search_settings(request, wl, dev, lambda r, w, d: _probe_one(r, w, d, None, None),
                           allow=request.search.allow, confirm=confirmed if request.search.confirm else None)


def _tuned(request: PlanRequest, given: GivenObjects, plan_store: Store | None) -> Plan:
    """The plan of a request to tune: optuna times candidate plans on the real device (no plan store)."""
    from .planning.probed import measured_or_assumed
    from .training.tune import tune as run_tune

    assert request.tuning is not None
    wl, dev = resolve(request.probe, given)
    if plan_store is not None:
        log.progress("the plan store is not used with tune=True: tuning measures throughput here")
    t = request.tuning
    tuned = run_tune(wl, dev, request.target_batch, world_size=request.world_size, multiple_of=request.multiple_of,
                     uniform=request.uniform, margin=request.probe.margin, trials=t.trials, storage=t.storage,
                     study_name=t.study_name, world_size_source=request.world_size_source)
    assert tuned.probe is not None
    return replace(tuned, probe=replace(tuned.probe, source=request.probe.workload),
                   notes=tuned.notes + measured_or_assumed(tuned.probe, request.world_size, request.world_size_source))


def _plan_mixed(request: PlanRequest, wl: Workload, devices: dict[int, Device], ranks: tuple[DeviceInfo, ...],
                plan_store: Store | None) -> Plan:
    """Ranks that differ: each rank's device probed (here: every one of ``devices``, each distinct device once;
    under torchrun: this rank's, the others gathered), its speed known where it can be, then one plan that
    gives each rank its own micro-batch and micro-steps (or, with ``uniform_ranks``, the smallest-for-all)."""
    from .training.ranks import gather_objects, speed

    asked = {r.rule.rank: r for r in request.ranks} or \
        {distributed.rank(): replace(request.probe, max_batch=_mixed_limit(request))}
    rank_probes: dict[int, tuple[ProbeResult, float | None, str | None]] = {}
    alike: dict[tuple[str, int], int] = {}  # the first rank of each device (name and capacity): ranks alike probe once
    named: dict[int, tuple[str, int]] = {}
    for r, dev in devices.items():
        if id(dev) not in named:  # ranks alike share one device object: described once
            named[id(dev)] = (dev.describe().name, dev.capacity_bytes())
        twin = alike.setdefault(named[id(dev)], r)
        if twin != r:
            rank_probes[r] = rank_probes[twin]
            continue
        try:
            result = _probe_one(asked[r].with_rule(buckets=not asked[r].rule.sharded), wl, dev, plan_store, ranks)
        except DoesNotFit as exc:
            from .planning.mixed import rank_cannot_hold_one

            raise rank_cannot_hold_one(exc.facts, r, request.world_size, asked[r].device, asked[r].memory_budget,
                                       request.probe.rule.parallel) from None
        rank_probes[r] = (result, *((None, None) if request.uniform_ranks else speed(wl, dev, result.max_micro_batch)))
    gathered = {r: v for got in gather_objects(rank_probes) for r, v in got.items()} if distributed.active() \
        else rank_probes
    planned = _mixed_plan(request, [gathered[r] for r in range(request.world_size)], ranks)
    if plan_store is not None and distributed.rank() == 0:  # rank 0 keeps the plan for every rank's entry
        for fp in dict.fromkeys(gathered[r][0].fingerprint for r in range(request.world_size)):
            if fp is not None:
                plan_store.put(fp, plan=planned)
    return planned


def _mixed_limit(request: PlanRequest) -> int:
    """The largest micro-batch a rank of a mixed job may need: its share of the target when the ranks run
    alike, else all of the target but the others' least."""
    if request.uniform_ranks:
        return request.probe.max_batch
    return max(1, request.target_batch - (request.world_size - 1) * request.multiple_of)


def _mixed_plan(request: PlanRequest, rank_probes: list[tuple[ProbeResult, float | None, str | None]],
                ranks: tuple[DeviceInfo, ...]) -> Plan:
    """The plan of ranks that differ, from each rank's probe and speed."""
    from .planning.mixed import make_mixed_plan, uniform_ranks_note
    from .planning.planner import make_plan
    from .results.plan import peak_at
    from .training.ranks import ranks_note, share_of

    probes = [d[0] for d in rank_probes]
    source, world = request.world_size_source, request.world_size
    note = ranks_note([i.name for i in ranks], source)
    if request.uniform_ranks:
        low = min(range(world), key=lambda r: probes[r].max_micro_batch)
        planned = make_plan(request.target_batch, probes[low].max_micro_batch, world_size=world,
                            multiple_of=request.multiple_of, uniform=request.uniform, probe=probes[low],
                            world_size_source=source)
        return replace(planned, notes=planned.notes + (uniform_ranks_note(probes, low), note))
    return make_mixed_plan(request.target_batch, [share_of(*d) for d in rank_probes],
                           multiple_of=request.multiple_of, uniform=request.uniform,
                           probe=probes[distributed.rank()], world_size_source=source,
                           parallel=request.probe.rule.parallel, peak_of=lambda r, b: peak_at(probes[r], b),
                           notes=(note,))


#: What a verb given a request takes beside it.
BESIDE_A_REQUEST = ("store", "memory_snapshot", "at")
#: Former names of keywords, each accepted for one more release: the former name, the name.
OLD_NAMES = {"workload": "probe"}


def renamed(value: Any, old: Any, verb: str) -> Any:
    """A keyword's value, given under its name (``value``) or its former one (``old``, with a DeprecationWarning)."""
    if old is None:
        return value
    warnings.warn(f"{verb}(workload=...) is now {verb}(probe=...): workload= is accepted until the next release",
                  DeprecationWarning, stacklevel=3)
    if value is not None:
        raise BadInput(f"{verb}() was given probe and workload, its former name: give probe alone")
    return old


def declared(verb: Callable[..., Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The settings given to ``verb`` beyond the keywords it types by hand, each checked as declared
    (:func:`autotune.results.settings.keywords`: a keyword no setting is raises TypeError, naming the closest)."""
    return keywords(verb.__name__, settings, typed=inspect.signature(verb).parameters)


def _request(verb: Callable[..., Any], value: object, given: dict[str, Any], kind: type, fix: str) -> Any:
    """``value`` when it is a request of ``kind`` (None when it is no request); BadInput when it is the other
    kind (saying ``fix``), or when it comes with arguments it already holds (any of ``verb``'s keywords but
    :data:`BESIDE_A_REQUEST` given other than as its default, or any of its other ``settings``)."""
    other = PlanRequest if kind is ProbeRequest else ProbeRequest
    if isinstance(value, other):
        raise BadInput(f"{verb.__name__}() takes a {kind.__name__}, and was given a {other.__name__}: {fix}")
    if not isinstance(value, kind):
        return None
    defaults = {k: p.default for k, p in inspect.signature(verb).parameters.items() if p.kind is p.KEYWORD_ONLY}
    extra = [k for k, default in defaults.items()
             if k not in BESIDE_A_REQUEST and k not in OLD_NAMES and given[k] is not default] + list(given["settings"])
    if extra:
        name = kind.__name__
        raise BadInput(f"{verb.__name__}() was given a {name} and also {', '.join(extra)}: a {name} holds them; "
                       f"set them in the request (dataclasses.replace(request, ...)), or call {verb.__name__}() with "
                       f"keywords alone; beside a request it takes only {', '.join(BESIDE_A_REQUEST)}")
    return value


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """A Plan from a JSON file written by ``autotune plan --output``."""
    from .results.plan import Plan
    from .serial import read_json

    return Plan.from_dict(read_json(path), source=str(path))


# ---- run ---------------------------------------------------------------------------------------------------


def run(*, plan: Plan | str | os.PathLike[str] | None = None, target_batch: int | None = None, probe: Spec = None,
        device: Device | str = options.DEVICE, memory_budget: int | str | None = None,
        margin: float = options.MARGIN, world_size: int | None = None, multiple_of: int = 1,
        uniform: Uniform = None, steps: int = options.STEPS, verify: bool = True, precision: str = "fp32",
        max_norm: float | None = None, parallel: str | None = None, fsdp_sync: str = options.DEFAULT_FSDP_SYNC,
        store: StoreSpec = None, uniform_ranks: bool = False, ramp: RampConfig | bool | None = None,
        model: str | ModelSpec | None = None, search_settings: bool = False, workload: Spec = None) -> RunResult:
    """Plan (or load a plan), then train by it and verify: the API behind ``autotune run``.

    ``probe``, ``model``, ``uniform_ranks``, ``fsdp_sync``, ``search_settings``: as for :func:`plan` (a plan
    given runs its own gradient sync; ``workload``: ``probe``'s former name, deprecated). ``parallel``: "ddp" or
    "fsdp" when planning now; a plan given says how it runs, and ``parallel``, if given, must agree. ``store``: as
    for :func:`probe`; what the run measured is recorded there. ``device`` and ``memory_budget`` may be given per
    rank under torchrun. ``ramp``: a :class:`autotune.RampConfig` (True: its defaults) to start small and grow
    toward the target with the measured gradient noise scale, every phase an exact plan; the result's
    ``batch_schedule`` says what was done. A plan holding a chosen ``setting`` trains under it (checkpointing
    around its blocks, FSDP, autocast for bf16-mixed).
    """
    from .planning.ramp import check_below, first_batch, uniform_base
    from .training.runner import run_plan

    workload = workload_or_model(renamed(probe, workload, "run"), model)
    steps, verify = options.whole(steps, "steps", text=False), options.boolean(verify, "verify")
    precision = options.precision(precision)
    max_norm = options.max_norm(max_norm)
    ramp = _ramp(ramp)
    if (plan is None) == (target_batch is None):
        raise BadInput("give either {plan} (a Plan or its JSON file) or {target_batch} (to plan first), not both",
                       field="target_batch")
    if ramp is not None and ramp.start is not None and target_batch is not None:
        check_below(ramp.start, target_batch)
    if plan is not None:
        planned, wl, dev = _given_plan(plan, workload, device, memory_budget, parallel, fsdp_sync)
    else:
        this_rank(device, memory_budget, group())  # a device per rank is for a torchrun job
        request = plan_request(target_batch, probe=workload, device=device, memory_budget=memory_budget,
                               margin=margin, world_size=world_size, multiple_of=multiple_of, uniform=uniform,
                               uniform_ranks=uniform_ranks, parallel=parallel or options.DEFAULT_PARALLEL,
                               fsdp_sync=fsdp_sync, search_settings=search_settings, group=group())
        # Before any work: a run needs as many processes as the plan has ranks, and a real device.
        distributed.check_world(request.world_size, f"{{world_size}} {request.world_size}"
                                if request.world_size_source == "flag" else f"WORLD_SIZE={request.world_size}",
                                f"or plan for {plural(request.world_size, 'rank')} without training them: "
                                "plan, not run")
        wl, dev = _real(request.probe, GivenObjects.of(workload, device))
        planned = plan_for(request, store=store, given=GivenObjects(wl, dev))
    precision = run_precision(planned.probe.source if planned.probe is not None else None, precision)
    wl = _under_setting(planned, wl, dev)
    uniform_ramp = ramp is not None and uniform not in (None, False)  # every phase uniform too
    if ramp is not None:  # a ramp that cannot start fails before any training
        base, quantum = uniform_base(planned) if uniform_ramp else (planned, None)
        first_batch(base, ramp, quantum=quantum)

    def train() -> RunResult:
        return run_plan(planned, wl, dev, steps=steps, verify=verify, precision=precision, max_norm=max_norm,
                        ramp=ramp, uniform=uniform_ramp)

    plan_store = open_store(store)
    return train() if plan_store is None else cached.record_run(plan_store, planned, wl, dev, precision, train)


def _under_setting(planned: Plan, wl: Workload, dev: Device) -> Workload:
    """The workload as a plan's chosen setting trains it (a settings search's), else as it is."""
    if planned.setting is None:
        return wl
    from .probing.settings import apply

    return apply(wl, planned.setting, spec=planned.probe.source if planned.probe is not None else None,
                 cuda=dev.torch_device.type == "cuda", real=True)


def _ramp(ramp: Any) -> RampConfig | None:
    from .results.ramp import RampConfig

    if ramp is True:
        return RampConfig()
    if ramp is None or ramp is False:
        return None
    if not isinstance(ramp, RampConfig):
        raise BadInput(f"ramp {ramp!r} must be an autotune.RampConfig, True (its defaults) or None")
    return ramp


def _given_plan(plan: Plan | str | os.PathLike[str], workload: Spec, device: Any, memory_budget: Any,
                parallel: str | None, fsdp_sync: str) -> tuple[Plan, Workload, Device]:
    """A plan given to :func:`run` (or its file), checked against this job, with its workload and device: the
    plan's own probe and, unless given, the budget it was made for."""
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    if parallel is not None and options.parallel(parallel) != plan.parallel:
        raise BadInput(f"but the plan was made for {plan.parallel}", field="parallel", value=parallel,
                       fix="drop {parallel}, or plan again with " + mention("parallel", parallel))
    if options.fsdp_sync(fsdp_sync) not in (options.DEFAULT_FSDP_SYNC, plan.fsdp_sync):
        raise BadInput(f"but the plan synchronises FSDP's gradients at {plan.fsdp_sync or 'no'} micro-step (it was "
                       f"made for {plan.parallel})", field="fsdp_sync", value=fsdp_sync,
                       fix="drop {fsdp_sync}, or plan again with " + mention("fsdp_sync", fsdp_sync))
    distributed.check_world(plan.world_size, f"the plan is for {plural(plan.world_size, 'rank')}",
                            "or plan for " + mention("world_size", distributed.world_size()))
    probed = plan.probe
    if workload is None and probed is not None:
        workload = probed.source or probed.workload
    if memory_budget is None and plan.budget_bytes_of(distributed.rank()) is not None:
        memory_budget = plan.budget_bytes_of(distributed.rank())  # run under the budget the plan was made for
    request = probe_request(workload, device=device, memory_budget=memory_budget, group=group())
    wl, dev = _real(request, GivenObjects.of(workload, device))
    return plan, wl, dev


def _real(request: ProbeRequest, given: GivenObjects) -> tuple[Workload, Device]:
    """What a run trains on: the request's workload and device, which must be real."""
    wl, dev = resolve(request, given)
    if dev.estimated:
        raise BadInput("autotune run trains for real: give a real device (cpu or cuda:N), not estimate")
    return wl, dev
