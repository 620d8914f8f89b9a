"""The public API: probe a workload on a device, plan, (tune), run, for the command line and for programs.

Every function takes what the command line takes (a probe spec such as "mlp"
or "model.py:build", a device name, a size string such as "8GiB") as well as
objects (a Workload, a Device), and checks every argument with autotune's
errors, which name the parameter.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from . import log, options
from .devices import Device, get_device
from .errors import BadInput
from .probing.fsdp import FsdpRule
from .results.device import DeviceInfo
from .results.probe import ProbeResult
from .store import cached
from .training import distributed
from .units import plural
from .workload import DEFAULT_PROBE, Workload, load_workload

if TYPE_CHECKING:
    from .planning.planner import Uniform
    from .results.plan import Plan
    from .results.ramp import RampConfig
    from .results.run import RunResult
    from .store import Store

Spec = Workload | str | None
StoreSpec: TypeAlias = "Store | str | Literal[False] | None"
#: The plan store used when none is given.
STORE_VARIABLE = "AUTOTUNE_STORE"


def resolve(workload: Spec, device: Device | str, memory_budget: Any) -> tuple[Workload, Device]:
    """Turn names into objects; device errors come before the workload is built.

    Under torchrun, ``auto`` is this rank's own GPU (LOCAL_RANK), else the CPU, and a device or a
    memory budget given once per rank (``"cpu"`` and ``"8MiB,3MiB"``) is this rank's.
    """
    device, budget = _this_rank(device, memory_budget)
    if device == "auto" and distributed.active():
        device = distributed.local_device_name()
    if isinstance(device, str):
        dev = get_device(device, memory_budget=budget)
    elif all(hasattr(device, a) for a in ("capacity_bytes", "measure", "estimator")):
        dev = device
    else:
        raise BadInput(f"device {device!r} is neither a device name (auto, cpu, cuda:N, estimate) nor a Device")
    if workload is not None and not isinstance(workload, (Workload, str)):
        raise BadInput(f"workload {workload!r} is neither a Workload nor a probe spec (a built-in name such as "
                       "'mlp', a .py file, or package.module[:function])")
    wl = workload if isinstance(workload, Workload) else load_workload(workload)
    return wl, dev


def _this_rank(device: Device | str, memory_budget: Any) -> tuple[Device | str, int | None]:
    """The device and budget of this process: under torchrun, its rank's item of a per-rank list."""
    devices = options.per_rank(device, "device") if isinstance(device, (str, list, tuple)) else (device,)
    budgets = options.memory_budgets(memory_budget)
    listed = max(len(devices), len(budgets))
    if listed == 1:
        return devices[0], budgets[0]
    if not distributed.active():
        raise BadInput(f"a device or memory_budget per rank ({listed} given) is for a plan of several ranks, or for "
                       "each rank of a torchrun job: plan with it, or launch that many processes")
    rank, world = distributed.rank(), distributed.world_size()
    for name, values in (("device", devices), ("memory_budget", budgets)):
        if len(values) not in (1, world):
            raise BadInput(f"{name} lists {len(values)} values for the {plural(world, 'rank')} running: give one, or "
                           f"one per rank")
    return devices[rank % len(devices)], budgets[rank % len(budgets)]


