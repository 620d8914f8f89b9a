"""Training by a plan: exact accumulation, the runner and its verification, DDP, throughput tuning.

Owns: Accumulator and the parts it is composed of (Batches, Sync, MixedPrecision, NoiseScale, the batch ramp at
run time), PlanSampler, run_plan, the checks, torch.distributed glue, tune. May import: everything below it
(foundation, results, planning, workload, devices, probing).
"""

from __future__ import annotations

from .accumulate import Accumulator, StepOutcome
from .noise import GradientNoiseScale, NoiseScale
from .parts import Batches
from .precision import MixedPrecision
from .ramp import BatchRamp, RampSampler
from .runner import run_plan
from .sampler import PlanSampler
from .sync import Sync

__all__ = ["Accumulator", "Batches", "BatchRamp", "GradientNoiseScale", "MixedPrecision", "NoiseScale", "PlanSampler",
           "RampSampler", "StepOutcome", "Sync", "run_plan"]
