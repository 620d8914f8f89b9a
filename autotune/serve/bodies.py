"""The service's request bodies, checked by pydantic, and what it says about a bad one.

A bad setting is answered as FastAPI answers its own (a 422 whose ``detail`` lists
items with ``loc`` ending with the field, ``msg``, ``input`` and ``ctx``); a
library check's error is data (:class:`autotune.errors.BadInput`), said in the
request's own terms (``"uniform": "force"``) by :func:`autotune.serve.jobs.refused`.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    create_model,
    field_validator,
    model_validator,
)

from .. import options
from ..errors import BadInput
from ..results.settings import Setting, settings_of
from .fields import body_field
from .jobs import refused
from .models import ModelBody

if TYPE_CHECKING:
    from ..results.request import PlanRequest as Asked

#: The largest target batch a plan takes (the planner's own limit).
MAX_TARGET = options.MAX_TARGET_BATCH
#: The most ranks a device or memory_budget list may name (each rank is a row of the mixed plan's answer).
MAX_RANKS = 1024
#: One estimate device of a request, with a count of ranks (``estimate:H100-80GB*4``).
_ESTIMATE = r"estimate(:[A-Za-z0-9._-]{1,48})?(\*[0-9]{1,5})?"
#: The devices of a request: one estimate for every rank, or one per rank (``A,B``; ``A*4,B*4``).
DEVICES = rf"^{_ESTIMATE}(, ?{_ESTIMATE})*$"
#: The decimals a margin is taken to: margins that differ less are one plan (and one entry of the store).
MARGIN_DIGITS = 4
#: An example body, for errors about the body itself.
EXAMPLE = '{"target_batch": 1024, "probe": "gpt", "device": "estimate", "memory_budget": "80GiB"}'


class PlanBody(BaseModel):
    """A plan for an estimated GPU, or for a job whose ranks differ (a device or budget per rank).

    Its fields are the plan settings the service shows (:mod:`autotune.results.settings`), made into
    :class:`PlanRequest` by :func:`plan_body`; the checks here are what the service asks beyond the library's."""

    model_config = ConfigDict(extra="forbid")

    if TYPE_CHECKING:  # the fields plan_body declares
        target_batch: int
        probe: str
        model: ModelBody | None
        device: str
        memory_budget: str | int | None
        margin: float
        world_size: int
        parallel: options.Parallel
        fsdp_sync: options.FsdpSync
        precision: Literal["fp32"]
        multiple_of: int
        uniform: bool | Literal["force"] | None
        uniform_ranks: bool
        search_settings: bool
        allow: str | None

    @field_validator("margin", check_fields=False)
    @classmethod
    def _rounded(cls, value: float) -> float:
        if round(value, MARGIN_DIGITS) >= 1:
            most = round(1 - 10 ** -MARGIN_DIGITS, MARGIN_DIGITS)
            raise BadInput(f"must be below 1 (margins are taken to {MARGIN_DIGITS} decimals)", field="margin",
                           value=value, limit=most, fix=f"give {most:.{MARGIN_DIGITS}f} at most")
        return round(value, MARGIN_DIGITS)

    @field_validator("precision", mode="before", check_fields=False)
    @classmethod
    def _fp32(cls, value: object) -> object:
        if value != "fp32":
            raise BadInput("is not planned here: the service plans fp32 only (the precision its fit rule measures)",
                           field="precision", value=value, choices=("fp32",),
                           fix="send {precision='fp32'} or leave {precision} out")
        return value

    @field_validator("uniform", mode="before", check_fields=False)
    @classmethod
    def _uniform(cls, value: object) -> object:
        if not (value is None or isinstance(value, bool) or value == "force"):
            raise BadInput('must be true, false, null or "force"', field="uniform", value=value,
                           choices=(True, False, None, "force"))
        return value

    @field_validator("memory_budget", mode="before", check_fields=False)
    @classmethod
    def _sized(cls, value: object) -> object:
        if not (value is None or isinstance(value, str) or type(value) is int):
            raise BadInput("is not a size", field="memory_budget", value=value,
                           fix="give one such as \"80GiB\", a number of bytes, or one per rank such as \"80GiB,24GiB\"")
        return value

    @field_validator("device", mode="before", check_fields=False)
    @classmethod
    def _devices(cls, value: object) -> object:
        if isinstance(value, str) and (len(value) > 512 or not re.fullmatch(DEVICES, value)):
            raise BadInput("is not a device this service plans for", field="device", value=value[:60],
                           fix="give estimate, estimate:NAME (a preset), or one per rank such as "
                               "estimate:A100-80GB,estimate:T4-16GB (counts: estimate:H100-80GB*4,"
                               "estimate:A10G-24GB*4)")
        if isinstance(value, str):
            _ranks(value, "device")
        return value

    @field_validator("memory_budget", check_fields=False)
    @classmethod
    def _size(cls, value: str | int | None) -> str | int | None:
        if isinstance(value, str) and len(value) > 512:
            raise BadInput("is longer than 512 characters", field="memory_budget", value=value[:60], limit=512,
                           fix="give a size such as 80GiB, or one per rank such as 80GiB,24GiB")
        if value is not None:
            for bytes_ in _ranks(value, "memory_budget"):
                if bytes_ is not None and not 0 < bytes_ <= 2**50:
                    raise BadInput("must be between 1 byte and 1 PiB", field="memory_budget", value=value,
                                   limit=2**50)
        return value

    @model_validator(mode="after")
    def _one_workload(self) -> PlanBody:
        if self.model is not None and "probe" in self.model_fields_set:
            raise BadInput("{probe} and {model} each name what to plan", field="model",
                           fix="give one of them")
        return self

    def listed(self) -> bool:
        """Whether the body names a device or a budget per rank (ranks that may differ)."""
        return max(len(_ranks(self.device, "device")), len(_ranks(self.memory_budget, "memory_budget"))) > 1

    def asked(self) -> Asked:
        """The library's request for this body (every rule checked there; the body's own checks are the
        JSON's): the plan store's fingerprint and the worker take it."""
        from ..planning.requests import plan_request

        world = None if self.listed() and "world_size" not in self.model_fields_set else self.world_size
        from .models import named

        return plan_request(self.target_batch, probe=named(self), device=self.device,
                            memory_budget=self.memory_budget, margin=self.margin, world_size=world,
                            multiple_of=self.multiple_of, uniform=self.uniform, uniform_ranks=self.uniform_ranks,
                            parallel=self.parallel, fsdp_sync=self.fsdp_sync,
                            search_settings=self.search_settings, allow=self.allow, env={})