def probe(workload: Spec = None, *, device: Device | str = options.DEVICE, memory_budget: int | str | None = None,
          margin: float = options.MARGIN, max_batch: int = options.MAX_BATCH,
          data_parallel: bool | None = None, parallel: str = options.DEFAULT_PARALLEL,
          world_size: int | None = None, store: StoreSpec = None,
          memory_snapshot: str | os.PathLike[str] | bool | None = None, at: int | None = None) -> ProbeResult:
    """The largest micro-batch of ``workload`` that fits ``device``: the API behind ``autotune probe``.

    ``parallel``: "ddp" (every rank holds the whole model) or "fsdp" (the model
    sharded with ``fully_shard`` over ``world_size`` ranks: the process group's
    under torchrun, else ``world_size``, $WORLD_SIZE or 1; the fit rule is then
    one rank's, measured on a fake process group of that size). ``data_parallel``:
    under DDP, the fit rule holds DDP's gradient buckets; by default, whether
    there are several ranks. Under torchrun the ranks agree on the smallest maximum.
    ``store``: a plan store's URL (``sqlite:///plans.db``, any SQLAlchemy URL) or
    a Store: a probe it has seen is answered from it (on a real device, after one
    confirm run), a new one is kept there; by default ``$AUTOTUNE_STORE`` when
    set, and ``False`` for none.
    ``memory_snapshot``: a file to write the fit rule's allocation trace at the max micro-batch (or ``at``) to,
    in the format of ``torch.cuda.memory._snapshot()`` (True: no file); the result's ``memory`` then says
    where the peak comes from, what would lower it most, and which allocator settings fit more (see
    :func:`memory_snapshot`). On a real GPU the real snapshot of that size is written beside it.
    """
    return _probe(workload, device=device, memory_budget=memory_budget, margin=margin, max_batch=max_batch,
                  data_parallel=data_parallel, parallel=parallel, world_size=world_size, store=store,
                  memory_snapshot=memory_snapshot, at=at)


def _probe(workload: Spec, *, device: Device | str, memory_budget: int | str | None, margin: float, max_batch: int,
           data_parallel: bool | None, parallel: str, world_size: int | None, store: StoreSpec,
           memory_snapshot: str | os.PathLike[str] | bool | None, at: int | Callable[[ProbeResult], int] | None
           ) -> ProbeResult:
    margin = options.margin(margin)
    if isinstance(at, int):
        at = options.whole(at, "at")
    path = options.snapshot_path(memory_snapshot)
    max_batch = options.whole(max_batch, "max_batch")
    parallel = options.parallel(parallel)
    if world_size is not None:
        world_size = options.whole(world_size, "world_size")
    world, _ = _world_size(world_size, None)
    kept = _open_store(store)
    wl, dev = resolve(workload, device, memory_budget)
    if data_parallel is None:
        data_parallel = distributed.active() or (world_size or 1) > 1
    ranks = _devices_if_they_differ([dev.describe()]) if distributed.active() else None
    if memory_snapshot and not dev.estimated and dev.torch_device.type == "cuda":
        from .devices.history import RecordingDevice

        dev = RecordingDevice(dev)  # the confirm run records the GPU allocator's history
    result = _probe_here(wl, dev, margin=margin, max_batch=max_batch, data_parallel=data_parallel,
                         parallel=parallel, world=world, rank=distributed.rank(), kept=kept, ranks=ranks)
    if distributed.active():
        result = agree_across_ranks(result)
    result = replace(result, source=_source(workload))
    if memory_snapshot:
        from .probing.memory import explain

        batch = at(result) if callable(at) else at
        result = replace(result, memory=explain(result, wl, dev, batch=batch, path=path,
                                                rule=_rule(parallel, world, distributed.rank(), data_parallel)))
    return result


def memory_snapshot(path: str | os.PathLike[str] | None, workload: Spec = None, *,
                    device: Device | str = options.DEVICE, memory_budget: int | str | None = None,
                    margin: float = options.MARGIN, at: int | None = None, max_batch: int = options.MAX_BATCH,
                    parallel: str = options.DEFAULT_PARALLEL, world_size: int | None = None) -> ProbeResult:
    """Probe ``workload``, then write the fit rule at the max micro-batch (or ``at``) to ``path`` as
    ``torch.cuda.memory._snapshot()`` does: what ``python -m torch.cuda._memory_viz trace_plot|segment_plot``
    and pytorch.org/memory_viz open, before having the GPU, at sizes that would not fit. The result's
    ``memory`` holds the peak's parts, what would lower it most and the allocator settings compared.

    Standing in for a GPU the trace is the caching-allocator simulation's (its highest reserved point is the
    result's reserved peak, to the byte); on the CPU it is the tracker's (allocated memory only).
    """
    return probe(workload, device=device, memory_budget=memory_budget, margin=margin, max_batch=max_batch,
                 parallel=parallel, world_size=world_size, memory_snapshot=path if path is not None else True, at=at)


