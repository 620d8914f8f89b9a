"""The public API: probe a workload on a device, plan, (tune), run, for the command line and for programs.

Every function takes what the command line takes (a probe spec such as "mlp"
or "model.py:build", a device name, a size string such as "8GiB") as well as
objects (a Workload, a Device), and checks every argument with autotune's
errors, which name the parameter.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from . import log, options
from .devices import Device, get_device
from .errors import BadInput
from .probing.fsdp import FsdpRule
from .results.probe import ProbeResult
from .store import cached
from .training import distributed
from .units import plural
from .workload import DEFAULT_PROBE, Workload, load_workload

if TYPE_CHECKING:
    from .planning.planner import Uniform
    from .results.plan import Plan
    from .results.run import RunResult
    from .store import Store

Spec = Workload | str | None
StoreSpec: TypeAlias = "Store | str | Literal[False] | None"
#: The plan store used when none is given.
STORE_VARIABLE = "AUTOTUNE_STORE"


def resolve(workload: Spec, device: Device | str, memory_budget: Any) -> tuple[Workload, Device]:
    """Turn names into objects; device errors come before the workload is built.

    Under torchrun, ``auto`` is this rank's own GPU (LOCAL_RANK), else the CPU.
    """
    budget = options.memory_budget(memory_budget)
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


def probe(workload: Spec = None, *, device: Device | str = options.DEVICE, memory_budget: int | str | None = None,
          margin: float = options.MARGIN, max_batch: int = options.MAX_BATCH,
          data_parallel: bool | None = None, parallel: str = options.DEFAULT_PARALLEL,
          world_size: int | None = None, store: StoreSpec = None) -> ProbeResult:
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
    """
    margin = options.margin(margin)
    max_batch = options.whole(max_batch, "max_batch")
    parallel = options.parallel(parallel)
    if world_size is not None:
        world_size = options.whole(world_size, "world_size")
    world, _ = _world_size(world_size, None)
    kept = _open_store(store)
    wl, dev = resolve(workload, device, memory_budget)
    log.progress(f"probing {wl.name} on {dev.describe().summary}" +
                 (f" (FSDP over {plural(world, 'rank')})" if parallel == "fsdp" else ""))
    sharding = FsdpRule(world, distributed.rank()) if parallel == "fsdp" else None
    if sharding is not None:
        data_parallel = False
    elif data_parallel is None:
        data_parallel = distributed.active() or (world_size or 1) > 1
    rule: dict[str, Any] = {"data_parallel": bool(data_parallel)} if sharding is None else {"sharding": sharding}
    result = cached.probe(kept, wl, dev, margin=margin, max_batch=max_batch, world_size=world, rule=rule,
                          parallel=parallel)  # finder.probe, through the store when there is one
    if distributed.active():
        result = agree_across_ranks(result)
    return replace(result, source=_source(workload))


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
         parallel: str = options.DEFAULT_PARALLEL, store: StoreSpec = None) -> Plan:
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
    """
    from .planning.planner import UNIFORM, check_plan
    from .planning.probed import measured_or_assumed, plan_probed

    target_batch = options.whole(target_batch, "target_batch", example="1024")
    margin = options.margin(margin)
    multiple_of = options.whole(multiple_of, "multiple_of")
    trials = options.whole(trials, "trials")
    parallel = options.parallel(parallel)
    if world_size is not None:
        world_size = options.whole(world_size, "world_size")
    if uniform not in UNIFORM:
        raise BadInput(f"uniform {uniform!r} must be True, False, None or 'force'")
    world, source = _world_size(world_size, env)
    # Reject a target that can never be planned, or a storage that cannot open, before a probe.
    check_plan(target_batch, max(1, target_batch), world_size=world, multiple_of=multiple_of)
    if not tune and (storage is not None or study_name is not None):
        raise BadInput("storage and study_name are for tune=True: pass tune=True, or leave them out")
    per_rank = math.ceil(target_batch / world)
    if tune and parallel == "fsdp":
        raise BadInput("tuning times one process and cannot shard it: plan with parallel fsdp without tune=True")
    kept = _open_store(store)
    if tune:
        from .training.study import check_storage
        from .training.tune import tune as run_tune

        check_storage(storage)
        if distributed.active():
            raise BadInput("tuning times one process: tune without torchrun, with "
                           f"world_size={world}")
        wl, dev = resolve(workload, device, memory_budget)
        if kept is not None:
            log.progress("the plan store is not used with tune=True: tuning measures throughput here")
        tuned = run_tune(wl, dev, target_batch, world_size=world, multiple_of=multiple_of, uniform=uniform,
                         margin=margin, trials=trials, storage=storage, study_name=study_name,
                         world_size_source=source)
        assert tuned.probe is not None
        return replace(tuned, probe=replace(tuned.probe, source=_source(workload)),
                       notes=tuned.notes + measured_or_assumed(tuned.probe, world, source))
    result = probe(workload, device=device, memory_budget=memory_budget, margin=margin, max_batch=per_rank,
                   data_parallel=world > 1, parallel=parallel, world_size=world,
                   store=kept if kept is not None else False)
    made = plan_probed(target_batch, result, world_size=world, world_size_source=source, multiple_of=multiple_of,
                       uniform=uniform)
    if kept is not None and result.fingerprint is not None:
        kept.put(result.fingerprint, plan=made)  # kept beside its probe
    return made


def _world_size(flag: int | None, env: dict[str, str] | None) -> tuple[int, str]:
    """The process group's world size when there is one; else --world-size, $WORLD_SIZE, 1."""
    from .planning.planner import world_size_from

    if distributed.active():
        world = distributed.world_size()
        if flag is not None and flag != world:
            raise BadInput(f"world_size {flag} but the process group has {plural(world, 'rank')}: drop world_size "
                           f"or launch {flag} processes")
        return world, "process group"
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
        max_norm: float | None = None, parallel: str | None = None, store: StoreSpec = None) -> RunResult:
    """Plan (or load a plan), then train by it and verify: the API behind ``autotune run``.

    ``parallel``: "ddp" or "fsdp" when planning now (default "ddp"); a plan
    given says how it runs itself, and ``parallel``, if given, must agree.
    ``store``: the plan store, as for :func:`probe`; what the run measured is recorded there.
    """
    from .training.runner import run_plan

    steps = options.whole(steps, "steps")
    if parallel is not None:
        parallel = options.parallel(parallel)
    precision = options.precision(precision)
    max_norm = options.max_norm(max_norm)
    if (plan is None) == (target_batch is None):
        raise BadInput("give either plan (a Plan or its JSON file) or target_batch (to plan first), not both")
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
        if memory_budget is None and probed is not None and probed.device.budget_bytes is not None:
            memory_budget = probed.device.budget_bytes  # run under the budget the plan was made for
    kept = _open_store(store)
    wl, dev = resolve(workload, device, memory_budget)
    if dev.estimated:
        raise BadInput("autotune run trains for real: give a real device (cpu or cuda:N), not estimate")
    if plan is None:
        assert target_batch is not None
        plan = _probe_and_plan(target_batch, workload=wl, device=dev, margin=margin, world_size=world_size,
                               multiple_of=multiple_of, uniform=uniform,
                               parallel=parallel or options.DEFAULT_PARALLEL,
                               store=kept if kept is not None else False)
    planned = plan

    def train() -> RunResult:
        return run_plan(planned, wl, dev, steps=steps, verify=verify, precision=precision, max_norm=max_norm)

    if kept is None:
        return train()
    return cached.record_run(kept, planned, wl, dev, precision, train)
