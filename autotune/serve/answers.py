"""The service's JSON answers as pydantic models: FastAPI checks every answer against its model and
/openapi.json (and so /docs) describes each one.

The fields, their order and their nesting are what the answers always held. Where an answer carries a
result's own JSON (a Plan or ProbeResult, with its ``kind`` and ``schema_version``), the field is that
JSON as it is (``dict[str, Any]``): its format is the result's, described in reports/README.md. A
stored entry's columns are what :meth:`autotune.store.schema.Entry.to_dict` gives; a damaged entry's
whole-number columns hold what the row holds, whatever it is (the entry says why in ``damaged``).
Every model forbids fields it does not name, so an answer that gained or lost one fails its checks
instead of changing unseen.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


class Answer(BaseModel):
    """What every answer's model shares: no field it does not name."""

    model_config = ConfigDict(extra="forbid")


class Invalid(Answer):
    """One bad input, as FastAPI gives its own: ``loc`` ending with the field, ``msg`` (one line naming it: what
    failed, the numbers, the fix), ``input`` (what was sent), ``ctx`` (the limit or choices, and the fix)."""

    type: str
    loc: list[str | int]
    msg: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class Error(Answer):
    """Every error: one line saying what failed, the numbers, and the fix; a bad input (422) lists each field
    at fault instead, as an :class:`Invalid`."""

    detail: str | list[Invalid]


class PlanAnswer(Answer):
    """A plan for the request (Plan JSON), whether the store answered it, and its probe's fingerprint."""

    plan: dict[str, Any]
    cached: bool
    fingerprint: str | None


#: A whole-number column of a stored entry (in a damaged entry, what its row holds instead).
Whole = Annotated[int | float | str, Field(description="a whole number (in a damaged entry: what its row holds)")]


class Entry(Answer):
    """A stored probe result and what is known about it (``damaged``: why its row cannot be read back)."""

    fingerprint: str
    workload: str
    device: str
    device_kind: str
    estimated: bool
    max_micro_batch: Whole
    max_batch: Whole
    limited_by: str
    created_at: float
    measured: str
    hits: Whole
    last_hit_at: float | None
    valid: bool
    invalidated_at: float | None
    invalid_reason: str | None
    damaged: str | None
    autotune_version: str
    components: dict[str, Any]


class EntryWithProbe(Entry):
    """A stored entry with its probe result (ProbeResult JSON; null for a damaged entry)."""

    probe: dict[str, Any] | None


class Entries(Answer):
    """The store's entries, the most recent first."""

    plans: list[Entry]


class Measurement(Answer):
    """What one real run measured against a fingerprint (``error``: measured vs estimated peak)."""

    fingerprint: str
    source: str
    device: str
    device_kind: str
    batch: int
    peak_reserved_bytes: int | None
    peak_allocated_bytes: int | None
    estimated_peak_bytes: int | None
    oom: bool
    runs_before: int
    throughput: float | None
    seconds: float | None
    note: str | None
    recorded_at: float | None
    id: int | None
    error: float | None


class Accuracy(Answer):
    """Per device: how far the estimates were from what real runs measured."""

    device: str
    kind: str
    measurements: int
    ooms: int
    compared: int
    mean_error: float | None
    mean_abs_error: float | None
    worst_error: float | None
    allocated_mean_error: float | None
    ooms_estimated_to_fit: int


class EntryAnswer(Answer):
    """One entry: its probe result, the plans made from it (Plan JSON, the most recent first), the
    measurements reported against it and the estimate's accuracy per device."""

    entry: EntryWithProbe
    plans: list[dict[str, Any]]
    measurements: list[Measurement]
    accuracy: list[Accuracy]


class Recorded(Answer):
    """A measurement kept: its id, the estimate's peak for its micro-batch, and how far it was off."""

    id: int
    estimated_peak_bytes: int | None
    error: float | None


class ServedProbe(Answer):
    """A probe a request may name: its name, whether it is built in, the functions it offers, and why its
    file cannot be read, if it cannot."""

    name: str
    builtin: bool
    functions: list[str]
    error: str | None


class Probes(Answer):
    """The probes this service runs."""

    probes: list[ServedProbe]


class Liveness(Answer):
    """Whether the service is up (``ok``) or not (``unhealthy``), as told to a request without the token."""

    status: str


class Health(Answer):
    """Liveness in full: why it is unhealthy, the version, the store, and what the workers are doing."""

    status: str
    problem: str | None
    version: str
    store: Annotated[str, Field(description="the store's kind of database: sqlite or postgresql (never where it is)")]
    store_reopened: int
    workers: int
    busy: int
    waiting: int
    jobs: int
    cancelled: int


#: What the errors below mean, for the API's description.
MEANING = {
    400: "the body is not JSON", 401: "no token, or the wrong one", 404: "no such entry or probe",
    409: "the entry is damaged", 413: "the body is over 16 KB", 421: "the Host header names another service",
    422: "the request is not one this endpoint takes", 500: "the probe failed or its worker died",
    503: "the store cannot be used now, or the service is stopping", 504: "the probe ran past its time limit",
}


def errors(*statuses: int, beside: str | None = None) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that answers these error statuses, each an :class:`Error`. ``beside``:
    the media type of the route's own answer when it is not JSON (an HTML report, Prometheus' text), under
    which FastAPI would describe the errors too: they are described as JSON, by reference, instead."""
    if beside is None:
        return {status: {"model": Error, "description": MEANING[status]} for status in statuses}
    json = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {status: {"description": MEANING[status], "content": json} for status in statuses}
