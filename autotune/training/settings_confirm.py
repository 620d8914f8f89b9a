"""A settings search's winner and runner-up on a real device: each run once by the fit rule at its micro-batch,
then timed by real optimizer steps (as ``--tune`` times them), and kept in the order measured."""

from __future__ import annotations

from dataclasses import replace

from ..devices.base import Device
from ..probing.fitrule import run_trial
from ..probing.settings import apply
from ..results.plan import Plan
from ..results.search import SettingRow, TrainSetting
from ..workload import Workload
from .timing import Timing, time_plan


def confirmed(order: list[SettingRow], plans: dict[TrainSetting, Plan | None], workload: Workload, device: Device,
              spec: str | None) -> tuple[list[SettingRow], str]:
    """The winner and runner-up each run once for real (the fit rule at its micro-batch, then timed optimizer
    steps); the order of the two as measured, and a note saying so."""
    top = [r for r in order[:2] if r.fits]
    sharded = [r.setting.label for r in top if r.setting.parallel == "fsdp"]
    if sharded:  # the timed steps run the model as one process holds it, unsharded
        return order, f"not confirmed by real steps: the timed steps do not run {' or '.join(sharded)}"
    measured: dict[TrainSetting, SettingRow] = {}
    for row in top:
        plan = plans[row.setting]
        assert plan is not None and plan.probe is not None
        wl = apply(workload, row.setting, spec=spec, cuda=device.torch_device.type == "cuda", real=True)
        trial = run_trial(device, wl, plan.micro_batch, plan.probe.usable_bytes, source="real")
        if not trial.fits:
            measured[row.setting] = replace(row, fits=False, why=f"ran out of memory for real: {trial.why}")
            continue
        times = time_plan(wl, device, plan, timing=Timing(warmup=1, min_steps=3, max_steps=10, budget_s=3.0))
        measured[row.setting] = replace(row, measured_samples_per_second=plan.target_batch / times.median)
    rows = [measured.get(r.setting, r) for r in order]
    head = sorted(rows[:len(top)], key=lambda r: (not r.fits, -(r.measured_samples_per_second or 0.0)))
    same = [r.setting for r in head] == [r.setting for r in rows[:len(top)]]
    fastest = head[0].measured_samples_per_second
    head = [replace(r, why=f"{_measured_place(i, fastest, r.measured_samples_per_second)} "
                           f"({r.measured_samples_per_second:.4g} samples/s); by the model: {r.why}")
            if r.measured_samples_per_second and fastest else r for i, r in enumerate(head)]
    said = ", ".join(f"{r.setting.label} {r.measured_samples_per_second or 0:.4g} samples/s" for r in head)
    verdict = "the predicted order" if same else "not the predicted order: kept as measured"
    return head + rows[len(top):], f"measured by real optimizer steps: {said} ({verdict})"


def _measured_place(place: int, fastest: float, mine: float) -> str:
    return "fastest measured" if place == 0 else f"slower measured by {fastest / mine - 1:.0%}"
