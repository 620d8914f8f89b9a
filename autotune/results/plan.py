"""Plan: how to run one optimizer step of exactly the target batch, as the planner made it.

No torch here: the planner, the reports and the runner all read plans.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Annotated, Any

from ..errors import ResultFileError
from ..options import MAX_MICRO_BATCHES, MAX_TARGET_BATCH, PARALLEL, Parallel
from ..units import format_bytes, format_margin
from ..units import plural as _plural
from .probe import FSDP_CHOICE, ProbeResult
from .ranks import MixedRanks
from .record import Record, Whole, derived, one_of
from .search import SettingRow, TrainSetting
from .tokens import TokenSteps
from .tuning import Tuning


@dataclass(frozen=True, kw_only=True)
class Plan(Record):
    """How to run one optimizer step of exactly ``target_batch`` samples.

    ``schedule[r][i]`` is the micro-batch of rank ``r`` at micro-step ``i``;
    every rank runs ``accumulation_steps`` micro-steps, unless the plan is for
    ranks that differ (``mixed``): each rank then runs its own number, at most
    ``accumulation_steps``, with micro-batches of at most its own max
    (``mixed.ranks[r]``). ``micro_batch`` is the largest size in the schedule,
    ``uniform`` True when all sizes are equal. In a mixed plan's JSON,
    ``micro_batch``, ``accumulation_steps``, ``predicted_peak_bytes`` and
    ``headroom_bytes`` are null, since no one figure holds for every rank
    (``micro_batch x accumulation_steps x world_size`` is not the target there):
    each rank's are its row of ``schedule``, ``per_rank_batch`` and
    ``mixed.ranks[r]`` (``peak_bytes``, ``headroom_bytes``). A file that holds
    them, as older versions wrote, reads the same.
    ``world_size_source`` says where ``world_size`` came from ("flag",
    "WORLD_SIZE", "process group", "the device list", "default", "assumed"). ``tuning`` is what
    the throughput tuner measured, when it chose this plan; ``setting`` the setting a settings search chose
    (its ``settings``: every one tried, best first). ``parallel``: how
    the ranks share the model, "ddp" (each holds all of it) or "fsdp"
    (``fully_shard``; its probe then sharded over exactly ``world_size`` ranks).
    """

    KIND = "Plan"

    target_batch: Whole
    world_size: Whole
    world_size_source: str = "default"
    parallel: Annotated[Parallel, one_of(PARALLEL)] = "ddp"
    micro_batch: Whole
    accumulation_steps: Whole
    multiple_of: Whole = 1
    max_micro_batch: Whole
    uniform: bool
    schedule: tuple[tuple[int, ...], ...]
    notes: tuple[str, ...] = ()
    tuning: Tuning | None = None
    mixed: MixedRanks | None = None
    probe: ProbeResult | None = None
    tokens: TokenSteps | None = None
    setting: TrainSetting | None = None
    settings: tuple[SettingRow, ...] = ()

    def validate(self) -> None:
        # Every pass over all sizes is a C-level set/map/sum; the per-size checks see distinct sizes only.
        schedule = tuple(map(tuple, self.schedule))
        object.__setattr__(self, "schedule", schedule)
        if set(map(type, chain.from_iterable(schedule))) - {int}:
            bad = sorted({repr(b) for b in chain.from_iterable(schedule) if type(b) is not int})
            raise ValueError(f"schedule sizes must be integers, got {', '.join(bad)}")
        if self.target_batch > MAX_TARGET_BATCH:
            raise ValueError(f"target_batch {self.target_batch} is more than {MAX_TARGET_BATCH:,}")
        if self.world_size * self.accumulation_steps > MAX_MICRO_BATCHES:
            raise ValueError(f"world_size x accumulation_steps = {self.world_size * self.accumulation_steps:,} "
                             f"micro-batches is more than {MAX_MICRO_BATCHES:,}")
        if len(schedule) != self.world_size:
            raise ValueError(f"schedule has {len(schedule)} ranks, world_size is {self.world_size}")
        lengths = set(map(len, schedule))
        if self.mixed is None and lengths != {self.accumulation_steps}:
            raise ValueError(f"every rank must run accumulation_steps={self.accumulation_steps} micro-steps, "
                             f"got {sorted(lengths)}")
        if self.mixed is not None:
            self._check_mixed(schedule, lengths)
        sizes = set(chain.from_iterable(set(schedule)))
        if any(not 1 <= b <= self.max_micro_batch or b % self.multiple_of for b in sizes):
            raise ValueError(f"every micro-batch must be in [1, {self.max_micro_batch}] and a multiple of "
                             f"{self.multiple_of}, got {sorted(sizes)}")
        total = sum(map(sum, schedule))
        if total != self.target_batch:
            raise ValueError(f"schedule sums to {total}, not the target {self.target_batch}")
        if self.micro_batch != max(sizes):
            raise ValueError(f"micro_batch {self.micro_batch} is not the largest size {max(sizes)}")
        if self.uniform != (len(sizes) == 1):
            raise ValueError(f"uniform={self.uniform} but the sizes are {sorted(sizes)}")
        if not isinstance(self.world_size_source, str):
            raise ValueError(f"world_size_source must be a string, got {self.world_size_source!r}")
        probed = self.probe.parallel if self.probe is not None else self.parallel
        if probed != self.parallel:
            raise ValueError(f"a plan for {self.parallel} needs a probe made for {self.parallel}, not {probed}")
        if self.parallel == "fsdp" and self.probe is not None and self.probe.world_size != self.world_size:
            raise ValueError(f"the FSDP probe sharded over {self.probe.world_size} ranks, the plan has "
                             f"{self.world_size}: probe again for world_size={self.world_size}")

    def _check_mixed(self, schedule: tuple[tuple[int, ...], ...], lengths: set[int]) -> None:
        assert self.mixed is not None
        if min(lengths) < 1 or max(lengths) != self.accumulation_steps:
            raise ValueError(f"every rank must run at least 1 and at most accumulation_steps="
                             f"{self.accumulation_steps} micro-steps, the most of them that many; "
                             f"got {sorted(lengths)}")
        if len(self.mixed.ranks) != self.world_size:
            raise ValueError(f"mixed has {len(self.mixed.ranks)} ranks, world_size is {self.world_size}")
        for r, (row, share) in enumerate(zip(schedule, self.mixed.ranks)):
            if max(row) > share.max_micro_batch:
                raise ValueError(f"rank {r}'s micro-batch {max(row)} is above its max micro-batch "
                                 f"{share.max_micro_batch}")
        if self.max_micro_batch != max(share.max_micro_batch for share in self.mixed.ranks):
            raise ValueError(f"max_micro_batch {self.max_micro_batch} is not the largest rank's max "
                             f"{max(share.max_micro_batch for share in self.mixed.ranks)}")

    def usable_bytes_of(self, rank: int) -> int | None:
        """The usable memory rank ``rank`` is held to: its own in a mixed plan, else the probe's (None without one)."""
        if self.mixed is not None:
            return self.mixed.ranks[rank].usable_bytes
        return None if self.probe is None else self.probe.usable_bytes

    def predicted_peak_of(self, rank: int) -> int | None:
        """The predicted peak of rank ``rank`` at its largest micro-batch: its own in a mixed plan."""
        if self.mixed is not None:
            return self.mixed.ranks[rank].peak_bytes
        return self.predicted_peak_bytes

    def budget_bytes_of(self, rank: int) -> int | None:
        """The memory budget rank ``rank`` was planned under (a run keeps to it), None when its device's own memory."""
        if self.mixed is not None:
            return self.mixed.ranks[rank].budget_bytes
        return None if self.probe is None else self.probe.device.budget_bytes

    @property
    def fsdp_sync(self) -> str | None:
        """Under FSDP, when the gradients are reduce-scattered: after "every" micro-step or at the "last" one, as
        the probe measured it ("last" for a plan whose probe does not say); None under DDP."""
        if self.parallel != "fsdp":
            return None
        return (self.probe.fsdp_sync if self.probe is not None else None) or "last"

    @property
    @derived(after="target_batch")
    def target_tokens(self) -> int | None:
        """Tokens per optimizer step, when the plan was asked for in tokens (``tokens``); else None."""
        return None if self.tokens is None else self.tokens.target_tokens

    @property
    @derived(after="schedule")
    def per_rank_batch(self) -> tuple[int, ...]:
        """Samples each rank sees per optimizer step."""
        return tuple(map(sum, self.schedule))

    @property
    @derived(after="schedule")
    def arithmetic(self) -> str:
        """One line a person checks by hand: ``1024 = 256 x 4 steps x 1 rank``, or for uneven
        sizes ``1021 = 3 x 255 + 1 x 256 over 4 steps x 1 rank`` (count x size); for mixed ranks
        each rank's samples, ``1024 = 928 + 96 over 2 ranks, ...``."""
        if self.mixed is not None:
            shares = self.per_rank_batch
            terms = " + ".join(map(str, shares[:8])) + (" + ..." if len(shares) > 8 else "")
            return (f"{self.target_batch} = {terms} over {_plural(self.world_size, 'rank')}, each its own micro-batch "
                    f"and micro-steps (at most {self.accumulation_steps})")
        counts = Counter(chain.from_iterable(self.schedule))
        return arithmetic_line(self.target_batch, self.world_size, self.accumulation_steps, counts)

    @property
    @derived(after="schedule")
    def predicted_peak_bytes(self) -> int | None:
        """Peak memory at ``micro_batch``: measured when the probe confirmed that very size,
        else the probe's estimate; None without a probe, and in a mixed plan, whose ranks each have
        their own (:meth:`predicted_peak_of`, ``mixed.ranks[r].peak_bytes``)."""
        if self.mixed is not None:
            return None
        return None if self.probe is None else peak_at(self.probe, self.micro_batch)

    @property
    @derived(after="schedule")
    def headroom_bytes(self) -> int | None:
        """Usable memory less :attr:`predicted_peak_bytes`; None where that is (a mixed plan: see
        ``mixed.ranks[r].headroom_bytes``)."""
        peak = self.predicted_peak_bytes
        usable = self.usable_bytes_of(0)
        return None if peak is None or usable is None else usable - peak

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON data; in a mixed plan ``micro_batch`` and ``accumulation_steps`` are null (see the
        class)."""
        data = super().to_dict()
        if self.mixed is not None:
            data["micro_batch"] = data["accumulation_steps"] = None
        return data

    def summary(self) -> str:
        lines = [f"plan: {self.arithmetic}"]
        if self.parallel == "fsdp":
            sync = "after every micro-step" if self.fsdp_sync == "every" else "at the last micro-step"
            lines.append(f"FSDP: the model sharded over {_plural(self.world_size, 'rank')} (fully_shard), gradients "
                         f"reduce-scattered {sync}")
            lines.extend(f"  {n}" for n in (self.probe.notes if self.probe else ()) if n.startswith(FSDP_CHOICE))
        if self.world_size_source != "default":
            where = {"flag": "the world size given", "WORLD_SIZE": "$WORLD_SIZE"}.get(
                self.world_size_source, self.world_size_source)
            lines.append(f"world size {self.world_size} from {where}")
        if self.accumulation_steps == 1:
            lines.append("k = 1: the whole per-rank batch fits, no accumulation")
        if self.mixed is not None:
            lines.extend(self.mixed.lines(self.schedule))
        elif self.probe is not None:
            lines.extend(self._memory_lines(self.probe))
        lines.extend(self.notes)
        return "\n".join(lines)

    def _memory_lines(self, probe: ProbeResult) -> list[str]:
        status = "estimated, not confirmed on a real device" if probe.estimated else "confirmed by a real run"
        device = probe.device.summary
        peak = "reserved peak" if probe.allocated_peak_bytes is not None else "peak"
        lines = [
            f"memory: {peak} {format_bytes(self.predicted_peak_bytes)} of {format_bytes(probe.usable_bytes)} usable "
            f"at micro-batch {self.micro_batch}, headroom {format_bytes(self.headroom_bytes)} "
            f"(margin {format_margin(probe.margin)})",
            f"probed: {probe.workload} on {device}; max micro-batch {probe.max_micro_batch} ({status})",
        ]
        allocator = probe.allocator_line()
        if allocator is not None:
            lines.append(f"at micro-batch {probe.max_micro_batch}, {allocator}")
        return lines

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "data", kind: str | None = None, where: str = "") -> Plan:
        """The plan ``to_dict`` wrote; one whose schedule passes its probe's max is refused unless planned so."""
        plan = super().from_dict(_mixed_figures(data), source=source)
        probed = plan.probe.max_micro_batch if plan.probe is not None and plan.mixed is None else None
        on_purpose = probed is not None and above_probe_note(plan.max_micro_batch, probed) in plan.notes
        if probed is not None and plan.micro_batch > probed and not on_purpose:
            raise ResultFileError(
                f"{source}: micro-batch {plan.micro_batch} in the schedule is above the {probed} its probe found "
                f"to fit: plan again (autotune plan --output), or keep every micro-batch at most {probed}")
        return plan


