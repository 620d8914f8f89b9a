"""The HTTP service: plans for estimates, answered from a shared plan store.

    POST /v1/plan                       {"target_batch": 1024, "probe": "gpt", "device": "estimate",
                                         "memory_budget": "80GiB"} -> {"plan", "cached", "fingerprint"}
    GET  /v1/plans                      the store's entries
    GET  /v1/plans/{fingerprint}        one entry: its probe result, plans and measurements
    GET  /v1/plans/{fingerprint}/report the HTML memory report of its latest plan
    POST /v1/measurements               what a job measured, against a fingerprint
    GET  /v1/probes                     the probes this service runs
    GET  /healthz                       liveness (without the token: the status alone; HEAD too)
    GET  /metrics                       Prometheus metrics (:mod:`autotune.serve.metrics`)
    GET  /docs, /openapi.json           the API, described by FastAPI

Requests name probes from :class:`~autotune.serve.probes.Catalogue` only and plan
for estimates only (nothing runs on the server's own devices). A plan request
whose settings the store has answered before is answered here, from the store
(:mod:`autotune.serve.stored`); any other runs in a worker process
(:mod:`autotune.serve.worker`), and a plan request whose client
hangs up stops its probe unless another request waits for the same one. A
request's ``Host`` must be a name of the address the service listens on (or one
of ``--allowed-hosts``): a page elsewhere cannot reach a service on 127.0.0.1
through a name of its own (DNS rebinding). With a token, every request but
``/healthz`` needs ``Authorization: Bearer <token>`` (:mod:`autotune.serve.auth`,
FastAPI's security dependency, compared in constant time), and ``/healthz``
without it says only whether the service is up. Bodies over :data:`MAX_BODY`
bytes are refused before they are parsed (:mod:`autotune.serve.guard`). Every
JSON answer is a model of :mod:`autotune.serve.answers`, which /openapi.json
describes; every error is ``{"detail": "one line"}``, but a bad input's 422, whose
``detail`` lists each field at fault as FastAPI does (``loc`` ending with the field,
``msg``, ``input``, ``ctx``: :func:`autotune.serve.jobs.refused`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import options
from ..errors import AutotuneError, BadInput, first_line
from ..store import open_store
from ..store.schema import DamagedEntry, Entry
from ..store.store import StoreUnavailable
from . import answers, stored
from .auth import Bearer
from .bodies import MeasurementRequest, PlanRequest, body_error, implausible, invalid_item
from .guard import Guard
from .jobs import Job, JobFailed, cleaned, failed
from .metrics import Metrics, Observe
from .models import local_spec, named
from .probes import BrokenProbe, Catalogue, UnknownProbe
from .worker import Pool

#: The largest request body accepted, in bytes.
MAX_BODY = 16 * 1024
FINGERPRINT = r"^[0-9a-f]{6,64}$"
_log = logging.getLogger("autotune.serve")
NOT_JSON = "the body is not JSON: send a JSON object with content-type: application/json"


@dataclass
class Settings:
    """How a service runs: its store, probes, token, workers, the time limit of a probe, and the names
    a request's ``Host`` may give (None: any)."""

    store: str
    probes: Catalogue = field(default_factory=Catalogue)
    token: str | None = None
    workers: int = 1
    probe_timeout_s: float = options.PROBE_TIMEOUT_S
    allowed_hosts: frozenset[str] | None = None
    models: tuple[Path, ...] = ()  # folders of model folders a request's model may name


@dataclass
class Service:
    """What a running service's routes share."""

    settings: Settings
    store: Any
    pool: Pool
    from_store: stored.FromStore
    metrics: Metrics
    bearer: Bearer | None


