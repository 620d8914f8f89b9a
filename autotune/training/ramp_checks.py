"""Verification of a batch ramp: every phase an exact plan within the target and the memory limit, grown only on
a bounded reading, and every phase's accumulated gradient the full-batch gradient.

Tests plant the faults each check exists to catch (a ramp past the target, a micro-batch past the memory limit, a
batch that shrinks, growth on a reading whose lower bound was not above the batch, a phase that drops a sample).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..results.plan import Plan
from ..results.ramp import BatchPhase
from ..results.run import Check
from ..units import plural


def schedule_check(plan: Plan, phases: Sequence[BatchPhase]) -> Check:
    """The ramp stayed within the plan: each phase at most the target batch and at least the one before, its
    micro-batches at most the plan's memory limit, and each growth decided on a 95% lower bound of the noise
    scale above the batch before it."""
    target, limit = plan.target_batch, plan.max_micro_batch
    faults = []
    for i, phase in enumerate(phases):
        where = f"phase {i + 1} (step {phase.first_step + 1}, {phase.effective_batch} samples)"
        if phase.effective_batch > target:
            faults.append(f"{where} is above the target {target}")
        if phase.micro_batch > limit:
            faults.append(f"{where} has a micro-batch of {phase.micro_batch}, above the memory limit {limit}")
        if i and phase.effective_batch < phases[i - 1].effective_batch:
            faults.append(f"{where} is smaller than the phase before ({phases[i - 1].effective_batch})")
        if i and not (phase.low is not None and phase.low > phases[i - 1].effective_batch):
            faults.append(f"{where} grew on a reading whose 95% lower bound ({phase.low}) was not above the "
                          f"batch before ({phases[i - 1].effective_batch})")
    details = {"phases": [p.to_dict() for p in phases], "faults": faults}
    if faults:
        return Check(name="batch_schedule", passed=False, value=len(faults), limit=0, details=details,
                     message=f"{faults[0]}{f' ({len(faults)} faults in all)' if len(faults) > 1 else ''}")
    sizes = " -> ".join(str(p.effective_batch) for p in phases)
    return Check(name="batch_schedule", passed=True, value=0, limit=0, details=details,
                 message=f"{plural(len(phases), 'phase')} ({sizes} samples per step): never above the target "
                         f"{target}, never smaller than the phase before, micro-batches at most {limit} (the "
                         "memory limit), each growth on a 95% lower bound of the noise scale above the batch before")


def gradients_check(phases: Sequence[BatchPhase], check: Callable[[BatchPhase], Check]) -> Check:
    """Every phase's accumulation gives the full-batch gradient: ``check(phase)`` is the gradient check of one
    phase's plan (:func:`autotune.training.verify.gradient_check` on a batch of its size)."""
    results = [(phase, check(phase)) for phase in phases]
    errors = [c.value for _, c in results]
    bad = [(p, c) for p, c in results if not c.passed]
    limits = [c.limit for _, c in results if c.limit is not None]
    limit = max(limits) if limits else None
    worst = max((e for e in errors if e is not None), default=None)
    details = {"phases": [{"effective_batch": p.effective_batch, "micro_steps": len(p.schedule[0]),
                           "relative_error": c.value, "limit": c.limit, "passed": c.passed} for p, c in results]}
    if bad:
        phase, failed = bad[0]
        return Check(name="phase_gradients", passed=False, value=worst, limit=limit, details=details,
                     message=f"phase of {phase.effective_batch} samples (from step {phase.first_step + 1}): "
                             f"{failed.message} ({len(bad)} of {plural(len(results), 'phase')} failed)")
    shown = "n/a" if worst is None else f"{worst:.2e}"
    bound = "" if limit is None else f" (limit {limit:.2g})" if len(set(limits)) == 1 else \
        f" (limits up to {limit:.1e}: each phase its own precision's rounding)"
    return Check(name="phase_gradients", passed=True, value=worst, limit=limit, details=details,
                 message=f"every phase's accumulated gradient equals its full-batch gradient: largest relative "
                         f"error {shown} over {plural(len(results), 'phase')}{bound}")