def _rule(parallel: str, world: int, rank: int, data_parallel: bool) -> dict[str, Any]:
    """How the fit rule runs: FSDP's sharding over ``world`` as ``rank``, else whether DDP's buckets are held."""
    if parallel == "fsdp":
        return {"sharding": FsdpRule(world, rank)}
    return {"data_parallel": bool(data_parallel)}


def _probe_here(wl: Workload, dev: Device, *, margin: float, max_batch: int, data_parallel: bool, parallel: str,
                world: int, rank: int, kept: Store | None, ranks: tuple[DeviceInfo, ...] | None) -> ProbeResult:
    """One device's probe, through the store when there is one, as rank ``rank`` of ``world`` (an FSDP probe
    shards over them); ``ranks``: every rank's device, when they differ (the store's fingerprint covers them)."""
    log.progress(f"probing {wl.name} on {dev.describe().summary}" +
                 (f" (FSDP over {plural(world, 'rank')})" if parallel == "fsdp" else ""))
    rule = _rule(parallel, world, rank, data_parallel)
    return cached.probe(kept, wl, dev, margin=margin, max_batch=max_batch, world_size=world, rule=rule,
                        parallel=parallel, ranks=ranks)


def _devices_if_they_differ(mine: list[DeviceInfo]) -> tuple[DeviceInfo, ...] | None:
    """Every rank's device (gathered under torchrun; ``mine`` lists them all otherwise), or None when they are
    alike (their kind, GPU model and capacity)."""
    from .training.ranks import gather_objects, rank_key

    infos = [i for got in gather_objects(mine) for i in got] if distributed.active() else mine
    return tuple(infos) if len({rank_key(i) for i in infos}) > 1 else None


def _open_store(store: StoreSpec) -> Store | None:
    """The plan store to use: ``store`` itself, the one at its URL, ``$AUTOTUNE_STORE``'s when None, none when False."""
    if store is None:
        store = os.environ.get(STORE_VARIABLE, "").strip() or False
    if store is False:
        return None
    if isinstance(store, str):
        from .store import open_store

        return open_store(store)
    if not all(hasattr(store, a) for a in ("get", "claim", "put")):
        raise BadInput(f"store {store!r} is neither a database URL (e.g. sqlite:///plans.db) nor a Store")
    return store


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


def _source(workload: Workload | str | None) -> str | None:
    """How to load the workload again, when it came from a probe spec."""
    return None if isinstance(workload, Workload) else _portable(workload or DEFAULT_PROBE)


def _portable(spec: str) -> str:
    """A probe spec that still loads from another folder: files become absolute paths."""
    path, _, func = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    if Path(path).is_file():
        return str(Path(path).resolve()) + (f":{func}" if func else "")
    return spec


