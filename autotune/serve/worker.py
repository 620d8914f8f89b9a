"""Worker processes: where the service runs probes, one at a time each, with a time limit.

torch (and a probe's own code) never runs in the server process: each worker is
a process of its own, which plans through the API with the store, one job at a
time. Workers are forked from a ``forkserver`` process that imported torch and
autotune once (and runs nothing): a worker that replaces a stopped or dead one
is ready at once, and the workers share those modules' memory. A job that runs
past its time limit has its worker stopped (and the store claims it held
dropped); a worker that dies takes no request with it but its own, which gets
its one-line error. The next job starts a fresh worker. Concurrent jobs for the
same fingerprint probe once: the store's claims make the others wait for the
answer (see :meth:`autotune.store.Store.single_flight`).
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ..errors import AutotuneError, BadInput, DoesNotFit, EstimateUnavailable

#: Seconds a new worker may take to import torch and autotune before it counts as broken.
START_S = 120.0
#: How worker processes start, and what the forkserver imports before it forks them.
START_METHOD = "forkserver"
PRELOAD = ["autotune.api", "torch._dynamo"]


class JobFailed(Exception):
    """A job that did not give a plan: the HTTP status to answer with and one line saying why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def status_of(exc: BaseException) -> int:
    """The HTTP status for an error of a job: 422 for what the request asked (a budget, a probe
    function, a plan that cannot exist, a workload that does not fit or cannot be estimated),
    500 for a failure of the work."""
    if isinstance(exc, (BadInput, DoesNotFit, EstimateUnavailable)):
        return 422
    return 500


def run_job(job: dict[str, Any], store_url: str) -> dict[str, Any]:
    """One job, in a worker: a plan through the API and the store."""
    from dataclasses import replace

    from .. import api

    if job["kind"] != "plan":
        raise BadInput(f"unknown job {job['kind']!r}")
    if job["precision"] != "fp32":
        raise BadInput(f"precision {job['precision']!r} cannot be planned: the fit rule measures fp32 (leave "
                       f"precision out, or 'fp32')")
    plan = api.plan(job["target_batch"], workload=job["spec"], device=job["device"],
                    memory_budget=job["memory_budget"], margin=job["margin"], world_size=job["world_size"],
                    multiple_of=job["multiple_of"], uniform=job["uniform"], parallel=job["parallel"], store=store_url,
                    env={})
    probe = plan.probe
    assert probe is not None
    plan = replace(plan, probe=replace(probe, source=job["probe"]))  # the name asked for, not a path here
    return {"plan": plan.to_dict(), "cached": probe.from_store, "fingerprint": probe.fingerprint}


def _main(conn: Connection, store_url: str) -> None:
    """A worker's life: import, say it is ready, then answer jobs until the server goes."""
    import signal

    import autotune.api  # noqa: F401  (torch and the stages load here, before the first job's clock starts)

    from ..devices.base import _load_dispatch_machinery

    _load_dispatch_machinery()  # PyTorch's compiler stack, which the first traced op would load
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops its workers

    conn.send({"ready": True})
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        try:
            answer = {"ok": True, **run_job(job, store_url)}
        except AutotuneError as exc:
            answer = {"ok": False, "status": status_of(exc), "error": _one_line(str(exc))}
        except Exception as exc:  # the probe's own code, or a bug: the request gets it, the worker lives
            answer = {"ok": False, "status": 500, "error": _one_line(f"{type(exc).__name__}: {exc}")}
        except SystemExit as exc:
            answer = {"ok": False, "status": 500, "error": f"the probe called exit({exc.code})"}
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else text


