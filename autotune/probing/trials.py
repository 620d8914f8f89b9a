"""Fit-rule trials of one source (estimate or real), run once per size and remembered: a
:class:`TrialRunner` hands out :class:`~autotune.results.probe.Trial` s (each with the device's measurement of
it) and logs each one."""

from __future__ import annotations

import time

from .. import log
from ..devices.base import Device
from ..results.probe import Trial
from ..units import format_bytes
from ..workload import Workload
from .blockreplay import found_blocks, replayed_trial
from .blocks import Blocks
from .fitrule import run_trial
from .fsdp import Sharding
from .hostbatch import HostBatches
from .stepreuse import OptimizerSteps


def _blocks(device: Device, workload: Workload) -> Blocks | None:
    """The model's identical blocks an estimate replays (said when found), else None."""
    blocks = found_blocks(device, workload)
    if blocks is not None:
        log.progress(f"{blocks}: estimated through the model cut to 2 and 3 of its repeated groups (and 4, at the "
                     "first size)")
    return blocks


class TrialRunner:
    """Runs and remembers fit-rule trials of one source (estimate or real): ``runner(b)`` is the measured trial at
    micro-batch ``b`` (run once); ``done`` holds them by size, ``log`` every trial's record in the order they ran
    (shared by a probe's estimate and real runners)."""

    def __init__(self, device: Device, workload: Workload, usable: int, source: str,
                 log: list[Trial], data_parallel: bool, sharding: Sharding | None = None,
                 host: HostBatches | None = None):
        self.device, self.workload, self.usable, self.source = device, workload, usable, source
        self.data_parallel, self.sharding = data_parallel, sharding
        self.host = host if host is not None else HostBatches()  # shared by a probe's estimate and real trials
        self.log = log
        self.by_size: dict[int, Trial] = {}
        self.blocks = _blocks(device, workload) if source == "estimate" else None
        # an estimate's optimizer steps: each evaluated once, made again at the other sizes
        self.optimizer_steps = OptimizerSteps() if source == "estimate" else None

    def __call__(self, batch: int) -> Trial:
        if batch not in self.by_size:
            on_step = None
            if self.source == "real":
                log.progress(f"real run at micro-batch {batch} ...")
                begin = time.perf_counter()

                def on_step(done: int, total: int) -> None:
                    log.progress(f"real run at micro-batch {batch}: micro-step {done}/{total} "
                                 f"({time.perf_counter() - begin:.1f} s)", transient=True)

            # Real trials raise the device's OOM at its capacity (the CPU emulates it), so a
            # trial never takes more than the budget; estimates measure the whole step.
            trial = self._replayed(batch) if self.blocks is not None else None
            if trial is None:
                trial = run_trial(self.device, self.workload, batch, self.usable, source=self.source,
                                  capacity_guard=self.source == "real", data_parallel=self.data_parallel,
                                  sharding=self.sharding, on_step=on_step, host=self.host,
                                  optimizer_steps=self.optimizer_steps)
            self.by_size[batch] = trial
            self.log.append(trial)
            peak = "out of memory" if trial.oom else format_bytes(trial.peak_bytes)
            verdict = "fits" if trial.fits else "does not fit"
            log.progress(f"{self.source} at micro-batch {batch}: peak {peak}, {verdict} ({trial.seconds:.2f} s)")
        return self.by_size[batch]

    def _replayed(self, batch: int) -> Trial | None:
        """The estimate at ``batch`` through the model cut to a few of its identical blocks (see
        :mod:`autotune.probing.blockreplay`), the first time checked against 4 of them too; None (and the whole
        model evaluated from now on) where their pattern does not rebuild the cut traces to the byte."""
        assert self.blocks is not None
        cuts = (2, 3) if self.by_size else (2, 3, 4)
        measured = replayed_trial(self.device, self.workload, self.blocks, batch, self.usable, source=self.source,
                                  cuts=cuts, data_parallel=self.data_parallel, sharding=self.sharding,
                                  host=self.host, optimizer_steps=self.optimizer_steps)
        if measured is None:
            log.progress(f"the {self.blocks} do not repeat as one pattern: the whole model is evaluated")
            self.blocks = None
        return measured

    def fits(self, batch: int) -> bool:
        return self(batch).fits

    def last(self) -> Trial:
        return self.by_size[self.log[-1].batch]

    def peaks(self) -> dict[int, int]:
        """Batch size -> peak bytes of every trial that ran to the end."""
        return {b: a.peak_bytes for b, a in sorted(self.by_size.items()) if a.peak_bytes is not None}

    def timelines(self) -> dict[int, tuple[int, ...]]:
        """Batch size -> the timeline of live bytes of every trial that ran to the end with one."""
        return {b: a.measurement.timeline for b, a in sorted(self.by_size.items())
                if a.measurement is not None and len(a.measurement.timeline) > 0}

    def misses(self) -> int:
        """Trials that did not fit (out of memory, or a peak over the usable memory)."""
        return sum(not a.fits for a in self.by_size.values())