def plan(target_batch: int, *, workload: Spec = None, device: Device | str = options.DEVICE,
         memory_budget: int | str | None = None, margin: float = options.MARGIN, world_size: int | None = None,
         multiple_of: int = 1, uniform: Uniform = None, tune: bool = False, trials: int = options.TRIALS,
         storage: str | None = None, study_name: str | None = None, env: dict[str, str] | None = None,
         parallel: str = options.DEFAULT_PARALLEL, store: StoreSpec = None, uniform_ranks: bool = False,
         memory_snapshot: str | os.PathLike[str] | bool | None = None, at: int | None = None) -> Plan:
    """Probe, then plan ``target_batch`` exactly: the API behind ``autotune plan``.

    ``parallel``: "ddp", or "fsdp" to shard the model over the ranks with
    ``fully_shard`` (the probe then measures one rank of exactly that many).
    The probe never searches past the per-rank target, since a plan never needs more.
    ``uniform``: None takes the fewest steps (uneven micro-batches where they must be), True
    equal micro-batches within twice the fewest steps (else NoUniformPlan, a PlanError that
    names the nearest targets), "force" equal micro-batches however many steps they take.
    With ``tune``, an optuna study times real steps of the candidate plans (and of
    the workload's options) against the untuned plan, and the fastest wins unless it is
    within noise; ``storage`` is optuna's (e.g. ``sqlite:///reports/tune.db``), so a study
    can be resumed and inspected, under ``study_name`` or a name made from the settings.
    ``store``: the plan store, as for :func:`probe`; the plan is kept there beside its probe.
    ``memory_snapshot``, ``at``: as for :func:`probe`, at the plan's micro-batch unless ``at`` is given.

    Ranks that differ: ``device`` and ``memory_budget`` may be given once per rank
    (``"estimate:A100-80GB,estimate:T4-16GB"``, ``"estimate:H100-80GB*4,estimate:A10G-24GB*4"``,
    ``"8MiB,3MiB"`` or lists; the world size is how many), and under torchrun every rank probes its
    own device. When the ranks differ (kind, GPU model or usable memory), each gets its own
    micro-batch and micro-steps (:func:`autotune.planning.mixed.make_mixed_plan`), balanced by time
    per sample where every rank's is known (timed on a GPU of the job, a roofline estimate for a GPU by
    name), else by memory. ``uniform_ranks``: every rank at the smallest rank's max micro-batch instead.
    """
    from .planning.planner import UNIFORM, check_plan

    target_batch = options.whole(target_batch, "target_batch", example="1024")
    margin = options.margin(margin)
    multiple_of = options.whole(multiple_of, "multiple_of")
    trials = options.whole(trials, "trials")
    parallel = options.parallel(parallel)
    if world_size is not None:
        world_size = options.whole(world_size, "world_size")
    if uniform not in UNIFORM:
        raise BadInput(f"uniform {uniform!r} must be True, False, None or 'force'")
    devices = options.per_rank(device, "device") if isinstance(device, (str, list, tuple)) else (device,)
    budgets = options.memory_budgets(memory_budget)
    world, source = _world_size(world_size, env, _listed(devices, budgets))
    # Reject a target that can never be planned, or a storage that cannot open, before a probe.
    check_plan(target_batch, max(1, target_batch), world_size=world, multiple_of=multiple_of)
    if not tune and (storage is not None or study_name is not None):
        raise BadInput("storage and study_name are for tune=True: pass tune=True, or leave them out")
    if tune and parallel == "fsdp":
        raise BadInput("tuning times one process and cannot shard it: plan with parallel fsdp without tune=True")
    if memory_snapshot and tune:
        raise BadInput("memory_snapshot is for plans made without tune=True: drop one of them")
    if memory_snapshot and _listed(devices, budgets) is not None:
        raise BadInput("memory_snapshot is for one device: drop the device or memory_budget per rank, or the snapshot")
    kept = _open_store(store)
    settings = _Settings(target=target_batch, margin=margin, multiple_of=multiple_of, uniform=uniform,
                         parallel=parallel, world=world, source=source, kept=kept, uniform_ranks=bool(uniform_ranks),
                         snapshot=memory_snapshot, at=at)
    if tune:
        if len(devices) > 1 or len(budgets) > 1:
            raise BadInput("tuning times one device: tune without a device or memory_budget per rank")
        return _tuned(settings, workload, device, memory_budget, trials, storage, study_name)
    if not distributed.active() and len(devices) == len(budgets) == 1:
        return _plan_alike(settings, workload, device, memory_budget)
    wl = workload if isinstance(workload, Workload) else load_workload(workload)
    if distributed.active():
        wl, dev = resolve(wl, device, memory_budget)
        ranks = _devices_if_they_differ([dev.describe()])
        if ranks is None or settings.uniform_ranks:
            return _plan_alike(settings, wl, dev, None, source=_source(workload))
        return _plan_mixed(settings, wl, {distributed.rank(): dev}, ranks, _source(workload))
    per_rank = {r: resolve(wl, devices[r % len(devices)], budgets[r % len(budgets)])[1] for r in range(world)}
    ranks = _devices_if_they_differ([d.describe() for d in per_rank.values()])
    if ranks is None:
        return _plan_alike(settings, wl, per_rank[0], None, source=_source(workload))
    return _plan_mixed(settings, wl, per_rank, ranks, _source(workload))


