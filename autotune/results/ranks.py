"""MixedRanks: what a plan for ranks that differ knows of each rank, and what it gains over the smallest-for-all plan.

No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from .. import options
from ..units import format_bytes, plural
from .record import Record, Rule, Whole, derived, one_of

#: How a rank's time per sample is known: timed on the rank itself, or a roofline estimate for a GPU by name.
TIMED_BY = ("measured", "roofline")
#: How a mixed plan balances its ranks: by time per sample, or by memory alone (every micro-step counted alike).
BALANCED_BY = ("time", "memory")


@dataclass(frozen=True, kw_only=True)
class RankShare(Record):
    """One rank of a mixed plan: its device, its max micro-batch and memory, and its speed when known.

    ``peak_bytes`` is the predicted peak at this rank's largest micro-batch in the plan, ``headroom_bytes`` its
    usable memory less that (None without a peak); ``budget_bytes`` the
    memory budget it was planned under (a run keeps to it); ``seconds_per_sample`` its time per sample at its max
    micro-batch, ``timed_by`` how that is known; ``fingerprint`` its probe's key in the plan store.
    """

    device: str
    max_micro_batch: Whole
    usable_bytes: Whole
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    seconds_per_sample: Annotated[float, Rule(options.seconds)] | None = None
    timed_by: str | None = None
    fingerprint: str | None = None

    def validate(self) -> None:
        t = self.seconds_per_sample
        if (t is None) != (self.timed_by is None) or (self.timed_by is not None and self.timed_by not in TIMED_BY):
            raise ValueError(f"timed_by must be one of {TIMED_BY} with a time per sample, None without; got "
                             f"{self.timed_by!r}")

    @property
    @derived(after="peak_bytes")
    def headroom_bytes(self) -> int | None:
        return None if self.peak_bytes is None else self.usable_bytes - self.peak_bytes

    def speed_words(self) -> str:
        """``0.21 ms per sample (roofline)``, or nothing when the speed is not known."""
        if self.seconds_per_sample is None:
            return ""
        return f"{_seconds(self.seconds_per_sample)} per sample ({self.timed_by})"


@dataclass(frozen=True, kw_only=True)
class MixedRanks(Record):
    """How a plan shares the target over ranks that differ.

    ``ranks[r]``: rank ``r``. ``balanced_by``: "time" (every rank's time per sample known) or "memory".
    ``step_seconds``: the predicted step time, the slowest rank's samples x its time per sample (None by
    memory). The smallest-for-all plan (every rank at the smallest max micro-batch) is described by
    ``uniform_per_rank`` (its samples per rank), ``uniform_micro_batch`` and ``uniform_steps``, and
    ``uniform_step_seconds`` is its predicted step time the same way; all None when no such plan exists.
    """

    ranks: tuple[RankShare, ...]
    balanced_by: Annotated[str, one_of(BALANCED_BY)]
    step_seconds: float | None = None
    uniform_per_rank: tuple[int, ...] | None = None
    uniform_micro_batch: int | None = None
    uniform_steps: int | None = None
    uniform_step_seconds: float | None = None

    def validate(self) -> None:
        if not self.ranks:
            raise ValueError("ranks must be one RankShare per rank")
        if self.uniform_per_rank is not None:
            object.__setattr__(self, "uniform_per_rank", tuple(int(n) for n in self.uniform_per_rank))

    def lines(self, schedule: tuple[tuple[int, ...], ...]) -> list[str]:
        """One line per rank (at most 8, then a count), and what the plan gains over the smallest-for-all one."""
        how = ("balanced by time per sample: the slowest rank's micro-steps x its time per micro-step as small as "
               "it can be" if self.balanced_by == "time" else
               "balanced by memory (nothing known of speed): the fewest micro-steps on the slowest rank, then "
               "samples as even as each rank's micro-steps hold")
        lines = [f"mixed ranks: each rank its own micro-batch and micro-steps, {how}"]
        for r, (share, row) in enumerate(list(zip(self.ranks, schedule))[:8]):
            sizes = " + ".join(f"{row.count(b)} x {b}" for b in sorted(set(row)))
            peak = "" if share.peak_bytes is None else f", peak {format_bytes(share.peak_bytes)}"
            speed = share.speed_words()
            lines.append(f"  rank {r} ({share.device}): {sum(row)} samples = {sizes}; max micro-batch "
                         f"{share.max_micro_batch}{peak} of {format_bytes(share.usable_bytes)} usable"
                         + (f"; {speed}" if speed else ""))
        if len(self.ranks) > 8:
            lines.append(f"  ... and {plural(len(self.ranks) - 8, 'more rank')}")
        gain = self.gain_line(schedule)
        if gain:
            lines.append(gain)
        return lines

    def gain_line(self, schedule: tuple[tuple[int, ...], ...]) -> str | None:
        """What the plan gains over the smallest-for-all plan (``uniform_ranks``), in its samples per rank and
        its predicted step time (micro-steps of the slowest rank, by memory)."""
        if self.uniform_per_rank is None:
            return None
        per_rank = [sum(row) for row in schedule]
        shown = ", ".join(map(str, per_rank[:8])) + (", ..." if len(per_rank) > 8 else "")
        uniform = ", ".join(map(str, self.uniform_per_rank[:8])) + (", ..." if len(per_rank) > 8 else "")
        text = (f"against the smallest-for-all plan (uniform ranks: micro-batch {self.uniform_micro_batch} x "
                f"{plural(self.uniform_steps or 0, 'step')} on every rank): samples per rank {shown} instead of "
                f"{uniform}")
        if self.step_seconds is not None and self.uniform_step_seconds is not None:
            ratio = self.uniform_step_seconds / self.step_seconds if self.step_seconds > 0 else math.inf
            text += (f"; predicted step {_seconds(self.step_seconds)} instead of {_seconds(self.uniform_step_seconds)} "
                     f"({ratio:.2f}x the samples per second)")
        else:
            most = max(map(len, schedule))
            text += f"; the slowest rank runs {plural(most, 'micro-step')} instead of {self.uniform_steps}"
        return text


def _seconds(value: float) -> str:
    """Seconds as people read them: ``1.23 s``, ``45.6 ms``, ``7.8 us``."""
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"