#: What the service's body says beyond a declaration: strict JSON types where the type alone is not one, the
#: devices it estimates, how it rounds a margin, and the model (a nested body).
SERVICE: dict[str, dict[str, Any]] = {
    "memory_budget": {"annotation": str | StrictInt | None},
    "uniform": {"annotation": StrictBool | Literal["force"] | None},
    "model": {"annotation": ModelBody | None,
              "description": "instead of probe: a Hugging Face model on the hub, built from its config.json"},
    "device": {"pattern": DEVICES},
    "margin": {"description": f"the share of the GPU's memory kept free, taken to {MARGIN_DIGITS} decimals (0.12341 "
                              "is 0.1234): requests that differ less share one plan"},
}


def plan_body(declared: tuple[Setting, ...] | None = None) -> type[PlanBody]:
    """The body of a plan request: a field for each plan setting the service shows, as declared."""
    shown = settings_of("plan", "service", declared)
    fields: dict[str, Any] = {s.name: body_field(s, SERVICE.get(s.name)) for s in shown}
    return create_model("PlanRequest", __base__=PlanBody, __module__=__name__, **fields)


if TYPE_CHECKING:
    PlanRequest = PlanBody
else:
    PlanRequest = plan_body()


def _ranks(value: str | int | None, name: str) -> tuple[Any, ...]:
    """One item per rank of a device or memory_budget as a body gives it (budgets in bytes); BadInput for a
    list the library refuses, or of more than :data:`MAX_RANKS` ranks (counted before any is made)."""
    if name == "memory_budget":
        return options.memory_budgets(value, name, most=MAX_RANKS)
    return options.per_rank(value, name, most=MAX_RANKS)


