"""The requests a user's arguments make: :func:`probe_request` and :func:`plan_request` check every argument
of :func:`autotune.probe` and :func:`autotune.plan` (the command line's flags, the service's body) once, and
resolve what the environment decides (the world size, this rank's item of a per-rank list).

No torch here: the command line builds its request before torch loads, the service in its server process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from .. import options
from ..dburl import check_storage
from ..errors import BadInput, mention
from ..results.model import ModelSpec, is_model_spec
from ..results.request import FitRule, PlanRequest, ProbeRequest, Snapshot, Tuning
from ..results.search import searched
from ..units import plural
from .planner import check_plan, world_size_from


def probe_spec(workload: object) -> str | None:
    """The probe spec a request names: a spec as it loads again from anywhere (files as absolute paths), the
    default probe for None, and None for a Workload object (it travels beside the request)."""
    if workload is None:
        workload = options.DEFAULT_PROBE
    if not isinstance(workload, str):
        return None
    if is_model_spec(workload):  # a Hugging Face model by name, its settings in their one written form
        return ModelSpec.parse(workload).spec()
    spec = options.probe_spec(workload)
    if not spec.file:
        return workload.strip()
    path = Path(spec.module).resolve()
    return str(path) + (f":{spec.function}" if spec.function != "build" else "")


def device_name(device: object) -> str:
    """A device as a request names it: the name given, or a Device object's own name."""
    if isinstance(device, str):
        return options.text(device, "device")
    describe = getattr(device, "describe", None)
    if describe is None or not all(hasattr(device, a) for a in ("capacity_bytes", "measure", "estimator")):
        raise BadInput("is neither a device name (auto, cpu, cuda:N, estimate) nor a Device", field="device",
                       value=device)
    return str(describe().name)


def world_of(flag: int | None, env: Mapping[str, str], group: tuple[int, int] | None,
             listed: int | None = None) -> tuple[int, str]:
    """(world size, where it came from): the process group's when there is one; else ``world_size``, the
    length of a device or budget list (``listed``), ``$WORLD_SIZE``, 1."""
    if flag is not None:
        flag = options.whole(flag, "world_size", text=False)
    if group is not None:
        world = group[0]
        if flag is not None and flag != world:
            raise BadInput(f"but the process group has {plural(world, 'rank')}", field="world_size", value=flag,
                           limit=world, fix="drop {world_size} " + f"or launch {flag} processes")
        if listed is not None and listed != world:
            raise BadInput("a {device} or {memory_budget} per rank " + f"lists {listed} but the process group has "
                           f"{plural(world, 'rank')}", field="device", limit=world,
                           fix="give one per rank, or one for all")
        return world, "process group"
    if listed is not None:
        if flag is not None and flag != listed:
            raise BadInput("but the {device} or {memory_budget} list " + f"names {listed} ranks", field="world_size",
                           value=flag, limit=listed, fix="drop {world_size} (the list gives it) or give one per rank")
        return listed, "the device list"
    return world_size_from(flag, env)


def _listed(devices: tuple[object, ...], budgets: tuple[int | None, ...]) -> int | None:
    """How many ranks a device or budget list names (None for one device and one budget)."""
    listed = max(len(devices), len(budgets))
    if listed == 1:
        return None
    if len(devices) > 1 and len(budgets) > 1 and len(devices) != len(budgets):
        raise BadInput("{device} " + f"lists {len(devices)} ranks and " + "{memory_budget} " + f"{len(budgets)}",
                       field="memory_budget", limit=len(devices), fix="give one per rank in both, or one of them once")
    return listed


def _per_rank(device: object) -> tuple[object, ...]:
    return options.per_rank(device, "device") if isinstance(device, (str, list, tuple)) else (device,)


