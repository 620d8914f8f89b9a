"""autotune: the largest micro-batch that fits, an exact accumulation plan, and proof.

    import autotune
    plan = autotune.plan(1024, probe="gpt", device="auto")        # probe, then plan exactly
    result = autotune.run(plan=plan, steps=20)                     # train by it and verify it
    autotune.write_report(result)                                 # reports/gpt-<time>/report.html

Importing this package does nothing but define its sixteen names; each submodule
loads on first use (the planner, for one, never imports torch). The stages live in
subpackages: workload, devices, probing, planning, training, report, with their
requests and results in results, their errors in errors, and the public functions
in api; integrations adapts them to the Hugging Face Trainer, Lightning and
Accelerate (each optional).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import exports
from .version import __version__

if TYPE_CHECKING:
    from .api import load_plan, memory_snapshot, plan, probe, run
    from .report import load_result, write_report
    from .results import Plan, ProbeResult, RunResult
    from .results.ramp import RampConfig
    from .results.request import PlanRequest, ProbeRequest
    from .training import Accumulator, PlanSampler
    from .workload import Workload

#: The verbs and the types users hold (16); everything else lives in its stage's package: errors in
#: autotune.errors, devices in autotune.devices, the noise scale in autotune.training, sizes in autotune.units.
_EXPORTS = {
    # the stages, as users meet them
    "probe": "api", "plan": "api", "run": "api", "load_plan": "api", "memory_snapshot": "api",
    "write_report": "report", "load_result": "report",
    # what they are asked and what they give
    "ProbeRequest": "results.request", "PlanRequest": "results.request",
    "ProbeResult": "results", "Plan": "results", "RunResult": "results",
    # your own training loop
    "Workload": "workload", "Accumulator": "training", "PlanSampler": "training", "RampConfig": "results.ramp",
}

__all__ = ["Accumulator", "Plan", "PlanRequest", "PlanSampler", "ProbeRequest", "ProbeResult", "RampConfig",
           "RunResult", "Workload", "load_plan", "load_result", "memory_snapshot", "plan", "probe", "run",
           "write_report", "__version__"]


__getattr__ = exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