def create_app(settings: Settings) -> FastAPI:
    """The service over ``settings.store``; ``app.state.pool`` runs its probes (its ``shutdown`` ends
    them when the server is told to stop)."""
    import autotune

    store = open_store(settings.store, name="--store")
    pool = Pool(settings.store, settings.workers, timeout_s=settings.probe_timeout_s)
    bearer = Bearer(settings.token) if settings.token else None
    service = Service(settings=settings, store=store, pool=pool, from_store=stored.FromStore(store),
                      metrics=Metrics(pool), bearer=bearer)
    stored.environment()  # what the workers' fingerprints depend on, read once now

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        pool.start()
        service.from_store.start()
        try:
            yield
        finally:
            pool.stop()
            service.from_store.stop()

    app = FastAPI(title="autotune", version=autotune.__version__, lifespan=lifespan,
                  description="Plans micro-batch x accumulation x ranks = exactly the target batch for estimated "
                              "GPUs, from a plan store shared by every job.",
                  openapi_url=None, docs_url=None, redoc_url=None,  # served behind the token: _description_routes
                  responses=answers.errors(421))
    app.state.pool = pool
    app.state.metrics = service.metrics
    app.add_middleware(Guard, max_body=MAX_BODY, hosts=settings.allowed_hosts)
    app.add_middleware(Observe, metrics=service.metrics, routes=app.routes)
    _handlers(app, service.metrics, bearer, _hiding(store))
    # every route but /healthz: behind the token, when the service has one
    routes = APIRouter(dependencies=[Security(bearer)] if bearer else [],
                       responses=answers.errors(401) if bearer else {})
    _plan_route(routes, service)
    _store_routes(routes, service)
    _service_routes(app, routes, service)
    _description_routes(app, routes)
    app.include_router(routes)
    return app


def _plan_route(routes: APIRouter, service: Service) -> None:
    """``POST /v1/plan``: from the store in this process when it can be, else by a worker."""
    store, pool = service.store, service.pool

    @routes.post("/v1/plan", summary="Plan a target batch for an estimated GPU (from the store when it can be)",
                 response_model=answers.PlanAnswer, responses=answers.errors(400, 404, 413, 422, 500, 503, 504))
    async def plan(body: PlanRequest, request: Request) -> Response:
        spec, key, builtin = _workload(service, body)
        answer = None if body.search_settings else await run_in_threadpool(_from_store, service.from_store, key, body)
        if answer is None:
            asked = _asked(body)
            answer = await attend(request, pool, Job({"kind": "plan", "spec": spec, "probe": named(body),
                                                      "builtin": builtin, "request": asked.to_dict(),
                                                      "body": body.model_dump(mode="json")},
                                                     _probes(spec, asked)))
            if answer["fingerprint"] is not None:  # the next request with these settings is answered here
                await run_in_threadpool(store.put, answer["fingerprint"], request=key)
            answer["body"] = stored.render({k: answer[k] for k in ("plan", "cached", "fingerprint")})
        service.metrics.answered(answer)
        request.state.cached, request.state.fingerprint = answer["cached"], answer["fingerprint"]
        return Response(answer["body"], media_type="application/json")  # the answer's JSON, as PlanAnswer says


def _workload(service: Service, body: PlanRequest) -> tuple[str, str, bool]:
    """What a body plans, as a worker loads it (a probe's spec, or a model's), its store key, and whether it is
    a built-in probe (a worker that dies running one is the service's fault)."""
    if body.model is not None:
        spec = _model_spec(body, service.settings.models)
        return spec, stored.model_key(spec, body), False
    probe, function = service.settings.probes.resolve(body.probe)
    return probe.spec(function), stored.request_key(probe, function, body), probe.builtin


def _model_spec(body: PlanRequest, folders: tuple[Path, ...]) -> str:
    """A body's model as a worker loads it (an operator's folder by its name, else the hub); what the library
    refuses in its settings is a 422."""
    try:
        return local_spec(body.model, folders) if body.model is not None else named(body)
    except AutotuneError as exc:
        raise failed(exc, body.model_dump(mode="json")) from None


def _probes(spec: str, asked: Any) -> frozenset[Hashable]:
    """A job's key: one item per probe it runs (each rank's, for ranks that differ), what its store claim
    depends on (the workload, the device, its memory, the fit rule), not which rank asked or how far it searches."""
    return frozenset((spec, p.device, p.memory_budget, p.margin, p.precision, p.rule.parallel, p.rule.world_size,
                      p.rule.fsdp_sync, asked.search)
                     for p in (asked.ranks or (asked.probe,)))


