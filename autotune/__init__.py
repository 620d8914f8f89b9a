"""autotune: the largest micro-batch that fits, an exact accumulation plan, and proof.

    import autotune
    plan = autotune.plan(1024, workload="gpt", device="auto")     # probe, then plan exactly
    result = autotune.run(plan=plan, steps=20)                     # train by it and verify it
    autotune.write_report(result)                                 # reports/gpt-<time>/report.html

Importing this package does nothing but define names; each submodule loads on
first use (the planner, for one, never imports torch).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # errors
    "AutotuneError": "errors", "BadInput": "errors", "DeviceError": "errors", "DoesNotFit": "errors",
    "PlanError": "errors", "ProbeFileError": "errors", "ResultFileError": "errors",
    "VerificationFailed": "errors", "WorkloadError": "errors",
    # memory
    "parse_size": "units", "format_bytes": "units", "is_oom": "devices.oom", "LiveStorageTracker": "devices.tracker",
    "get_device": "devices", "list_devices": "devices",
    # stages
    "Workload": "workload", "load_workload": "workload",
    "probe": "api", "ProbeResult": "results",
    "make_plan": "planning", "Plan": "planning",
    "item_weight": "workload", "Accumulator": "training", "split_batch": "workload", "PlanSampler": "training",
    "RunResult": "results", "run_plan": "training",
    "plan": "api", "run": "api", "load_plan": "api",
    "write_report": "report", "load_result": "report",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
