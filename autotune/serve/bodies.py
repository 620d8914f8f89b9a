"""The service's request bodies, checked by pydantic, and what it says about a bad one.

A value the service suggests in an error is one a request may send: library
messages name Python values (``uniform='force'``), which :func:`in_request_terms`
turns into the request's own JSON (``"uniform": "force"``).
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from .. import options
from ..errors import BadInput
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


class PlanRequest(BaseModel):
    """A plan for an estimated GPU, or for a job whose ranks differ (a device or budget per rank)."""

    model_config = ConfigDict(extra="forbid")

    target_batch: Annotated[StrictInt, Field(ge=1, le=MAX_TARGET, description="effective batch, over all ranks")]
    probe: Annotated[str, Field(max_length=129, description="a probe this service runs (GET /v1/probes): NAME or "
                                                            "NAME:FUNCTION")] = "gpt"
    model: Annotated[ModelBody | None, Field(description="instead of probe: a Hugging Face model on the hub, "
                                                         "built from its config.json")] = None
    device: Annotated[str, Field(max_length=512, pattern=DEVICES,
                                 description="estimate (with memory_budget) or an estimate preset, estimate:NAME; "
                                             "or one per rank, for ranks that differ: "
                                             "estimate:A100-80GB,estimate:T4-16GB (counts: "
                                             "estimate:H100-80GB*4,estimate:A10G-24GB*4)")] = "estimate"
    memory_budget: Annotated[str | StrictInt | None, Field(description="the GPU's memory, e.g. 80GiB; or one per "
                                                                       "rank, e.g. 80GiB,24GiB")] = None
    world_size: Annotated[StrictInt, Field(ge=1, le=65536)] = 1
    parallel: options.Parallel = options.DEFAULT_PARALLEL
    fsdp_sync: Annotated[options.FsdpSync, Field(description="under fsdp, when gradients are reduce-scattered: "
                                                             "every micro-step, the last one, or auto")] = \
        options.DEFAULT_FSDP_SYNC
    margin: Annotated[float, Field(ge=0, lt=1, description="the share of the GPU's memory kept free, taken to "
                                                           f"{MARGIN_DIGITS} decimals (0.12341 is 0.1234): requests "
                                                           "that differ less share one plan")] = options.MARGIN
    precision: Annotated[Literal["fp32"], Field(description="fp32, what the fit rule measures (the only precision "
                                                            "planned)")] = "fp32"
    multiple_of: Annotated[StrictInt, Field(ge=1, le=MAX_TARGET)] = 1
    uniform: Annotated[StrictBool | Literal["force"] | None, Field(
        description="null: the fewest steps; true: equal micro-batches within twice the fewest steps; "
                    "\"force\": equal micro-batches however many steps they take")] = None
    search_settings: Annotated[StrictBool, Field(description="search the settings (ddp or fsdp, checkpointing, "
                                                             "allocator) by estimate; plan the fastest")] = False
    allow: Annotated[str | None, Field(max_length=64, description="with search_settings, settings that change the "
                                                                  "numbers to try too: bf16-mixed,bf16,lora")] = None

    @field_validator("margin")
    @classmethod
    def _rounded(cls, value: float) -> float:
        if round(value, MARGIN_DIGITS) >= 1:
            raise ValueError(f"must be below 1: margins are taken to {MARGIN_DIGITS} decimals, so "
                             f"{1 - 10 ** -MARGIN_DIGITS:.{MARGIN_DIGITS}f} at most")
        return round(value, MARGIN_DIGITS)

    @field_validator("precision", mode="before")
    @classmethod
    def _fp32(cls, value: object) -> object:
        if value != "fp32":
            raise ValueError("the service plans fp32 only (the precision its fit rule measures): send \"fp32\" or "
                             "leave precision out")
        return value

    @field_validator("device", mode="before")
    @classmethod
    def _devices(cls, value: object) -> object:
        if isinstance(value, str) and (len(value) > 512 or not re.fullmatch(DEVICES, value)):
            raise ValueError("must be estimate, estimate:NAME (a preset), or one per rank such as "
                             "estimate:A100-80GB,estimate:T4-16GB (counts: estimate:H100-80GB*4,estimate:A10G-24GB*4)")
        if isinstance(value, str):
            _ranks(value, "device")
        return value

    @field_validator("memory_budget")
    @classmethod
    def _size(cls, value: str | int | None) -> str | int | None:
        if isinstance(value, str) and len(value) > 512:
            raise ValueError("must be a size such as 80GiB, or one per rank such as 80GiB,24GiB (at most 512 "
                             "characters)")
        if value is not None:
            for bytes_ in _ranks(value, "memory_budget"):
                if bytes_ is not None and not 0 < bytes_ <= 2**50:
                    raise ValueError(f"{value!r} must be between 1 byte and 1 PiB")
        return value

    @model_validator(mode="after")
    def _one_workload(self) -> PlanRequest:
        if self.model is not None and "probe" in self.model_fields_set:
            raise ValueError("probe and model each name what to plan: give one of them")
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

        made = plan_request(self.target_batch, workload=named(self), device=self.device,
                            memory_budget=self.memory_budget, margin=self.margin, world_size=world,
                            multiple_of=self.multiple_of, uniform=self.uniform, parallel=self.parallel,
                            fsdp_sync=self.fsdp_sync, env={})
        from ..results.settings import searched

        return searched(made, self.search_settings, self.allow)


def _ranks(value: str | int | None, name: str) -> tuple[Any, ...]:
    """One item per rank of a device or memory_budget as a body gives it (budgets in bytes); ValueError for a
    list the library refuses, or of more than :data:`MAX_RANKS` ranks (counted before any is made)."""
    fix = "a larger job of ranks alike: one device and world_size"
    try:
        if name == "memory_budget":
            return options.memory_budgets(value, name, most=MAX_RANKS, fix=fix)
        return options.per_rank(value, name, most=MAX_RANKS, fix=fix)
    except BadInput as exc:
        raise ValueError(str(exc)) from None


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
            raise ValueError(f"peak_allocated_bytes {allocated} is above peak_reserved_bytes {reserved}: a device "
                             "reserves at least what it allocates (torch.cuda.max_memory_allocated() <= "
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


#: A library's Python spelling of a request field's value: ``uniform='force'``, ``uniform=True``.
_SPELLED = re.compile(r"\b(" + "|".join(PlanRequest.model_fields) + r")=(True|False|None|'[^']*'|-?[0-9][0-9.]*)")


def in_request_terms(message: str) -> str:
    """A library message as a request says it: ``uniform='force'`` is ``"uniform": "force"``,
    ``uniform=True`` is ``"uniform": true``."""

    def say(match: re.Match[str]) -> str:
        value = match.group(2)
        shown = {"True": "true", "False": "false", "None": "null"}.get(value)
        if shown is None:
            shown = json.dumps(value[1:-1]) if value.startswith("'") else value
        return f'"{match.group(1)}": {shown}'

    return _SPELLED.sub(say, message)


def body_error(error: dict[str, Any], content_type: str | None) -> str:
    """What is wrong with the body as a whole: missing, not JSON, or JSON but not an object."""
    if error.get("type") == "missing":
        return f"the body is missing: send a JSON object with content-type: application/json, e.g. {EXAMPLE}"
    if content_type is None or "json" not in content_type.lower():
        return (f"the body must be JSON sent with content-type: application/json (this one came as "
                f"{content_type or 'no content type'}; curl: -H 'content-type: application/json'), e.g. {EXAMPLE}")
    return f"the body must be a JSON object, e.g. {EXAMPLE}"


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
