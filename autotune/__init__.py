"""autotune: the largest micro-batch that fits, an exact accumulation plan, and proof.

    import autotune
    plan = autotune.plan(1024, workload="gpt", device="auto")     # probe, then plan exactly
    result = autotune.run(plan=plan, steps=20)                     # train by it and verify it
    autotune.write_report(result)                                 # reports/gpt-<time>/report.html

Importing this package does nothing but define names; each submodule loads on
first use (the planner, for one, never imports torch). The stages live in
subpackages: workload, devices, probing, planning, training, report, with
their results in results and the public functions in api; integrations adapts
them to the Hugging Face Trainer, Lightning and Accelerate (each optional).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import exports
from .version import __version__

if TYPE_CHECKING:
    from .api import load_plan, memory_snapshot, plan, probe, run
    from .devices import get_device, list_devices
    from .devices.oom import is_oom
    from .errors import (
        AutotuneError,
        BadInput,
        DeviceError,
        DoesNotFit,
        EstimateUnavailable,
        PlanError,
        ProbeFileError,
        ResultFileError,
        WorkloadError,
    )
    from .planning.ramp import RampConfig
    from .report import load_result, write_report
    from .results import Plan, ProbeResult, RunResult, Trial
    from .training import Accumulator, PlanSampler, StepOutcome
    from .units import format_bytes, parse_size
    from .workload import Workload, load_workload

_EXPORTS = {
    # the stages, as users meet them
    "probe": "api", "plan": "api", "run": "api", "load_plan": "api", "memory_snapshot": "api",
    "write_report": "report", "load_result": "report",
    "Workload": "workload", "load_workload": "workload",
    "Accumulator": "training", "PlanSampler": "training", "StepOutcome": "training", "RampConfig": "planning.ramp",
    # their results
    "ProbeResult": "results", "Trial": "results", "Plan": "results", "RunResult": "results",
    # devices and memory sizes
    "get_device": "devices", "list_devices": "devices", "is_oom": "devices.oom",
    "parse_size": "units", "format_bytes": "units",
    # errors
    "AutotuneError": "errors", "BadInput": "errors", "DeviceError": "errors", "DoesNotFit": "errors",
    "EstimateUnavailable": "errors", "PlanError": "errors", "ProbeFileError": "errors",
    "ResultFileError": "errors", "WorkloadError": "errors",
}

__all__ = ["Accumulator", "AutotuneError", "BadInput", "DeviceError", "DoesNotFit", "EstimateUnavailable", "Plan",
    "PlanError", "PlanSampler", "ProbeFileError", "ProbeResult", "RampConfig", "ResultFileError", "RunResult",
    "StepOutcome",
    "Trial", "Workload", "WorkloadError", "format_bytes", "get_device", "is_oom", "list_devices", "load_plan",
    "load_result", "load_workload", "memory_snapshot", "parse_size", "plan", "probe", "run", "write_report",
    "__version__"]


__getattr__ = exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