def _mixed_figures(data: Any) -> Any:
    """A mixed plan's JSON with the null ``micro_batch`` and ``accumulation_steps`` that ``to_dict`` writes taken
    from its schedule (the largest micro-batch, the most micro-steps), as the Plan holds them; anything else as
    it is (a schedule that is not a list of lists of numbers is then refused, naming it)."""
    if not isinstance(data, dict) or data.get("mixed") is None:
        return data
    missing = [k for k in ("micro_batch", "accumulation_steps") if k in data and data[k] is None]
    if not missing:
        return data
    try:
        rows = data["schedule"]
        figures = {"micro_batch": max(max(row) for row in rows), "accumulation_steps": max(map(len, rows))}
    except (KeyError, TypeError, ValueError):
        return data
    return {**data, **{k: figures[k] for k in missing}}


def peak_at(probe: ProbeResult, batch: int) -> int | None:
    """The probe's peak at micro-batch ``batch``: measured when it confirmed that very size, else its estimate."""
    at_max = batch == probe.max_micro_batch
    if at_max and not probe.estimated:
        return probe.peak_bytes
    predicted = probe.predicted_peak_at(batch)
    return probe.peak_bytes if predicted is None and at_max else predicted


def arithmetic_line(target: int, world: int, steps: int, counts: Mapping[int, int]) -> str:
    """``1024 = 256 x 4 steps x 1 rank``, or ``1021 = 3 x 255 + 1 x 256 over 4 steps x 1 rank``
    for ``counts`` {size: how many micro-batches of it}."""
    step_text, ranks = _plural(steps, "step"), _plural(world, "rank")
    if len(counts) == 1:
        return f"{target} = {next(iter(counts))} x {step_text} x {ranks}"
    terms = " + ".join(f"{count} x {size}" for size, count in sorted(counts.items()))
    return f"{target} = {terms} over {step_text} x {ranks}"


def above_probe_note(m: int, probed: int) -> str:
    """The note of a plan made on purpose for a max micro-batch above the probe's (``Plan.from_dict`` looks for it)."""
    return f"max micro-batch {m} is above the probed {probed}: it may not fit"
