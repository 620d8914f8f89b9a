"""A settings search: the settings tried (DDP or FSDP, checkpointing, allocator, and what the user allows),
each one's max micro-batch by estimate, its predicted time per optimizer step, and why it won or lost.

No torch here: plans carry these, and the service reads plans.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, TypeVar

from .. import options
from ..errors import BadInput
from .record import Count, Record, Rule, Whole, one_of

#: Settings that change what is computed, which join the search only when named in ``allow``.
ALLOWED = ("bf16-mixed", "bf16", "lora")
R = TypeVar("R")


def allow_list(value: object, name: str = "allow") -> tuple[str, ...]:
    """``--allow bf16-mixed,lora`` as a tuple of known names (each once, in the order of :data:`ALLOWED`)."""
    if value is None or value == "":
        return ()
    parts = value.split(",") if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    given = {str(p).strip().lower() for p in parts if str(p).strip()}
    unknown = sorted(given - set(ALLOWED))
    if unknown:
        raise BadInput("is not a setting the search can allow", field=name, value=", ".join(unknown),
                       choices=ALLOWED, fix="e.g. {allow='bf16-mixed,lora'}")
    return tuple(a for a in ALLOWED if a in given)


@dataclass(frozen=True, kw_only=True)
class TrainSetting(Record):
    """One way to run the same training: how the ranks share the model (``parallel``, FSDP's gradient
    ``fsdp_sync``), which repeated blocks (``blocks``, a module pattern such as ``blocks.*``) run under
    activation checkpointing, every ``checkpoint_every``-th of them (0: none), the allocator setting added to
    ``PYTORCH_CUDA_ALLOC_CONF``, under FSDP whether ``offload`` keeps the sharded parameters, gradients and
    optimizer state on the host (FSDP2's ``CPUOffloadPolicy``: the optimizer steps on the CPU), and the
    number-changing ``changes`` the user allowed (``bf16``: bf16 weights; ``bf16-mixed``: autocast in the run;
    ``lora``: LoRA adapters on frozen weights)."""

    parallel: Annotated[options.Parallel, one_of(options.PARALLEL)] = options.DEFAULT_PARALLEL
    fsdp_sync: str | None = None
    blocks: str | None = None
    checkpoint_every: Count = 0
    allocator: str = ""
    offload: bool = False
    changes: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.checkpoint_every and not self.blocks:
            raise ValueError("checkpoint_every needs blocks: the modules checkpointed")
        if (self.fsdp_sync is not None) != (self.parallel == "fsdp"):
            raise ValueError(f"fsdp_sync {self.fsdp_sync} is for parallel fsdp only (and fsdp needs one)")
        if self.offload and self.parallel != "fsdp":
            raise ValueError("offload is FSDP's CPU offload: it needs parallel fsdp")
        unknown = set(self.changes) - set(ALLOWED)
        if unknown:
            raise ValueError(f"changes {sorted(unknown)} are none of {', '.join(ALLOWED)}")

    @property
    def label(self) -> str:
        """``fsdp(sync last) + offload + checkpoint blocks.* every 2nd + expandable_segments:True + lora``, as a
        table shows it."""
        parts = [self.parallel if self.fsdp_sync is None else f"fsdp(sync {self.fsdp_sync})"]
        if self.offload:
            parts.append("offload")
        if self.checkpoint_every:
            nth = "every block" if self.checkpoint_every == 1 else f"every {_ordinal(self.checkpoint_every)} block"
            parts.append(f"checkpoint {self.blocks} {nth}")
        if self.allocator:
            parts.append(self.allocator)
        parts.extend(self.changes)
        return " + ".join(parts)

    @property
    def changes_numbers(self) -> bool:
        return bool(self.changes)


def _ordinal(n: int) -> str:
    return f"{n}{'nd' if n % 10 == 2 and n != 12 else 'rd' if n % 10 == 3 and n != 13 else 'th'}"


@dataclass(frozen=True, kw_only=True)
class SettingRow(Record):
    """What the search found for one setting: whether a micro-batch of 1 fits by the estimate, its max
    micro-batch there (0 when none fits), the plan it makes (micro-batch, accumulation steps), its reserved
    peak at that micro-batch, the predicted seconds per optimizer step and samples per second by the time
    model (0 when it does not fit), the seconds measured by real steps where it was confirmed, and ``why``
    it won or lost."""

    setting: TrainSetting
    fits: bool
    max_micro_batch: Count
    micro_batch: Count = 0
    accumulation_steps: Count = 0
    peak_bytes: int | None = None
    step_seconds: float | None = None
    samples_per_second: float = 0.0
    measured_samples_per_second: float | None = None
    why: str = ""


@dataclass(frozen=True, kw_only=True)
class SettingsAsk(Record):
    """A plan request's settings search: the number-changing settings ``allow``-ed beside the default ones, and
    whether to confirm the winner and runner-up by timed real steps (on a real device)."""

    allow: Annotated[tuple[str, ...], Rule(allow_list)] = ()
    confirm: bool = True
    steps: Whole = 3



def searched(request: R, search: bool, allow: object = None) -> R:
    """``request`` (a PlanRequest) with a settings search of the ``allow``-ed changes when ``search`` (BadInput:
    ``allow`` without ``search``)."""
    if allow and not search:
        raise BadInput("names settings for the settings search", field="allow", value=allow,
                       fix="set {search_settings=True} too, or drop {allow}")
    return replace(request, search=SettingsAsk(allow=allow_list(allow))) if search else request  # type: ignore
