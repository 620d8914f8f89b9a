"""What a probe and a plan are asked for: one request, built once, that every stage takes.

The command line, :func:`autotune.probe` / :func:`autotune.plan` and ``autotune serve``'s request body
each build a :class:`ProbeRequest` (inside a :class:`PlanRequest` for a plan) and hand it on: the probe
runs its fit rule as the request's :class:`FitRule` says, the plan store's fingerprint hashes it, the
service's workers receive it as JSON. Every field is checked when a request is made (the rules of
:mod:`autotune.options`, once), so no stage checks them again.

A request names what it probes (a probe spec, a device name, sizes in bytes); a Workload or a Device
object given to the API travels beside it, and the request then says what it was (``workload=None``,
the device's own name).

No torch here: the service's server process builds requests without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from .. import options
from ..errors import BadInput
from .record import Count, Margin, Record, Rule, Whole, one_of
from .search import SettingsAsk

#: How a plan may split the target: None the fewest steps (uneven micro-batches where they must be), True equal
#: micro-batches within twice the fewest steps, "force" equal micro-batches however many steps they take.
Uniform = Literal[True, "force"] | None


@dataclass(frozen=True, kw_only=True)
class FitRule(Record):
    """What the fit rule holds besides one process's model: DDP's gradient buckets, or FSDP's sharding.

    ``parallel``: "ddp" (every rank holds the whole model; with ``buckets`` the fit rule also holds one
    gradient-sized bucket, as DDP does for world sizes above 1) or "fsdp" (the model sharded over
    ``world_size`` ranks with ``fully_shard``, measured as rank ``rank``). ``fsdp_sync``: when FSDP
    reduce-scatters the gradients, after "every" micro-step or at the "last" one only ("auto": the one giving
    the larger micro-batch). ``offload``: under FSDP, the sharded parameters, gradients and optimizer state live
    on the host (FSDP2's ``CPUOffloadPolicy``), and the device holds only what is copied in for each unit.

    This is the fit rule's one record. Where it shards, :class:`autotune.probing.fsdp.Sharding` (made by
    ``Sharding.of(rule)``) is its runtime part, which needs torch: results stay torch-free.
    """

    parallel: Annotated[options.Parallel, one_of(options.PARALLEL)] = options.DEFAULT_PARALLEL
    world_size: Whole = 1
    rank: Count = 0
    buckets: Annotated[bool, Rule(options.boolean)] = False
    fsdp_sync: Annotated[options.FsdpSync, one_of(options.FSDP_SYNCS)] = options.DEFAULT_FSDP_SYNC
    offload: Annotated[bool, Rule(options.boolean)] = False

    def validate(self) -> None:
        if self.rank >= self.world_size:
            raise BadInput("must be below {world_size} " + str(self.world_size), field="rank", value=self.rank,
                           limit=self.world_size - 1)
        if self.parallel == "fsdp" and self.buckets:
            raise BadInput("buckets are DDP's: a fit rule for fsdp holds none", field="buckets")
        if self.parallel != "fsdp" and self.fsdp_sync != options.DEFAULT_FSDP_SYNC:
            raise BadInput("is FSDP's gradient sync", field="fsdp_sync", value=self.fsdp_sync,
                           fix="add {parallel='fsdp'}, or drop it")
        if self.parallel != "fsdp" and self.offload:
            raise BadInput("is FSDP's CPU offload", field="offload", value=True,
                           fix="add {parallel='fsdp'}, or drop it")

    @classmethod
    def of(cls, parallel: str, world_size: int, *, rank: int = 0, buckets: bool | None = None,
           fsdp_sync: str = options.DEFAULT_FSDP_SYNC, offload: bool = False) -> FitRule:
        """The fit rule of ``world_size`` ranks: DDP holds its buckets when there are several (or as
        ``buckets`` says), FSDP shards over them, its gradient sync as ``fsdp_sync`` says, its sharded state on
        the host with ``offload``."""
        if parallel != "ddp":
            buckets = False
        elif buckets is None:
            buckets = world_size > 1
        return cls(parallel=options.parallel(parallel), world_size=world_size, rank=rank, buckets=bool(buckets),
                   fsdp_sync=options.fsdp_sync(fsdp_sync), offload=offload)

    @property
    def sharded(self) -> bool:
        return self.parallel == "fsdp"


@dataclass(frozen=True, kw_only=True)
class ProbeRequest(Record):
    """A probe: the largest micro-batch of ``workload`` that fits ``device`` by the fit rule.

    ``workload``: a probe spec that loads again from anywhere (a built-in name, an absolute ``.py`` path,
    ``package.module``, each with an optional ``:function``), or None for a Workload object given to the
    API. ``device``: a device name (``cpu``, ``cuda:0``, ``estimate:H100-80GB``; ``auto`` is resolved
    before a request is made). ``memory_budget``: bytes, or None for the device's own memory.
    ``max_batch``: the largest micro-batch worth trying (a plan never needs more than its per-rank target).
    """

    workload: Annotated[str | None, Rule(options.text)] = None
    device: Annotated[str, Rule(options.text)] = "cpu"
    memory_budget: Annotated[int | None, Rule(options.memory_budget)] = None
    margin: Margin = options.MARGIN
    max_batch: Whole = options.MAX_BATCH
    rule: FitRule = FitRule()
    precision: Annotated[options.Precision, one_of(options.PRECISIONS)] = "fp32"

    def with_rule(self, **changes: Any) -> ProbeRequest:
        """This request with its fit rule changed (``rank=1``, ``buckets=True``...)."""
        return replace(self, rule=replace(self.rule, **changes))


@dataclass(frozen=True, kw_only=True)
class Snapshot(Record):
    """A memory snapshot asked for beside a probe: the fit rule's allocation trace at ``at`` (default the
    probe's max, or the plan's micro-batch) written to ``path`` (None: only the explanation in the result)."""

    path: Annotated[str | None, Rule(options.snapshot_path)] = None
    at: Annotated[int | None, Rule(options.whole, text=False)] = None

    @classmethod
    def of(cls, memory_snapshot: object, at: object = None) -> Snapshot | None:
        """The API's ``memory_snapshot`` (a path, True for none, None or False for no snapshot) and ``at``."""
        if memory_snapshot is None or memory_snapshot is False:  # '' is refused below, as the CLI refuses it
            if at is not None:
                raise BadInput("{at} is where a memory snapshot is taken", field="at",
                               fix="give {memory_snapshot} too, or drop {at}")
            return None
        return cls(path=options.snapshot_path(memory_snapshot),
                   at=options.whole(at, "at", text=False) if at is not None else None)