def _asked(body: PlanRequest) -> Any:
    """The library's request for a body; what it refuses is answered as a job's failure would be."""
    try:
        return body.asked()
    except AutotuneError as exc:
        raise failed(exc, body.model_dump(mode="json")) from None


def _store_routes(routes: APIRouter, service: Service) -> None:
    """The store's entries, one entry, its report, and measurements reported."""
    store, from_store = service.store, service.from_store

    @routes.get("/v1/plans", summary="The store's entries, the most recent first",
                responses=answers.errors(422, 503))
    def plans(limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> answers.Entries:
        from_store.flush()  # what this service answered, as it lists the store
        return answers.Entries.model_validate({"plans": [e.to_dict() for e in store.entries(limit=limit)]})

    @routes.get("/v1/plans/{fingerprint}", summary="One entry: its probe result, plans and measurements",
                responses=answers.errors(404, 422, 503))
    def entry(fingerprint: Annotated[str, _fingerprint()]) -> answers.EntryAnswer:
        from_store.flush()
        found = _find(store, fingerprint)
        observed = store.observations(found.fingerprint)
        return answers.EntryAnswer.model_validate({
            "entry": found.to_dict(probe=True), "plans": store.plans(found.fingerprint),
            "measurements": [o.to_dict() for o in observed], "accuracy": store.accuracy(found.fingerprint)})

    @routes.get("/v1/plans/{fingerprint}/report", response_class=HTMLResponse,
                summary="The HTML memory report of an entry's latest plan (or of its probe)",
                responses=answers.errors(*_gate_errors(service), 404, 409, 422, 503, beside="text/html"))
    def report(fingerprint: Annotated[str, _fingerprint()]) -> HTMLResponse:
        from ..report import content, html

        from_store.flush()
        return HTMLResponse(html.render(content.build(_latest(store, _find(store, fingerprint)))))

    @routes.post("/v1/measurements", status_code=201, summary="Record what a job measured against a fingerprint",
                 responses=answers.errors(404, 409, 413, 422, 503))
    def measurements(body: MeasurementRequest) -> answers.Recorded:
        from ..store.schema import Observation

        found = store.get(body.fingerprint)
        if found is None:
            raise HTTPException(404, f"no entry with fingerprint {body.fingerprint[:12]}: report measurements for "
                                     "fingerprints POST /v1/plan returned")
        if not body.oom and body.peak_reserved_bytes is None:
            raise HTTPException(422, "peak_reserved_bytes is needed unless oom is true")
        probed = found.probe()
        if (why := implausible(body, probed)) is not None:
            raise HTTPException(422, why)
        observed = Observation(source="reported", estimated_peak_bytes=probed.predicted_peak_at(body.batch),
                               **body.model_dump())
        (key,) = store.record(observed)
        return answers.Recorded(id=key, estimated_peak_bytes=observed.estimated_peak_bytes, error=observed.error)


def _service_routes(app: FastAPI, routes: APIRouter, service: Service) -> None:
    """The probes served, liveness (open to every request) and metrics."""
    bearer = service.bearer

    @routes.get("/v1/probes", summary="The probes this service runs")
    def probes() -> answers.Probes:
        return answers.Probes(probes=[answers.ServedProbe(name=p.name, builtin=p.builtin, functions=list(p.functions),
                                                          error=p.error) for p in service.settings.probes.all()])

    @app.api_route("/healthz", methods=["GET", "HEAD"],  # HEAD: what some load balancers check with
                   summary="Liveness (in full with the token, or when the service has none)",
             responses={503: {"model": answers.Health | answers.Liveness,
                              "description": "the store cannot be read, or the service is stopping"}})
    async def healthz(request: Request, response: Response) -> answers.Health | answers.Liveness:
        full = bearer is None or await bearer.carries(request)
        answer, response.status_code = await run_in_threadpool(_health, service.store, service.pool, full=full)
        return answer

    @routes.get("/metrics", response_class=PlainTextResponse,
                summary="Prometheus metrics: requests, cache hits and misses, probe seconds, workers, store errors",
                responses=answers.errors(*_gate_errors(service), beside="text/plain"))
    def prometheus() -> Response:
        content, kind = service.metrics.exposition()
        return Response(content, media_type=kind)


def _gate_errors(service: Service) -> tuple[int, ...]:
    """What any route may answer before it runs: 421 (another Host), and 401 with a token."""
    return (401, 421) if service.bearer else (421,)


def _description_routes(app: FastAPI, routes: APIRouter) -> None:
    """``/openapi.json``, ``/docs`` (with Swagger UI's OAuth2 redirect page) and ``/redoc``, as FastAPI
    serves them, but behind the token like every route but ``/healthz`` (FastAPI's own are plain routes,
    which no dependency reaches)."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html

    def root(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    @routes.api_route("/openapi.json", methods=["GET", "HEAD"], include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @routes.api_route("/docs", methods=["GET", "HEAD"], include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=root(request) + "/openapi.json", title=f"{app.title} - Swagger UI",
                                   oauth2_redirect_url=root(request) + "/docs/oauth2-redirect")

    @routes.api_route("/docs/oauth2-redirect", methods=["GET", "HEAD"], include_in_schema=False)
    def docs_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @routes.api_route("/redoc", methods=["GET", "HEAD"], include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=root(request) + "/openapi.json", title=f"{app.title} - ReDoc")


def _from_store(from_store: stored.FromStore, key: str, body: PlanRequest) -> dict[str, Any] | None:
    """:meth:`autotune.serve.stored.FromStore.answer`, its planning errors said as a worker says them."""
    try:
        return from_store.answer(key, body)
    except StoreUnavailable:
        raise
    except AutotuneError as exc:
        raise failed(exc, body.model_dump(mode="json")) from None


def _health(store: Any, pool: Pool, *, full: bool) -> tuple[answers.Health | answers.Liveness, int]:
    """ok (200) or unhealthy (503: the store cannot be read, or the service is stopping), and its status
    code; ``full``: with the version, the store's kind of database, and what the workers are doing."""
    import autotune

    trouble = store.healthy()
    if trouble is not None:  # the operator's log says why; a client is not told where the store is
        _log.warning("autotune serve: unhealthy: %s", trouble)
    problem = ("the store cannot be read now (the server's log says why)" if trouble is not None else
               "the service is stopping" if pool.stopping.is_set() else None)
    status, code = ("ok", 200) if problem is None else ("unhealthy", 503)
    if not full:
        return answers.Liveness(status=status), code
    return answers.Health(status=status, problem=problem, version=autotune.__version__, store=store.engine.dialect.name,
                          store_reopened=store.reopened, workers=len(pool.workers), busy=pool.busy,
                          waiting=pool.waiting, jobs=pool.jobs, cancelled=pool.cancelled), code


def _latest(store: Any, entry: Any) -> Any:
    """What an entry's report shows: its latest readable plan, else its probe result."""
    from ..results.plan import Plan

    for row in store.plans(entry.fingerprint):
        try:
            return Plan.from_dict(row, source="the store")
        except BadInput:  # a plan row changed outside autotune: the next one, or the probe
            continue
    return entry.probe()


def _handlers(app: FastAPI, metrics: Metrics, bearer: Bearer | None, hide: Callable[[str], str]) -> None:
    """One-line answers for bad requests, failed jobs, unknown or broken probes, damaged entries and a
    store that cannot be reached (counted); without the token, 401 alone (:func:`_refusals`). ``hide``
    takes where the store is out of every answer (:func:`_hiding`)."""
    _refusals(app, bearer, hide)

    def _error(status: int, detail: str | list[dict[str, Any]]) -> JSONResponse:
        if isinstance(detail, list):
            return JSONResponse({"detail": [cleaned(item, hide) for item in detail]}, status_code=status)
        return JSONResponse({"detail": hide(detail)}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        if bearer is not None and await bearer.refuses(request):  # read before the token's dependency runs
            return await http_exception_handler(request, bearer.make_not_authenticated_error())
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error(400, NOT_JSON)
        whole = [e for e in errors if tuple(e.get("loc", ())) == ("body",)
                 and e.get("type") in ("missing", "model_attributes_type", "dict_type", "model_type")]
        if whole:
            return _error(422, body_error(whole[0], request.headers.get("content-type")))
        return _error(422, [invalid_item(e) for e in errors])

    @app.exception_handler(JobFailed)
    async def failed(_request: Request, exc: JobFailed) -> JSONResponse:
        if exc.store:
            metrics.store_errors.labels("worker").inc()
        return _error(exc.status, exc.detail or exc.message)

    @app.exception_handler(UnknownProbe)
    async def unknown(_request: Request, exc: UnknownProbe) -> JSONResponse:
        return _error(404, str(exc))

    @app.exception_handler(BrokenProbe)
    async def broken(_request: Request, exc: BrokenProbe) -> JSONResponse:
        return _error(422, str(exc))

    @app.exception_handler(DamagedEntry)
    async def damaged(_request: Request, exc: DamagedEntry) -> JSONResponse:
        return _error(409, str(exc))

    @app.exception_handler(StoreUnavailable)
    async def unavailable(_request: Request, exc: StoreUnavailable) -> JSONResponse:
        metrics.store_errors.labels("server").inc()
        return _error(503, str(exc))

    @app.exception_handler(SQLAlchemyError)
    async def unreachable(_request: Request, exc: SQLAlchemyError) -> JSONResponse:
        metrics.store_errors.labels("server").inc()
        _log.warning("autotune serve: the store cannot be used now: %s", first_line(exc))  # the operator's log
        return _error(503, f"the store cannot be used now ({type(exc).__name__}); the service is fine: try again "
                           "once the database answers")


def _refusals(app: FastAPI, bearer: Bearer | None, hide: Callable[[str], str]) -> None:
    """Without the token, a request is told 401 alone, also where FastAPI answers before the token's
    dependency runs: a path that is no route, a method its route does not take (404, 405), a body that
    is not JSON (400) (see :mod:`autotune.serve.auth`)."""

    @app.exception_handler(StarletteHTTPException)
    async def refused(request: Request, exc: StarletteHTTPException) -> Response:
        if bearer is not None and exc.status_code != 401 and await bearer.refuses(request):
            exc = bearer.make_not_authenticated_error()
        elif exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
            return _error(400, NOT_JSON)  # FastAPI's own words for a body that is not UTF-8 or nests too deep
        elif isinstance(exc.detail, str):
            exc = StarletteHTTPException(exc.status_code, hide(exc.detail), exc.headers)
        return await http_exception_handler(request, exc)


async def attend(request: Request, pool: Pool, job: Job) -> dict[str, Any]:
    """``job``'s answer from ``pool``; once the client hangs up, the job is marked gone (the pool then
    stops it unless another request waits for the same probe)."""
    work = asyncio.ensure_future(run_in_threadpool(pool.run, job))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            job.gone.set()
        return await work
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Return once the client has hung up (the body was read already: the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _fingerprint() -> Any:
    from fastapi import Path

    return Path(pattern=FINGERPRINT, description="a fingerprint, or its first digits (at least 6)")


def _find(store: Any, fingerprint: str) -> Entry:
    """The entry a fingerprint (or its first digits) names (404 when none or several do)."""
    try:
        return store.find(fingerprint)
    except BadInput as exc:
        raise HTTPException(404, str(exc)) from None


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _hiding(store: Any) -> Callable[[str], str]:
    """What takes where the store is (its URL, as given or as shown, and an SQLite file's path and folder) out
    of a text sent to clients: they are told "the store", never a database's host, port or user, nor a path."""
    found = [store.url, store.shown] + ([str(store.file)] if store.file is not None else [])
    secrets = sorted({s for s in found if s}, key=len, reverse=True)
    folder = str(store.file.parent).rstrip("/") + "/" if store.file is not None else None

    def hide(text: str) -> str:
        for secret in secrets:
            text = text.replace(secret, "the store")
        return text.replace(folder, "") if folder and folder != "/" else text

    return hide


