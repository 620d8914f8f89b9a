"""The result a report is about: a RunResult, a Plan or a ProbeResult, unpacked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BadInput
from ..results.device import DeviceInfo
from ..results.plan import Plan
from ..results.probe import ProbeResult
from ..results.run import RunResult


@dataclass(frozen=True)
class Subject:
    """The result a report is about, with the stages inside it unpacked."""

    result: Any
    run: RunResult | None
    plan: Plan | None
    probe: ProbeResult | None

    @classmethod
    def of(cls, result: Any) -> Subject:
        if isinstance(result, RunResult):
            return cls(result, result, result.plan, result.plan.probe)
        if isinstance(result, Plan):
            return cls(result, None, result, result.probe)
        if isinstance(result, ProbeResult):
            return cls(result, None, None, result)
        raise BadInput(f"a report is made from a Plan, RunResult or ProbeResult, not {type(result).__name__}")

    @property
    def kind(self) -> str:
        return type(self.result).__name__

    @property
    def json_name(self) -> str:
        return {"RunResult": "result.json", "Plan": "plan.json", "ProbeResult": "probe.json"}[self.kind]

    @property
    def name(self) -> str:
        if self.run is not None:
            return self.run.workload
        return self.probe.workload if self.probe is not None else "plan"

    @property
    def chosen(self) -> int:
        if self.plan is not None:
            return self.plan.micro_batch
        assert self.probe is not None  # a subject is a plan or a probe result, at least
        return self.probe.max_micro_batch

    @property
    def device(self) -> DeviceInfo | None:
        if self.run is not None:
            return self.run.device
        return self.probe.device if self.probe is not None else None


def status(probe: ProbeResult) -> str:
    return "estimated with fake tensors, not confirmed on a real device" if probe.estimated \
        else "confirmed by a real run"