@dataclass(frozen=True)
class _Settings:
    """What every way of planning takes, checked once by :func:`plan`."""

    target: int
    margin: float
    multiple_of: int
    uniform: Uniform
    parallel: str
    world: int
    source: str
    kept: Store | None
    uniform_ranks: bool
    snapshot: str | os.PathLike[str] | bool | None = None
    at: int | None = None


def _tuned(s: _Settings, workload: Spec, device: Device | str, memory_budget: Any, trials: int,
           storage: str | None, study_name: str | None) -> Plan:
    from .planning.probed import measured_or_assumed
    from .training.study import check_storage
    from .training.tune import tune as run_tune

    check_storage(storage)
    if distributed.active():
        raise BadInput(f"tuning times one process: tune without torchrun, with world_size={s.world}")
    wl, dev = resolve(workload, device, memory_budget)
    if s.kept is not None:
        log.progress("the plan store is not used with tune=True: tuning measures throughput here")
    tuned = run_tune(wl, dev, s.target, world_size=s.world, multiple_of=s.multiple_of, uniform=s.uniform,
                     margin=s.margin, trials=trials, storage=storage, study_name=study_name,
                     world_size_source=s.source)
    assert tuned.probe is not None
    return replace(tuned, probe=replace(tuned.probe, source=_source(workload)),
                   notes=tuned.notes + measured_or_assumed(tuned.probe, s.world, s.source))


def _plan_alike(s: _Settings, workload: Spec, device: Device | str, memory_budget: Any, *,
                source: str | None = None) -> Plan:
    """Every rank planned alike: one probe (under torchrun the ranks agree on the smallest max)."""
    from .planning.planner import make_plan
    from .planning.probed import plan_probed

    def planned_batch(r: ProbeResult) -> int:
        return make_plan(s.target, r.max_micro_batch, world_size=s.world, multiple_of=s.multiple_of,
                         uniform=s.uniform, probe=r, world_size_source=s.source).micro_batch

    result = _probe(workload, device=device, memory_budget=memory_budget, margin=s.margin,
                    max_batch=math.ceil(s.target / s.world), data_parallel=s.world > 1, parallel=s.parallel,
                    world_size=s.world, store=s.kept if s.kept is not None else False, memory_snapshot=s.snapshot,
                    at=s.at if s.at is not None else planned_batch)
    if source is not None:
        result = replace(result, source=source)
    made = plan_probed(s.target, result, world_size=s.world, world_size_source=s.source,
                       multiple_of=s.multiple_of, uniform=s.uniform)
    if s.kept is not None and result.fingerprint is not None:
        s.kept.put(result.fingerprint, plan=made)  # kept beside its probe
    return made


