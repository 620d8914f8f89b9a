"""Training by a plan: exact accumulation, the runner and its verification, DDP, throughput tuning.

Owns: Accumulator, PlanSampler, the batch ramp at run time, run_plan, the checks, torch.distributed glue,
tune. May import: everything below it (foundation, results, planning, workload, devices, probing).
"""

from __future__ import annotations

from .accumulate import Accumulator, StepOutcome
from .noise import GradientNoiseScale
from .ramp import BatchRamp, RampSampler
from .runner import run_plan
from .sampler import PlanSampler

__all__ = ["Accumulator", "BatchRamp", "GradientNoiseScale", "PlanSampler", "RampSampler", "StepOutcome", "run_plan"]
