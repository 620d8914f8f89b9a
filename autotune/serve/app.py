"""The HTTP service: plans for estimates, answered from a shared plan store.

    POST /v1/plan                       {"target_batch": 1024, "probe": "gpt", "device": "estimate",
                                         "memory_budget": "80GiB"} -> {"plan", "cached", "fingerprint"}
    GET  /v1/plans                      the store's entries
    GET  /v1/plans/{fingerprint}        one entry: its probe result, plans and measurements
    GET  /v1/plans/{fingerprint}/report the HTML memory report of its latest plan
    POST /v1/measurements               what a job measured, against a fingerprint
    GET  /v1/probes                     the probes this service runs
    GET  /healthz                       liveness (never needs the token)
    GET  /docs, /openapi.json           the API, described by FastAPI

Requests name probes from :class:`~autotune.serve.probes.Catalogue` only and plan
for estimates only (nothing runs on the server's own devices). Probes run in
worker processes (:mod:`autotune.serve.worker`). With a token, every request but
``/healthz`` needs ``Authorization: Bearer <token>``, compared in constant time.
Bodies over :data:`MAX_BODY` bytes are refused before they are parsed.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from .. import options
from ..errors import BadInput
from ..store import open_store
from .probes import Catalogue, UnknownProbe
from .worker import JobFailed, Pool

#: The largest request body accepted, in bytes.
MAX_BODY = 16 * 1024
#: The largest target batch a plan takes (the planner's own limit).
MAX_TARGET = 10**9
FINGERPRINT = r"^[0-9a-f]{6,64}$"
#: Paths that answer without the token.
OPEN_PATHS = ("/healthz",)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass
class Settings:
    """How a service runs: its store, probes, token, workers and the time limit of a probe."""

    store: str
    probes: Catalogue = field(default_factory=Catalogue)
    token: str | None = None
    workers: int = 1
    probe_timeout_s: float = 600.0


class PlanRequest(BaseModel):
    """A plan for an estimated GPU."""

    model_config = ConfigDict(extra="forbid")

    target_batch: Annotated[StrictInt, Field(ge=1, le=MAX_TARGET, description="effective batch, over all ranks")]
    probe: Annotated[str, Field(max_length=129, description="a probe this service runs (GET /v1/probes): NAME or "
                                                            "NAME:FUNCTION")] = "gpt"
    device: Annotated[str, Field(max_length=64, pattern=r"^estimate(:[A-Za-z0-9._-]{1,48})?$",
                                 description="estimate (with memory_budget) or an estimate preset, "
                                             "estimate:NAME")] = "estimate"
    memory_budget: Annotated[str | StrictInt | None, Field(description="the GPU's memory, e.g. 80GiB")] = None
    world_size: Annotated[StrictInt, Field(ge=1, le=65536)] = 1
    parallel: options.Parallel = options.DEFAULT_PARALLEL
    margin: Annotated[float, Field(ge=0, lt=1)] = options.MARGIN
    precision: options.Precision = "fp32"
    multiple_of: Annotated[StrictInt, Field(ge=1, le=MAX_TARGET)] = 1
    uniform: StrictBool | None = None

    @field_validator("memory_budget")
    @classmethod
    def _size(cls, value: str | int | None) -> str | int | None:
        from ..units import parse_size

        if isinstance(value, str) and len(value) > 32:
            raise ValueError("must be a size such as 80GiB (at most 32 characters)")
        if value is not None:
            try:
                bytes_ = parse_size(value, what="memory_budget")
            except BadInput as exc:
                raise ValueError(str(exc)) from None
            if not 0 < bytes_ <= 2**50:
                raise ValueError(f"{value!r} must be between 1 byte and 1 PiB")
        return value


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
    retries: Annotated[StrictInt, Field(ge=0, le=10**6)] = 0
    throughput: Annotated[float | None, Field(ge=0, le=1e12, description="samples per second")] = None
    seconds: Annotated[float | None, Field(ge=0, le=1e9)] = None
    note: Annotated[str | None, Field(max_length=500)] = None

    @field_validator("throughput", "seconds")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


def create_app(settings: Settings) -> FastAPI:
    """The service over ``settings.store``."""
    import autotune

    store = open_store(settings.store, name="--store")
    pool = Pool(settings.store, settings.workers, timeout_s=settings.probe_timeout_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        pool.start()
        try:
            yield
        finally:
            pool.stop()

    app = FastAPI(title="autotune", version=autotune.__version__, lifespan=lifespan,
                  description="Plans micro-batch x accumulation x ranks = exactly the target batch for estimated "
                              "GPUs, from a plan store shared by every job.")
    app.add_middleware(Guard, token=settings.token, max_body=MAX_BODY)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error(400, "the body is not JSON: send a JSON object with Content-Type: application/json")
        return _error(422, "; ".join(_say(e) for e in errors))

    @app.exception_handler(JobFailed)
    async def failed(_request: Request, exc: JobFailed) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(UnknownProbe)
    async def unknown(_request: Request, exc: UnknownProbe) -> JSONResponse:
        return _error(404, str(exc))

    @app.post("/v1/plan", summary="Plan a target batch for an estimated GPU (from the store when it can be)")
    async def plan(body: PlanRequest) -> dict[str, Any]:
        probe, function = settings.probes.resolve(body.probe)
        job = {"kind": "plan", "spec": probe.spec(function), **body.model_dump()}
        answer = await run_in_threadpool(pool.run, job)
        return {"plan": answer["plan"], "cached": answer["cached"], "fingerprint": answer["fingerprint"]}

    @app.get("/v1/plans", summary="The store's entries, the most recent first")
    def plans(limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
        return {"plans": [e.to_dict() for e in store.entries(limit=limit)]}

    @app.get("/v1/plans/{fingerprint}", summary="One entry: its probe result, plans and measurements")
    def entry(fingerprint: Annotated[str, _fingerprint()]) -> Any:
        found = _find(store, fingerprint)
        if isinstance(found, JSONResponse):
            return found
        observed = store.observations(found.fingerprint)
        return {"entry": found.to_dict(probe=True), "plans": store.plans(found.fingerprint),
                "measurements": [o.to_dict() for o in observed], "accuracy": store.accuracy(found.fingerprint)}

    @app.get("/v1/plans/{fingerprint}/report", response_class=HTMLResponse,
             summary="The HTML memory report of an entry's latest plan (or of its probe)")
    def report(fingerprint: Annotated[str, _fingerprint()]) -> Any:
        from ..report import content, html
        from ..results.plan import Plan

        found = _find(store, fingerprint)
        if isinstance(found, JSONResponse):
            return found
        made = store.plans(found.fingerprint)
        result = Plan.from_dict(made[0], source="the store") if made else found.probe()
        return HTMLResponse(html.render(content.build(result)))

    @app.post("/v1/measurements", status_code=201, summary="Record what a job measured against a fingerprint")
    def measurements(body: MeasurementRequest) -> Any:
        from ..store.schema import Observation

        found = store.entry(body.fingerprint)
        if found is None:
            return _error(404, f"no entry with fingerprint {body.fingerprint[:12]}: report measurements for "
                               "fingerprints POST /v1/plan returned")
        if not body.oom and body.peak_reserved_bytes is None:
            return _error(422, "peak_reserved_bytes is needed unless oom is true")
        observed = Observation(source="reported", estimated_peak_bytes=found.probe().predicted_peak_at(body.batch),
                               **body.model_dump())
        (key,) = store.record(observed)
        return {"id": key, "estimated_peak_bytes": observed.estimated_peak_bytes, "error": observed.error}

    @app.get("/v1/probes", summary="The probes this service runs")
    def probes() -> dict[str, Any]:
        return {"probes": [{"name": p.name, "builtin": p.builtin, "functions": list(p.functions)}
                           for p in settings.probes.all()]}

    @app.get("/healthz", summary="Liveness")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "version": autotune.__version__, "store": store.shown,
                "workers": len(pool.workers), "busy": pool.busy, "jobs": pool.jobs}

    return app


def _fingerprint() -> Any:
    from fastapi import Path

    return Path(pattern=FINGERPRINT, description="a fingerprint, or its first digits (at least 6)")


def _find(store: Any, fingerprint: str) -> Any:
    """The entry a fingerprint (or its first digits) names, or the 404 answer."""
    try:
        return store.find(fingerprint)
    except BadInput as exc:
        return _error(404, str(exc))


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _say(error: dict[str, Any]) -> str:
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


class Guard:
    """ASGI middleware: the bearer token (constant-time comparison) and the body size limit,
    both checked before the application sees the request."""

    def __init__(self, app: Any, *, token: str | None, max_body: int):
        self.app = app
        self.token = token.encode() if token else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if self.token is not None and scope.get("path") not in OPEN_PATHS and not self._authorised(headers):
            await _send(send, 401, "missing or wrong bearer token: send Authorization: Bearer <the token in the "
                                   "service's --token-file>", [(b"www-authenticate", b"Bearer")])
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _send(send, 413, f"request body over {self.max_body} bytes: a plan request is a few hundred")
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await _send(send, 413, f"request body over {self.max_body} bytes: a plan request is a few hundred")
                return
        sent = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        assert self.token is not None
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)


async def _send(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