def _plan_mixed(s: _Settings, wl: Workload, devices: dict[int, Device], ranks: tuple[DeviceInfo, ...],
                source: str | None) -> Plan:
    """Ranks that differ: each rank's device probed (here: every one of ``devices``, each distinct device once;
    under torchrun: this rank's, the others gathered), its speed known where it can be, then one plan that
    gives each rank its own micro-batch and micro-steps (or, with ``uniform_ranks``, the smallest-for-all)."""
    from .planning.mixed import make_mixed_plan
    from .planning.planner import make_plan
    from .results.plan import peak_at
    from .training.ranks import gather_objects, ranks_note, share_of, speed

    limit = math.ceil(s.target / s.world) if s.uniform_ranks else max(1, s.target - (s.world - 1) * s.multiple_of)
    done: dict[int, tuple[ProbeResult, float | None, str | None]] = {}
    for r, dev in devices.items():
        twin = next((q for q in done if devices[q] is dev or _same_device(devices[q], dev)), None)
        if twin is not None:
            done[r] = done[twin]
            continue
        result = replace(_probe_here(wl, dev, margin=s.margin, max_batch=limit, data_parallel=True,
                                     parallel=s.parallel, world=s.world, rank=r, kept=s.kept, ranks=ranks),
                         source=source)
        done[r] = (result, *((None, None) if s.uniform_ranks else speed(wl, dev, result.max_micro_batch)))
    gathered = {r: v for got in gather_objects(done) for r, v in got.items()} if distributed.active() else done
    probes = [gathered[r][0] for r in range(s.world)]
    mine = probes[distributed.rank()]
    if s.uniform_ranks:
        low = min(range(s.world), key=lambda r: probes[r].max_micro_batch)
        made = make_plan(s.target, probes[low].max_micro_batch, world_size=s.world, multiple_of=s.multiple_of,
                         uniform=s.uniform, probe=probes[low], world_size_source=s.source)
        note = (f"uniform ranks: every rank at rank {low}'s max micro-batch {probes[low].max_micro_batch} "
                f"(max micro-batch per rank: {', '.join(str(p.max_micro_batch) for p in probes)})")
        made = replace(made, notes=made.notes + (note, ranks_note([i.name for i in ranks], s.source)))
    else:
        shares = [share_of(*gathered[r]) for r in range(s.world)]
        made = make_mixed_plan(s.target, shares, multiple_of=s.multiple_of, uniform=s.uniform, probe=mine,
                               world_size_source=s.source, parallel=s.parallel,
                               peak_of=lambda r, b: peak_at(probes[r], b),
                               notes=(ranks_note([i.name for i in ranks], s.source),))
    if s.kept is not None and distributed.rank() == 0:  # rank 0 keeps the plan for every rank's entry
        for fp in dict.fromkeys(p.fingerprint for p in probes):
            if fp is not None:
                s.kept.put(fp, plan=made)
    return made


def _same_device(a: Device, b: Device) -> bool:
    """Two devices of a device list that probe alike: the same name and capacity."""
    return a.describe().name == b.describe().name and a.capacity_bytes() == b.capacity_bytes()


def _listed(devices: tuple[Any, ...], budgets: tuple[Any, ...]) -> int | None:
    """How many ranks a device or budget list names (None for one device and one budget); BadInput when two
    lists disagree."""
    listed = max(len(devices), len(budgets))
    if listed == 1:
        return None
    if len(devices) > 1 and len(budgets) > 1 and len(devices) != len(budgets):
        raise BadInput(f"device lists {len(devices)} ranks and memory_budget {len(budgets)}: give one per rank "
                       "in both, or one of them once")
    return listed


def _world_size(flag: int | None, env: dict[str, str] | None, listed: int | None = None) -> tuple[int, str]:
    """The process group's world size when there is one; else --world-size, the length of a device or budget
    list (``listed``), $WORLD_SIZE, 1."""
    from .planning.planner import world_size_from

    if distributed.active():
        world = distributed.world_size()
        if flag is not None and flag != world:
            raise BadInput(f"world_size {flag} but the process group has {plural(world, 'rank')}: drop world_size "
                           f"or launch {flag} processes")
        if listed is not None and listed != world:
            raise BadInput(f"a device or memory_budget per rank lists {listed} but the process group has "
                           f"{plural(world, 'rank')}: give one per rank, or one for all")
        return world, "process group"
    if listed is not None:
        if flag is not None and flag != listed:
            raise BadInput(f"world_size {flag} but the device or memory_budget list names {listed} ranks: drop "
                           "world_size (the list gives it) or give one per rank")
        return listed, "the device list"
    return world_size_from(flag, os.environ if env is None else env)


_probe_and_plan = plan  # ``run`` takes a parameter called plan


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """A Plan from a JSON file written by ``autotune plan --output``."""
    from .results.plan import Plan
    from .serial import read_json

    return Plan.from_dict(read_json(path), source=str(path))


