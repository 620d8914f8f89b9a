"""RunResult: what a planned run did, measured, and verified, with its checks. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..serial import envelope, invalid, open_envelope, read_dataclass, read_fields
from ..units import format_bytes, plural
from .device import DeviceInfo
from .noise import NoiseScaleEstimate, describe
from .plan import Plan
from .ramp import BatchPhase, RampConfig, check_phases, read_phases


@dataclass(frozen=True, kw_only=True)
class Check:
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

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "value": self.value, "limit": self.limit,
                "message": self.message, "details": self.details}


@dataclass(frozen=True, kw_only=True)
class Verification:
    """The checks of a run and their verdict (every check held, on every rank)."""

    passed: bool
    checks: tuple[Check, ...]
    gradient_relative_error: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "checks", tuple(self.checks))

    def check(self, name: str) -> Check | None:
        """The check called ``name``, if it ran."""
        return next((c for c in self.checks if c.name == name), None)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "gradient_relative_error": self.gradient_relative_error,
                "checks": [c.to_dict() for c in self.checks]}


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """A run of a Plan: per-step losses, throughput, peak memory, the verification (None when the run
    was not verified) and the gradient noise scale its micro-steps measured (None when off); with a batch
    ramp (``ramp``: its settings), ``batch_schedule`` holds its phases (empty: every step took the plan's
    target batch)."""

    plan: Plan
    workload: str
    device: DeviceInfo
    precision: str
    losses: tuple[float, ...]
    step_seconds: tuple[float, ...]
    samples_per_s: float
    items_per_s: float
    peak_bytes: int
    usable_bytes: int
    predicted_peak_bytes: int | None
    skipped_steps: int = 0
    verification: Verification | None = None
    notes: tuple[str, ...] = ()
    noise_scale: NoiseScaleEstimate | None = None
    allocated_peak_bytes: int | None = None  # live tensor bytes at the peak (about max_memory_allocated on CUDA)
    ramp: RampConfig | None = None
    batch_schedule: tuple[BatchPhase, ...] = ()

    def __post_init__(self) -> None:
        if len(self.losses) != len(self.step_seconds) or not self.losses:
            raise ValueError("a run has at least one step, with one loss and one duration per step")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"unknown precision {self.precision!r}")
        if self.peak_bytes < 0 or self.usable_bytes <= 0:
            raise ValueError("memory figures must be positive")
        object.__setattr__(self, "losses", tuple(float(x) for x in self.losses))
        object.__setattr__(self, "step_seconds", tuple(float(x) for x in self.step_seconds))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "batch_schedule", tuple(self.batch_schedule))
        check_phases(self.batch_schedule, len(self.losses), self.plan.world_size)

    @property
    def passed(self) -> bool:
        return self.verification is None or self.verification.passed

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
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

    def to_dict(self) -> dict[str, Any]:
        return envelope("RunResult", {
            "workload": self.workload,
            "device": self.device.to_dict(),
            "precision": self.precision,
            "steps": self.steps,
            "losses": list(self.losses),
            "step_seconds": list(self.step_seconds),
            "samples_per_s": self.samples_per_s,
            "items_per_s": self.items_per_s,
            "peak_bytes": self.peak_bytes,
            "usable_bytes": self.usable_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "memory_ratio": self.memory_ratio,
            "skipped_steps": self.skipped_steps,
            "verification": None if self.verification is None else self.verification.to_dict(),
            "passed": self.passed,
            "notes": list(self.notes),
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "plan": self.plan.to_dict(),
            "noise_scale": None if self.noise_scale is None else self.noise_scale.to_dict(),
            "ramp": None if self.ramp is None else self.ramp.to_dict(),
            "batch_schedule": [p.to_dict() for p in self.batch_schedule],
        })

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "data") -> RunResult:
        _, body = open_envelope(data, "RunResult", source=source)
        for derived in ("steps", "memory_ratio", "passed"):
            body.pop(derived, None)
        body = read_fields(cls, body, kind="RunResult", source=source)
        body["device"] = DeviceInfo.from_dict(body["device"], kind="RunResult", source=source)
        if body.get("verification") is not None:
            body["verification"] = _read_verification(body["verification"], source)
        body["plan"] = Plan.from_dict(body["plan"], source=f"{source} (its plan)")
        if body.get("noise_scale") is not None:
            body["noise_scale"] = NoiseScaleEstimate.from_dict(body["noise_scale"], kind="RunResult", source=source)
        if body.get("ramp") is not None:
            body["ramp"] = RampConfig.from_dict(body["ramp"], kind="RunResult", source=source)
        if "batch_schedule" in body:
            body["batch_schedule"] = read_phases(body["batch_schedule"], kind="RunResult", source=source)
        try:
            return cls(**body)
        except (TypeError, ValueError) as exc:
            raise invalid("RunResult", source, str(exc)) from None


def ramp_line(phases: tuple[BatchPhase, ...], target: int) -> str:
    """``batch ramp: 33 (step 1, lr x0.52) -> 66 (step 21, ...) ...; target 256``."""
    parts = [f"{p.effective_batch} (step {p.first_step + 1}, lr x{p.lr_scale:.2g})" for p in phases]
    reached = "reached" if phases[-1].effective_batch == target else "not reached"
    return f"batch ramp: {' -> '.join(parts)}; target {target} {reached}"


def _read_verification(value: Any, source: str) -> Verification:
    fields = read_dataclass(Verification, value, kind="RunResult", source=source, where="verification")
    checks = [Check(**read_dataclass(Check, c, kind="RunResult", source=source, where=f"verification.checks[{i}]"))
              for i, c in enumerate(fields.pop("checks"))]
    try:
        return Verification(checks=tuple(checks), **fields)
    except (TypeError, ValueError) as exc:
        raise invalid("RunResult", source, f"verification: {exc}") from None