@dataclass(frozen=True, kw_only=True)
class Tuning(Record):
    """``--tune``: an optuna study of ``trials`` throughput measurements, kept in ``storage`` under
    ``study_name`` (optuna's own names) when given."""

    trials: Whole = options.TRIALS
    storage: str | None = None
    study_name: str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanRequest(Record):
    """A plan: ``target_batch`` samples per optimizer step over ``probe.rule.world_size`` ranks, exactly.

    ``probe``: the probe of one rank (its ``max_batch`` is the per-rank target). ``ranks``: one probe per
    rank when the ranks' devices or budgets differ (a device list), else empty. ``uniform``: see
    :data:`Uniform`. ``uniform_ranks``: every rank at the smallest rank's max micro-batch instead of each
    its own. ``world_size_source``: where the world size came from (the process group, the flag,
    ``$WORLD_SIZE``, the device list), for the plan's notes.
    """

    target_batch: Annotated[int, Rule(options.whole, text=False, example="1024")]
    probe: ProbeRequest
    ranks: tuple[ProbeRequest, ...] = ()
    multiple_of: Whole = 1
    uniform: Annotated[bool | Literal["force"] | None, Rule(options.uniform)] = None
    uniform_ranks: Annotated[bool, Rule(options.boolean)] = False
    world_size_source: str = "default"
    tuning: Tuning | None = None
    snapshot: Snapshot | None = None
    search: SettingsAsk | None = None  # a settings search (autotune.probing.settings)

    def validate(self) -> None:
        if self.ranks and len(self.ranks) != self.probe.rule.world_size:
            world = self.probe.rule.world_size
            raise BadInput("{ranks} " + f"lists {len(self.ranks)} probes for " + "{world_size} " + str(world),
                           field="ranks", limit=world)

    @property
    def world_size(self) -> int:
        return self.probe.rule.world_size

