"""The results every stage hands to the next: typed, frozen, validated, JSON with a ``kind`` and a
``schema_version`` (see :mod:`autotune.serial` for the envelope).

Owns: ProbeResult and its Trials, Plan, RunResult, the batch ramp's RampConfig and BatchPhase. May import:
errors, units, serial, options (no torch, no numpy, no pandas: the planner and the reports read results
without them).
"""

from __future__ import annotations

from .device import DeviceInfo
from .plan import Plan
from .probe import TRIAL_COLUMNS, ProbeResult, Trial
from .ramp import BatchPhase, RampConfig
from .run import Check, RunResult, Verification
from .tuning import Candidate, HeadToHead, Tuning

__all__ = ["TRIAL_COLUMNS", "BatchPhase", "Candidate", "Check", "DeviceInfo", "HeadToHead", "Plan", "ProbeResult",
           "RampConfig", "RunResult", "Trial", "Tuning", "Verification"]
