"""RunResult: what a planned run did, measured, and verified, with its checks. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from ..options import PRECISIONS
from ..units import format_bytes, plural
from .device import DeviceInfo
from .noise import NoiseScaleEstimate, describe
from .plan import Plan
from .ramp import BatchPhase, RampConfig, check_phases
from .record import Count, Record, Whole, derived, one_of


@dataclass(frozen=True, kw_only=True)
class Check(Record):
    """One verification check: its verdict, the value measured, the limit it was held to, one line.

    ``details`` holds what the check found beside its verdict, for reports
    (the reference used, layers named, per-step counts).
    """

    name: str
    passed: bool
    value: int | float | None
    limit: int | float | None
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Verification(Record):
    """The checks of a run and their verdict (every check held, on every rank)."""

    passed: bool
    gradient_relative_error: float | None = None
    checks: tuple[Check, ...]

    def check(self, name: str) -> Check | None:
        """The check called ``name``, if it ran."""
        return next((c for c in self.checks if c.name == name), None)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)


@dataclass(frozen=True, kw_only=True)
class RunResult(Record):
    """A run of a Plan: per-step losses, throughput, peak memory, the verification (None when the run
    was not verified) and the gradient noise scale its micro-steps measured (None when off); with a batch
    ramp (``ramp``: its settings), ``batch_schedule`` holds its phases (empty: every step took the plan's
    target batch)."""

    KIND = "RunResult"

    workload: str
    device: DeviceInfo
    precision: Annotated[str, one_of(PRECISIONS)]
    losses: tuple[float, ...]
    step_seconds: tuple[float, ...]
    samples_per_s: float
    items_per_s: float
    peak_bytes: Count
    usable_bytes: Whole
    predicted_peak_bytes: int | None
    skipped_steps: int = 0
    verification: Verification | None = None
    notes: tuple[str, ...] = ()
    allocated_peak_bytes: int | None = None  # live tensor bytes at the peak (about max_memory_allocated on CUDA)
    plan: Plan
    noise_scale: NoiseScaleEstimate | None = None
    ramp: RampConfig | None = None
    batch_schedule: tuple[BatchPhase, ...] = ()

    def validate(self) -> None:
        if len(self.losses) != len(self.step_seconds) or not self.losses:
            raise ValueError("a run has at least one step, with one loss and one duration per step")
        object.__setattr__(self, "losses", tuple(float(x) for x in self.losses))
        object.__setattr__(self, "step_seconds", tuple(float(x) for x in self.step_seconds))
        check_phases(self.batch_schedule, len(self.losses), self.plan.world_size)

    @property
    @derived(after="verification")
    def passed(self) -> bool:
        return self.verification is None or self.verification.passed

    @property
    @derived(after="precision")
    def steps(self) -> int:
        return len(self.losses)

    @property
    @derived(after="predicted_peak_bytes")
    def memory_ratio(self) -> float | None:
        return self.peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else None

    def summary(self) -> str:
        ran = f"a batch ramp toward {self.plan.arithmetic}" if self.batch_schedule else self.plan.arithmetic
        lines = [f"ran {ran} for {plural(self.steps, 'step')} on {self.device.name} "
                 f"({self.precision}): "
                 f"{self.samples_per_s:,.0f} samples/s, loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}"]
        mem = f"peak memory {format_bytes(self.peak_bytes)} of {format_bytes(self.usable_bytes)} usable"
        if self.memory_ratio is not None:
            mem += f", {self.memory_ratio:.3f} x predicted ({format_bytes(self.predicted_peak_bytes)})"
        lines.append(mem)
        if self.batch_schedule:
            lines.append(ramp_line(self.batch_schedule, self.plan.target_batch))
        if self.skipped_steps:
            lines.append(f"fp16: {plural(self.skipped_steps, 'optimizer step')} skipped by GradScaler "
                         "(inf/nan gradients)")
        if self.verification is not None:
            verdict = "PASSED" if self.passed else "FAILED"
            lines.append(f"verification {verdict}:")
            for check in self.verification.checks:
                lines.append(f"  [{'ok' if check.passed else 'FAIL'}] {check.name}: {check.message}")
                if check.details.get("dropout"):
                    lines.append(f"       ({check.details['dropout']})")
        if self.noise_scale is not None:  # against the effective batch it was measured at (its items)
            ramped = self.batch_schedule and self.noise_scale.unit == "samples" and self.noise_scale.steps
            word = describe(self.noise_scale, self.plan.target_batch if ramped else None)
            lines.append(word if word.startswith("noise scale") else f"noise scale: {word}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def ramp_line(phases: tuple[BatchPhase, ...], target: int) -> str:
    """``batch ramp: 33 (step 1, lr x0.52) -> 66 (step 21, ...) ...; target 256``."""
    parts = [f"{p.effective_batch} (step {p.first_step + 1}, lr x{p.lr_scale:.2g})" for p in phases]
    reached = "reached" if phases[-1].effective_batch == target else "not reached"
    return f"batch ramp: {' -> '.join(parts)}; target {target} {reached}"
