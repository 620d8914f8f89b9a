"""What a running service tells its operator: Prometheus metrics (``GET /metrics``) and one access-log
line per request.

Metrics, in the Prometheus text format (``prometheus_client``), in a registry of the service's own:

- ``autotune_requests_total{method,endpoint,status}`` and ``autotune_request_seconds{endpoint}``:
  every request answered (``endpoint`` is the route, e.g. ``/v1/plans/{fingerprint}``; refused ones too);
- ``autotune_plans_total{result}``: plan requests answered from the store (``hit``) or probed (``miss``);
- ``autotune_probe_seconds``: how long a worker took for a plan it probed;
- ``autotune_jobs_queued``, ``autotune_workers_busy``: plan requests waiting for a worker, and workers at work;
- ``autotune_workers_restarted_total``, ``autotune_jobs_cancelled_total``: worker processes started again
  (after a time limit, a hung-up client, a dead worker) and jobs whose clients all went;
- ``autotune_store_errors_total{where}``: store operations that failed in the server or in a worker.

``prometheus_client`` is imported when the service starts, with FastAPI, and never by the command line:
after FastAPI it adds 0.02 s to the start (0.08 s alone, FastAPI 0.37 s; the best of 3 on this 2-core
machine), so a lazy import would save nothing a user waits for. The access log is one JSON object per line on the
``autotune.serve.access`` logger: time, method, path, status, seconds, and for a plan request whether
it came from the store (``cached``) and its ``fingerprint``.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from .guard import Receive, Scope, Send

access = logging.getLogger("autotune.serve.access")

#: Seconds a probe may take, as the histogram's buckets (the default time limit is 600 s).
PROBE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)


class Metrics:
    """The service's metrics; ``pool`` (its workers) is read when they are collected."""

    def __init__(self, pool: Any):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("autotune_requests", "HTTP requests answered, by method, endpoint and status",
                                ("method", "endpoint", "status"), registry=self.registry)
        self.request_seconds = Histogram("autotune_request_seconds", "seconds to answer a request, by endpoint",
                                         ("endpoint",), buckets=REQUEST_BUCKETS, registry=self.registry)
        self.plans = Counter("autotune_plans", "plan requests answered from the store (hit) or probed (miss)",
                             ("result",), registry=self.registry)
        self.probe_seconds = Histogram("autotune_probe_seconds", "seconds a worker took for a plan it probed",
                                       buckets=PROBE_BUCKETS, registry=self.registry)
        self.store_errors = Counter("autotune_store_errors", "store operations that failed (the store could not be "
                                    "reached, read or written), in the server or a worker", ("where",),
                                    registry=self.registry)
        for result in ("hit", "miss"):
            self.plans.labels(result)
        for where in ("server", "worker"):
            self.store_errors.labels(where)
        self.registry.register(_PoolCollector(pool))

    def answered(self, answer: dict[str, Any]) -> None:
        """Count a plan request's answer (and how long its probe took, when it probed)."""
        self.plans.labels("hit" if answer["cached"] else "miss").inc()
        if not answer["cached"] and "seconds" in answer:
            self.probe_seconds.observe(answer["seconds"])

    def exposition(self) -> tuple[bytes, str]:
        """The metrics as Prometheus scrapes them, and their content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PoolCollector:
    """The worker pool's figures, read when the metrics are collected."""

    def __init__(self, pool: Any):
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        pool = self.pool
        yield GaugeMetricFamily("autotune_jobs_queued", "plan requests waiting for a worker", value=pool.waiting)
        yield GaugeMetricFamily("autotune_workers_busy", "workers running a job", value=pool.busy)
        yield CounterMetricFamily("autotune_workers_restarted", "worker processes started again after one was "
                                  "stopped or died", value=pool.restarted)
        yield CounterMetricFamily("autotune_jobs_cancelled", "jobs stopped because every client asking for them "
                                  "hung up", value=pool.cancelled)


class Observe:
    """ASGI middleware, outermost: counts and times every request (refused ones too) and writes its
    access-log line."""

    def __init__(self, app: Any, *, metrics: Metrics, routes: Any):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def sending(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            seconds = time.perf_counter() - start
            endpoint = self._endpoint(scope)
            self.metrics.requests.labels(scope["method"], endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint).observe(seconds)
            if access.isEnabledFor(logging.INFO):
                state = scope.get("state") or {}
                access.info(json.dumps({
                    "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                    "method": scope["method"], "path": scope["path"], "status": status, "seconds": round(seconds, 6),
                    "cached": state.get("cached"), "fingerprint": state.get("fingerprint")}))

    def _endpoint(self, scope: Scope) -> str:
        """The route a request went to (its template), also for one refused before routing; else ``other``."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if getattr(r, "path_regex", None) is not None
                          and r.path_regex.match(scope["path"])), None)
        return str(getattr(route, "path", None) or "other")