class MeasurementRequest(BaseModel):
    """What a job measured with a plan, reported against its fingerprint."""

    model_config = ConfigDict(extra="forbid")

    fingerprint: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    device: Annotated[str, Field(min_length=1, max_length=200, description="the GPU model, e.g. NVIDIA H100")]
    device_kind: Literal["cuda", "cpu"] = "cuda"
    batch: Annotated[StrictInt, Field(ge=1, le=MAX_TARGET, description="the micro-batch that ran")]
    peak_reserved_bytes: Annotated[StrictInt | None, Field(ge=0, le=2**60)] = None
    peak_allocated_bytes: Annotated[StrictInt | None, Field(ge=0, le=2**60)] = None
    oom: StrictBool = False
    runs_before: Annotated[StrictInt, Field(ge=0, le=10**6, validation_alias=AliasChoices("runs_before", "retries"),
                                            description="real runs before this one (its former name: retries)")] = 0
    throughput: Annotated[float | None, Field(ge=0, le=1e12, description="samples per second")] = None
    seconds: Annotated[float | None, Field(ge=0, le=1e9)] = None
    note: Annotated[str | None, Field(max_length=500)] = None

    @field_validator("throughput", "seconds")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("peak_reserved_bytes", "peak_allocated_bytes")
    @classmethod
    def _measured(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("0 bytes is not a peak a job ran with: report torch.cuda.max_memory_reserved() (and "
                             "max_memory_allocated()) after its steps, or \"oom\": true with no peak")
        return value

    @field_validator("device", "note")
    @classmethod
    def _plain(cls, value: str | None) -> str | None:
        return None if value is None else plain(value)

    @field_validator("device")
    @classmethod
    def _real(cls, value: str) -> str:
        if value.strip().lower().startswith("estimate"):
            raise ValueError(f"device {value!r} is an estimate, which measures nothing and never runs out of "
                             "memory: report runs on a real device, named as it names itself (e.g. NVIDIA H100 "
                             "80GB HBM3)")
        return value

    @model_validator(mode="after")
    def _plausible(self) -> MeasurementRequest:
        reserved, allocated = self.peak_reserved_bytes, self.peak_allocated_bytes
        if reserved is not None and allocated is not None and allocated > reserved:
            raise BadInput(f"is above {{peak_reserved_bytes}} {reserved}", field="peak_allocated_bytes",
                           value=allocated, limit=reserved,
                           fix="a device reserves at least what it allocates (torch.cuda.max_memory_allocated() <= "
                               "max_memory_reserved())")
        return self


#: Unicode categories a client's text may not hold: controls (ESC, DEL, C1), formats (bidi overrides, zero
#: widths), line and paragraph separators, surrogates. Printed to a terminal or a page they act, not show.
_NOT_TEXT = ("Cc", "Cf", "Zl", "Zp", "Cs")


def plain(value: str) -> str:
    """``value`` when it is plain text; ValueError naming the first control character and where it is."""
    for at, ch in enumerate(value):
        if unicodedata.category(ch) in _NOT_TEXT:
            raise ValueError(f"must be plain text: it holds the control character U+{ord(ch):04X} at position {at}; "
                             "send the text without control characters (terminal escapes, tabs, new lines)")
    return value


def implausible(body: MeasurementRequest, probed: Any) -> str | None:
    """Why a reported measurement cannot be one of the entry's device, or None."""
    from ..units import format_bytes

    device = probed.device
    planned = "cpu" if device.kind == "cpu" or (device.kind == "estimate" and device.cuda_like is False) else "cuda"
    if body.device_kind != planned:
        return (f"device_kind {body.device_kind!r} is not the kind of device the entry planned for ({planned}: "
                f"{device.summary}): report runs on that kind of device, or plan for this one first")
    total = device.total_bytes or (device.ram_total_bytes if device.kind == "cpu" else None) or probed.capacity_bytes
    for name in ("peak_reserved_bytes", "peak_allocated_bytes"):
        value = getattr(body, name)
        if value is not None and value > total:
            return (f"{name} {value} ({format_bytes(value)}) is above the {format_bytes(total)} the entry's device "
                    f"has ({device.summary}): report what the job measured on that device, in bytes")
    return None


def body_error(error: dict[str, Any], content_type: str | None) -> str:
    """What is wrong with the body as a whole: missing, not JSON, or JSON but not an object."""
    if error.get("type") == "missing":
        return f"the body is missing: send a JSON object with content-type: application/json, e.g. {EXAMPLE}"
    if content_type is None or "json" not in content_type.lower():
        return (f"the body must be JSON sent with content-type: application/json (this one came as "
                f"{content_type or 'no content type'}; curl: -H 'content-type: application/json'), e.g. {EXAMPLE}")
    return f"the body must be a JSON object, e.g. {EXAMPLE}"


def invalid_item(error: dict[str, Any]) -> dict[str, Any]:
    """One pydantic error as an item of the 422's ``detail`` list: its ``loc``, ``type`` and ``input`` as pydantic
    gives them, ``msg`` one clause naming the field; a library check's error (a BadInput) as its data says it."""
    cause = (error.get("ctx") or {}).get("error")
    loc = tuple(error.get("loc", ()))
    if isinstance(cause, BadInput):
        return refused(cause, loc, error.get("input"))
    given = json.loads(json.dumps(error.get("input"), default=repr))
    item = {"type": error.get("type", "value_error"), "loc": list(loc), "msg": say(error), "input": given}
    ctx = {k: v for k, v in (error.get("ctx") or {}).items() if isinstance(v, (int, float, str, bool))}
    return item | ({"ctx": ctx} if ctx else {})


def say(error: dict[str, Any]) -> str:
    """One pydantic error as one clause: where, what was given, what is wrong."""
    where = ".".join(str(part) for part in error.get("loc", ()) if part not in ("body", "query", "path"))
    given = error.get("input")
    shown = json.dumps(given)[:60] if isinstance(given, (int, float, str, bool)) or given is None else "…"
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if error.get("type") == "missing":
        return f"{where} is missing"
    if error.get("type") == "extra_forbidden":
        return f"{where} is not a field this endpoint takes"
    if message.startswith(where):  # our own checks say it already
        return message
    return f"{where} {shown}: {message}"