def this_rank(device: object, memory_budget: object, group: tuple[int, int] | None) -> tuple[object, int | None]:
    """The device and budget of this process: under a process group, its rank's item of a per-rank list."""
    devices, budgets = _per_rank(device), options.memory_budgets(memory_budget)
    listed = _listed(devices, budgets)
    if listed is None:
        return devices[0], budgets[0]
    if group is None:
        raise BadInput("a {device} or {memory_budget} per rank " + f"({listed} given) is for a plan of several "
                       "ranks, or for each rank of a torchrun job", field="device",
                       fix="plan with it, or launch that many processes")
    world, rank = group
    for name, values in (("device", devices), ("memory_budget", budgets)):
        if len(values) not in (1, world):
            raise BadInput(mention(name) + f" lists {len(values)} values for the {plural(world, 'rank')} running",
                           field=name, limit=world, fix="give one, or one per rank")
    return devices[rank % len(devices)], budgets[rank % len(budgets)]


def one_device(device: object, memory_budget: object, group: tuple[int, int] | None) -> None:
    """A memory snapshot is of one device: refuse a device or memory_budget per rank outside a torchrun job
    (where each rank takes its own)."""
    listed = _listed(_per_rank(device), options.memory_budgets(memory_budget))
    if listed is not None and group is None:
        raise BadInput("{memory_snapshot} is for one device, and a {device} or {memory_budget} per rank "
                       f"({listed} given) names several", field="memory_snapshot",
                       fix="take each device's snapshot with its own call (one device, one budget)")


def probe_request(probe: object = None, *, device: object = options.DEVICE, memory_budget: object = None,
                  margin: object = options.MARGIN, max_batch: object = options.MAX_BATCH,
                  data_parallel: bool | None = None, parallel: object = options.DEFAULT_PARALLEL,
                  fsdp_sync: object = options.DEFAULT_FSDP_SYNC, world_size: int | None = None,
                  precision: object = "fp32", env: Mapping[str, str] | None = None,
                  group: tuple[int, int] | None = None) -> ProbeRequest:
    """The request :func:`autotune.probe` makes of its arguments (see there), every one checked here, once.

    ``group``: (world size, rank) inside a process group; ``env``: where ``$WORLD_SIZE`` is read."""
    mine, budget = this_rank(device, memory_budget, group)
    world, _ = world_of(world_size, os.environ if env is None else env, group)
    parallel, sync = options.parallel(parallel), _fsdp_sync(fsdp_sync, parallel)
    data_parallel = options.boolean(data_parallel, "data_parallel", none=True)
    buckets = data_parallel if data_parallel is not None else (group is not None or world > 1)
    return ProbeRequest(workload=probe_spec(probe), device=device_name(mine), memory_budget=budget,
                        margin=options.margin(margin, text=False),
                        max_batch=options.whole(max_batch, "max_batch", text=False),
                        rule=FitRule.of(parallel, world, rank=group[1] if group else 0, buckets=buckets,
                                        fsdp_sync=sync),
                        precision=options.precision(precision))


def _fsdp_sync(value: object, parallel: object) -> str:
    """``fsdp_sync`` checked: a choice, and one that only FSDP takes."""
    sync = options.fsdp_sync(value)
    if sync != options.DEFAULT_FSDP_SYNC and parallel != "fsdp":
        raise BadInput("is FSDP's gradient sync and {parallel} " + f"is {parallel}", field="fsdp_sync", value=sync,
                       fix="add {parallel='fsdp'}, or drop {fsdp_sync}")
    return sync