def run(*, plan: Plan | str | os.PathLike[str] | None = None, target_batch: int | None = None, workload: Spec = None,
        device: Device | str = options.DEVICE, memory_budget: int | str | None = None,
        margin: float = options.MARGIN, world_size: int | None = None, multiple_of: int = 1,
        uniform: Uniform = None, steps: int = options.STEPS, verify: bool = True, precision: str = "fp32",
        max_norm: float | None = None, parallel: str | None = None, store: StoreSpec = None,
        uniform_ranks: bool = False, ramp: RampConfig | bool | None = None) -> RunResult:
    """Plan (or load a plan), then train by it and verify: the API behind ``autotune run``.

    ``parallel``: "ddp" or "fsdp" when planning now (default "ddp"); a plan
    given says how it runs itself, and ``parallel``, if given, must agree.
    ``store``: the plan store, as for :func:`probe`; what the run measured is recorded there.
    ``device`` and ``memory_budget`` may be given per rank under torchrun, and ``uniform_ranks``
    is :func:`plan`'s: ranks that differ each run their own micro-batch and micro-steps unless it is set.
    ``ramp``: a :class:`autotune.RampConfig` (True: its defaults) to start at a small effective batch and grow
    it toward the target with the measured gradient noise scale, every phase an exact plan
    (:mod:`autotune.planning.ramp`); the result's ``batch_schedule`` says what was done.
    """
    from .planning.ramp import check_below, first_batch
    from .results.ramp import RampConfig
    from .training.runner import run_plan

    steps = options.whole(steps, "steps")
    if parallel is not None:
        parallel = options.parallel(parallel)
    precision = options.precision(precision)
    max_norm = options.max_norm(max_norm)
    if ramp is True:
        ramp = RampConfig()
    elif ramp is False:
        ramp = None
    if ramp is not None and not isinstance(ramp, RampConfig):
        raise BadInput(f"ramp {ramp!r} must be an autotune.RampConfig, True (its defaults) or None")
    if (plan is None) == (target_batch is None):
        raise BadInput("give either plan (a Plan or its JSON file) or target_batch (to plan first), not both")
    if ramp is not None and ramp.start is not None and target_batch is not None:
        check_below(ramp.start, target_batch)
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    if plan is not None and parallel is not None and parallel != plan.parallel:
        raise BadInput(f"parallel {parallel} but the plan was made for {plan.parallel}: drop parallel, or plan "
                       f"again with parallel {parallel}")
    # Before any work: a run needs as many processes as the plan has ranks.
    if plan is not None:
        distributed.check_world(plan.world_size, f"the plan is for {plural(plan.world_size, 'rank')}",
                                f"or plan for world_size={distributed.world_size()}")
    else:
        world, source = _world_size(world_size, None)
        distributed.check_world(world, f"world_size {world}" if source == "flag" else f"WORLD_SIZE={world}",
                                f"or plan for {plural(world, 'rank')} without training them: plan, not run")
    if plan is not None:
        probed = plan.probe
        if workload is None and probed is not None:
            workload = probed.source or probed.workload
        if memory_budget is None and plan.budget_bytes_of(distributed.rank()) is not None:
            memory_budget = plan.budget_bytes_of(distributed.rank())  # run under the budget the plan was made for
    kept = _open_store(store)
    wl, dev = resolve(workload, device, memory_budget)
    if dev.estimated:
        raise BadInput("autotune run trains for real: give a real device (cpu or cuda:N), not estimate")
    if plan is None:
        assert target_batch is not None
        plan = _probe_and_plan(target_batch, workload=wl, device=dev, margin=margin, world_size=world_size,
                               multiple_of=multiple_of, uniform=uniform,
                               parallel=parallel or options.DEFAULT_PARALLEL,
                               store=kept if kept is not None else False, uniform_ranks=uniform_ranks)
    planned = plan
    if ramp is not None:
        first_batch(planned, ramp)  # a ramp that cannot start fails before any training

    def train() -> RunResult:
        return run_plan(planned, wl, dev, steps=steps, verify=verify, precision=precision, max_norm=max_norm,
                        ramp=ramp)

    if kept is None:
        return train()
    return cached.record_run(kept, planned, wl, dev, precision, train)
