"""Allocator settings compared by the simulation: does another one fit a larger micro-batch, or retry less?

The allocation trace of the fit rule does not depend on the allocator's
settings, only what the allocator reserves for it does. So the trace at a
micro-batch, recorded once, is replayed through the caching-allocator
simulation under the user's settings and under each candidate
(``expandable_segments:True``, ``roundup_power2_divisions:4``,
``max_split_size_mb:512``, ``garbage_collection_threshold:0.6``): reserved and
allocated peaks, release-and-retries. The garbage collection threshold acts,
as in PyTorch's allocator, only under a ``per_process_memory_fraction``: without
one it replays as the user's settings do, and is not advised.
Where a candidate fits one more micro-batch than the user's settings do, its
own max micro-batch is searched with more recorded runs (every answer a
simulation of that size). Nothing is applied: the advice says what to set.
"""

from __future__ import annotations

from collections.abc import Callable

from ..devices.allocconf import CONF_VARIABLES, AllocatorConfig
from ..devices.replay import Replay, replay
from ..results.device import DeviceInfo
from ..results.timeline import AllocatorOption
from ..units import format_bytes

CANDIDATES = ("expandable_segments:True", "roundup_power2_divisions:4", "max_split_size_mb:512",
              "garbage_collection_threshold:0.6")
Trace = list[tuple[int, int, int]]


class Settings:
    """Replays of traces under allocator settings, on the device an estimate stands in for."""

    def __init__(self, *, user_conf: str, capacity: int, device_total: int | None, usable: int,
                 trace_at: Callable[[int], Trace]):
        self.user_conf = user_conf
        self.capacity, self.device_total, self.usable = capacity, device_total, usable
        self.trace_at = trace_at
        self._replays: dict[tuple[str, int], Replay] = {}

    def conf(self, setting: str) -> str:
        return ",".join(c for c in (self.user_conf, setting) if c)

    def replay(self, setting: str, batch: int) -> Replay:
        key = (setting, batch)
        if key not in self._replays:
            config = AllocatorConfig.parse(self.conf(setting))
            self._replays[key] = replay(self.trace_at(batch), capacity=self.capacity, conf=config,
                                        device_total=self.device_total)
        return self._replays[key]

    def fits(self, setting: str, batch: int) -> bool:
        r = self.replay(setting, batch)
        return not r.out_of_memory and r.reserved_peak <= self.usable

    def max_batch(self, setting: str, start: int, limit: int) -> int:
        """The largest size from ``start`` (which fits) up to ``limit`` that fits under ``setting``: doubling
        steps, then bisection."""
        low, step, high = start, 1, None
        while high is None:
            probe = min(low + step, limit)
            if probe == low:
                return low
            if self.fits(setting, probe):
                low, step = probe, step * 2
            else:
                high = probe
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.fits(setting, mid) else (low, mid)
        return low


def compare(settings: Settings, batch: int, user_max: int, limit: int, *,
            candidates: tuple[str, ...] = CANDIDATES) -> list[AllocatorOption]:
    """The user's settings and each candidate at ``batch``; a candidate's max micro-batch where it fits more
    than ``user_max`` (searched up to ``limit``)."""
    out = []
    for setting in ("", *candidates):
        if setting and _already(settings, setting):
            continue
        r = settings.replay(setting, batch)
        best = None
        if user_max < limit and settings.fits(setting, user_max + 1):
            best = settings.max_batch(setting, user_max + 1, limit)
        out.append(AllocatorOption(setting=setting, conf=settings.conf(setting), reserved_bytes=r.reserved_peak,
                                   allocated_bytes=r.allocated_peak, retries=r.retries,
                                   max_micro_batch=best if setting else user_max, out_of_memory=r.out_of_memory))
    return out


def _already(settings: Settings, setting: str) -> bool:
    """Does the user's setting already do what ``setting`` would (the same configuration either way)?"""
    return AllocatorConfig.parse(settings.user_conf) == AllocatorConfig.parse(settings.conf(setting))


def advise(options: list[AllocatorOption], batch: int, variable: str, limit: int | None = None) -> list[str]:
    """Sentences: which setting fits a larger micro-batch or removes release-and-retries, with the figures;
    or that none of those tried does better. ``limit``: the largest micro-batch searched; where the user's max
    is already there, no setting was asked for a larger one, and the sentence says so."""
    if not options:
        return []
    user = options[0]
    lines = []
    for o in options[1:]:
        frag = _at(user, o, batch)
        if o.max_micro_batch is not None and o.max_micro_batch > (user.max_micro_batch or 0):
            lines.append(f"with {variable}={o.conf} the max micro-batch would be {o.max_micro_batch} instead of "
                         f"{user.max_micro_batch} ({frag}); autotune does not set it: export it before probing "
                         "and training to use it")
        elif user.retries and not o.retries and not o.out_of_memory:
            lines.append(f"with {variable}={o.conf} the {user.retries} release-and-retries at micro-batch {batch} "
                         f"would go ({frag}); autotune does not set it: export it before probing and training")
    if not lines:
        tried = ", ".join(o.setting for o in options[1:])
        figures = f"micro-batch {batch} runs out of memory under each" if all(o.out_of_memory for o in options) \
            else f"{_at(user, None, batch)}, {user.retries} release-and-retries"
        if limit is not None and user.max_micro_batch is not None and user.max_micro_batch >= limit:
            lines.append(f"allocator settings: {user.max_micro_batch} is already the largest micro-batch asked for, "
                         f"so no setting ({tried}) was searched for a larger one ({figures})")
        else:
            lines.append(f"allocator settings: none of those tried ({tried}) fits a larger micro-batch than "
                         f"{variable}={user.conf or '(not set)'} here ({figures})")
    return lines


def _at(user: AllocatorOption, other: AllocatorOption | None, batch: int) -> str:
    """The fragmentation at ``batch`` under the user's settings (-> ``other``'s); where one runs out of memory
    there, that instead (its peaks are those of a replay past the error)."""
    if user.out_of_memory or (other is not None and other.out_of_memory):
        under = "yours" if user.out_of_memory else "this setting"
        spared = other is not None and user.out_of_memory and not other.out_of_memory
        return f"micro-batch {batch} runs out of memory under {under}" + (", not under this one" if spared else "")
    figures = format_bytes(user.fragmentation_bytes)
    if other is not None:
        figures += f" -> {format_bytes(other.fragmentation_bytes)}"
    return f"fragmentation {figures} at micro-batch {batch}"


def user_variable(info: DeviceInfo) -> str:
    """The variable the user's allocator settings come from (PYTORCH_ALLOC_CONF, the device-generic one, when
    neither is set)."""
    return info.allocator_conf_variable or CONF_VARIABLES[-1]