class Worker:
    """One worker process, started when first needed and again after it was stopped or died."""

    def __init__(self, store_url: str, index: int):
        self.store_url = store_url
        self.index = index
        self.process: Any = None
        self.conn: Connection | None = None
        self.ready = False

    def start(self) -> None:
        context: Any = multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            context.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (with the first worker)
        mine, theirs = context.Pipe()
        self.process = context.Process(target=_main, args=(theirs, self.store_url), daemon=True,
                                       name=f"autotune-worker-{self.index}")
        self.process.start()
        theirs.close()
        self.conn = mine
        self.ready = False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def run(self, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The job's answer; JobFailed when it failed, timed out (the worker is stopped) or the worker died."""
        if not self.alive:
            self.stop()
            self.start()
        assert self.conn is not None
        if not self._ready():
            what = self._ended()
            raise JobFailed(500, f"the probe worker did not start ({what}); see the server's log")
        self.conn.send(job)
        if not self.conn.poll(timeout_s):
            self.stop()
            raise JobFailed(504, f"probe {job['probe']!r} ran past the {timeout_s:g} s limit (--probe-timeout) "
                                 "and was stopped; the service is fine, the next request starts a new worker")
        try:
            answer = self.conn.recv()
        except (EOFError, OSError):
            what = self._ended()
            raise JobFailed(500, f"the probe worker died ({what}) while planning {job['probe']!r}; the next "
                                 "request starts a new worker") from None
        if not answer["ok"]:
            raise JobFailed(answer["status"], answer["error"])
        return answer

    def _ready(self) -> bool:
        """Wait for the worker's first message (it imports torch first)."""
        assert self.conn is not None
        if not self.ready:
            try:
                self.ready = bool(self.conn.poll(START_S) and self.conn.recv().get("ready"))
            except (EOFError, OSError):
                self.ready = False
        return self.ready

    def _ended(self) -> str:
        if self.process is None:
            return "not started"
        self.process.join(2)
        code = self.process.exitcode
        self.stop()
        if code is None:
            return "no answer"
        return f"exit code {code}" if code >= 0 else f"signal {-code}"

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and drop the store claims it held."""
        process, self.process = self.process, None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if process is None:
            return
        pid = process.pid
        if process.is_alive():
            process.terminate()
            process.join(3)
            if process.is_alive():
                process.kill()
                process.join(3)
        if pid is not None:
            _release_claims(self.store_url, pid)


def _release_claims(store_url: str, pid: int) -> None:
    from ..store import open_store

    try:
        open_store(store_url).release_all(f"{socket.gethostname()}:{pid}:")
    except Exception:  # the store will take the claim over anyway once it sees the process gone
        pass


class Pool:
    """``size`` workers; a job waits for a free one (at most ``queue_limit`` jobs wait)."""

    def __init__(self, store_url: str, size: int = 1, *, timeout_s: float, queue_limit: int = 32):
        self.timeout_s = timeout_s
        self.queue_limit = queue_limit
        self.workers = [Worker(store_url, i) for i in range(size)]
        self._idle: queue.Queue[Worker] = queue.Queue()  # a worker joins it once started
        self._started = 0
        self._starter: threading.Thread | None = None
        self._waiting = 0
        self._lock = threading.Lock()
        self.jobs = 0

    def start(self) -> None:
        """Start the workers in the background (the first waits for the forkserver to import torch, seconds):
        the service answers at once, and a job waits for a started worker."""

        def start_all() -> None:
            for w in self.workers:
                try:
                    w.start()
                except Exception:  # a job on this worker tries again and answers with why it cannot start
                    w.stop()
                with self._lock:
                    self._started += 1
                self._idle.put(w)

        self._starter = threading.Thread(target=start_all, name="autotune-worker-start", daemon=True)
        self._starter.start()

    @property
    def busy(self) -> int:
        with self._lock:
            return self._started - self._idle.qsize()

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._waiting >= self.queue_limit:
                raise JobFailed(503, f"{self._waiting} plan requests are waiting for a worker already: try again "
                                     "later (or start the service with more --workers)")
            self._waiting += 1
        try:
            worker = self._idle.get()
        finally:
            with self._lock:
                self._waiting -= 1
        try:
            self.jobs += 1
            start = time.perf_counter()
            answer = worker.run(job, self.timeout_s)
            answer["seconds"] = time.perf_counter() - start
            return answer
        finally:
            self._idle.put(worker)

    def stop(self) -> None:
        if self._starter is not None:
            self._starter.join()
        for w in self.workers:
            w.stop()