def plan_request(target_batch: object, *, probe: object = None, device: object = options.DEVICE,
                 memory_budget: object = None, margin: object = options.MARGIN, world_size: int | None = None,
                 multiple_of: object = 1, uniform: object = None, uniform_ranks: bool = False,
                 parallel: object = options.DEFAULT_PARALLEL, fsdp_sync: object = options.DEFAULT_FSDP_SYNC,
                 tune: bool = False, trials: object = options.TRIALS,
                 storage: str | None = None, study_name: str | None = None, memory_snapshot: object = None,
                 at: object = None, precision: object = "fp32", search_settings: bool = False,
                 allow: object = None, env: Mapping[str, str] | None = None,
                 group: tuple[int, int] | None = None) -> PlanRequest:
    """The request :func:`autotune.plan` makes of its arguments (see there), every one checked here, once:
    a target no plan can hold, a storage that cannot open, settings that exclude each other, all before
    any probe."""
    target = options.whole(target_batch, "target_batch", example="1024", text=False)
    uniform = options.uniform(uniform)
    uniform_ranks, tune = options.boolean(uniform_ranks, "uniform_ranks"), options.boolean(tune, "tune")
    devices, budgets = _per_rank(device), options.memory_budgets(memory_budget)
    listed = _listed(devices, budgets)
    world, source = world_of(world_size, os.environ if env is None else env, group, listed)
    multiple = options.whole(multiple_of, "multiple_of", text=False)
    check_plan(target, target, world_size=world, multiple_of=multiple)
    parallel = options.parallel(parallel)
    tuning = _tuning(tune, trials, storage, study_name, parallel, listed, group)
    snapshot = Snapshot.of(memory_snapshot, at)
    if snapshot is not None and (tuning is not None or listed is not None):
        drop = "{tune}" if tuning is not None else "the {device} or {memory_budget} per rank"
        raise BadInput("{memory_snapshot} is for a plan of one device made without {tune=True}",
                       field="memory_snapshot", fix=f"drop {drop} or the snapshot")
    per_rank = math.ceil(target / world)
    mine, budget = this_rank(device, memory_budget, group) if listed is None or group is not None else \
        (devices[0], budgets[0])
    one = probe_request(probe, device=mine, memory_budget=budget, margin=margin, max_batch=per_rank,
                        parallel=parallel, fsdp_sync=fsdp_sync, world_size=world, precision=precision, env={},
                        group=group)
    ranks: tuple[ProbeRequest, ...] = ()
    if listed is not None and group is None:  # a job of ranks that differ, planned from this one process
        limit = per_rank if uniform_ranks else max(1, target - (world - 1) * multiple)
        ranks = tuple(replace(one, device=device_name(devices[r % len(devices)]),
                              memory_budget=budgets[r % len(budgets)], max_batch=limit,
                              rule=replace(one.rule, rank=r, buckets=not one.rule.sharded)) for r in range(world))
    search_settings = options.boolean(search_settings, "search_settings")
    if search_settings and tuning is not None:
        raise BadInput("{search_settings} and {tune} each choose how to run", field="search_settings",
                       fix="give one of them")
    return searched(PlanRequest(target_batch=target, probe=one, ranks=ranks, multiple_of=multiple,
                                uniform=uniform, uniform_ranks=bool(uniform_ranks), world_size_source=source,
                                tuning=tuning, snapshot=snapshot), search_settings, allow)


def _tuning(tune: bool, trials: object, storage: str | None, study_name: str | None, parallel: str,
            listed: int | None, group: tuple[int, int] | None) -> Tuning | None:
    """``--tune``'s settings, or None; BadInput for settings it cannot take."""
    trials = options.whole(trials, "trials", text=False)
    if not tune:
        for name, value in (("storage", storage), ("study_name", study_name)):
            if value is not None:
                raise BadInput(mention(name) + " needs {tune=True}", field=name,
                               fix="add {tune=True}, or drop " + mention(name))
        return None
    if parallel == "fsdp":
        raise BadInput("tuning times one process and cannot shard it", field="tune",
                       fix="plan with {parallel='fsdp'} without {tune=True}")
    if listed is not None:
        raise BadInput("tuning times one device", field="tune",
                       fix="tune without a {device} or {memory_budget} per rank")
    if group is not None:
        raise BadInput("tuning times one process", field="tune",
                       fix="tune without torchrun, with " + mention("world_size", group[0]))
    check_storage(storage)
    return Tuning(trials=trials, storage=storage, study_name=study_name)
