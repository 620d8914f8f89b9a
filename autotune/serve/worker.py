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
answer (see :meth:`autotune.store.Store.claim`); a worker tells its server whose
claim it waits for, and a request that waits past its time limit is told so.

A worker ends with its server, however the server ended (``kill -9`` too): it
watches a pipe whose other end only the server holds, and once that pipe closes
it drops the store claims it holds and exits, whatever its probe is doing. Its
claim's heartbeat is a thread of it, so nothing renews the claim after that, and
the forkserver, which lives while a worker lives, exits with the last one.

A job ends early, its worker stopped the same way, when every client that asked
for its probe has gone (a job whose own client went runs on while another
request that needs one of its probes waits: that request takes its answer from the
store), and when the service is told to stop (:meth:`Pool.shutdown`): the
request is answered 503 within a few seconds instead of when the probe ends.

Workers run at a lower CPU priority than the server (:data:`NICE`): where CPUs are short, a probe
takes what the server leaves, and a request the store answers is not slowed by probes of others.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..store.claims import owner_words
from .jobs import Job, JobFailed, answer

#: Seconds a new worker may take to import torch and autotune before it counts as broken.
START_S = 120.0
#: How worker processes start, and what the forkserver imports before it forks them.
START_METHOD = "forkserver"
PRELOAD = ["autotune.api", "torch._dynamo"]
#: How often a request waiting for a worker or a probe looks whether its client has gone or the service stops.
POLL_S = 0.1
#: How much lower than the server's a worker's CPU priority is (``nice``): under load, answers from the store
#: in the server come before probes.
NICE = 10
#: The status of a job whose every client has gone (nginx's "client closed request"): no one reads it.
GONE = 499
#: Seconds a worker whose server is gone may take to drop its store claims before it exits anyway.
RELEASE_S = 5.0
STOPPING = "the service is stopping: this request's probe was stopped; send it again once the service is back"


def _main(conn: Connection, life: Connection, store_url: str) -> None:
    """A worker's life: import, say it is ready, then answer jobs until the server goes (``life`` closes
    then, and :func:`_end_with_server` ends the worker even in the middle of a probe)."""
    import signal

    threading.Thread(target=_end_with_server, args=(life, store_url), name="autotune-server-watch",
                     daemon=True).start()
    os.nice(NICE)  # a probe takes what CPU the server leaves: answers from the store come first
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
            conn.send(answer(job, store_url, lambda holder: conn.send({"waiting": holder})))
        except (BrokenPipeError, OSError):
            return


def _end_with_server(life: Connection, store_url: str) -> None:
    """Exit this worker once its server is gone, whatever the probe is doing: the server never writes to
    ``life`` and holds its only other end, so a read returns (EOF) only when the server closed it or
    ended, ``kill -9`` included. The store claims this process holds are dropped first (within
    :data:`RELEASE_S`), so that other replicas take its probes over at once."""
    try:
        life.recv_bytes()
    except (EOFError, OSError):
        pass
    timer = threading.Timer(RELEASE_S, os._exit, (1,))
    timer.daemon = True
    timer.start()
    _release_claims(store_url, os.getpid())
    os._exit(1)


class Worker:
    """One worker process, started when first needed and again after it was stopped or died."""

    def __init__(self, store_url: str, index: int):
        self.store_url = store_url
        self.index = index
        self.process: Any = None
        self.conn: Connection | None = None
        self.life: Connection | None = None  # the worker ends once this closes (see _end_with_server)
        self.ready = False
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        context: Any = multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            context.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (with the first worker)
        mine, theirs = context.Pipe()
        watched, life = context.Pipe(duplex=False)
        self.process = context.Process(target=_main, args=(theirs, watched, self.store_url), daemon=True,
                                       name=f"autotune-worker-{self.index}")
        self.process.start()
        theirs.close()
        watched.close()
        self.conn, self.life = mine, life
        self.ready = False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def run(self, job: dict[str, Any], timeout_s: float,
            stop: Callable[[], JobFailed | None] = lambda: None) -> dict[str, Any]:
        """The job's answer; JobFailed when it failed, timed out or ``stop`` said why it must end (the
        worker is stopped then), or the worker died."""
        if not self.alive:
            self.stop()
            self.start()
        assert self.conn is not None
        if not self._ready(stop):
            what = self._ended()
            raise JobFailed(500, f"the probe worker did not start ({what}); see the server's log")
        self.conn.send(job)
        deadline = time.monotonic() + timeout_s
        holder = None  # whose store claim the job waits for now
        while True:
            while not self.conn.poll(POLL_S):
                if (why := stop()) is not None:
                    self.stop()
                    raise why
                if time.monotonic() >= deadline:
                    self.stop()
                    raise _late(job["probe"], timeout_s, holder)
            try:
                answer = self.conn.recv()
            except (EOFError, OSError):
                raise _died(job, self._ended()) from None
            if "waiting" not in answer:
                break
            holder = answer["waiting"]
        if not answer["ok"]:
            raise JobFailed(answer["status"], answer["error"], store=answer.get("store_error", False),
                            detail=answer.get("detail"))
        return answer

    def _ready(self, stop: Callable[[], JobFailed | None]) -> bool:
        """Wait for the worker's first message (it imports torch first)."""
        assert self.conn is not None
        if not self.ready:
            deadline = time.monotonic() + START_S
            try:
                while not self.conn.poll(POLL_S):
                    if (why := stop()) is not None:
                        self.stop()
                        raise why
                    if time.monotonic() >= deadline:
                        return False
                self.ready = bool(self.conn.recv().get("ready"))
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
        for conn in (self.conn, self.life):
            if conn is not None:
                conn.close()
        self.conn = self.life = None
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


def _died(job: dict[str, Any], what: str) -> JobFailed:
    """The answer of a job whose worker ended while it ran: 422 for a probe of the operator's folders (its code
    exits or crashes the process, as any failure of its code is answered), 500 for a built-in one."""
    if job.get("builtin", True):
        return JobFailed(500, f"the probe worker died ({what}) while planning {job['probe']!r}; the next request "
                              "starts a new worker")
    return JobFailed(422, f"probe {job['probe']!r} ended its worker process ({what}) while it was planned: a "
                          "probe's code returns a workload or raises an error, and never exits or crashes the "
                          "process; the next request starts a new worker")


def _late(probe: str, timeout_s: float, holder: str | None) -> JobFailed:
    """The 504 of a job past its time limit: its own probe stopped, or the claim of another it waited for."""
    if holder is None:
        return JobFailed(504, f"probe {probe!r} ran past the {timeout_s:g} s limit (--probe-timeout) and was "
                              "stopped; the service is fine, the next request starts a new worker")
    return JobFailed(504, f"probe {probe!r} reached the {timeout_s:g} s limit (--probe-timeout) waiting for "
                          f"{owner_words(holder)}, which holds the store's claim on the same probe and is probing it; "
                          "only this wait was stopped: ask again later (this service takes the probe over once that "
                          "process ends or its claim's lease runs out)")


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
        self._live: list[Job] = []  # jobs waiting or running
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self.jobs = 0
        self.cancelled = 0

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

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._waiting

    @property
    def restarted(self) -> int:
        """Worker processes started again after one was stopped or died."""
        return sum(max(0, w.starts - 1) for w in self.workers)

    def run(self, job: Job) -> dict[str, Any]:
        """``job``'s answer, from the first free worker; JobFailed when it failed, or ended early (see the module)."""
        with self._lock:
            if self.stopping.is_set():
                raise JobFailed(503, STOPPING)
            if self._waiting >= self.queue_limit:
                raise JobFailed(503, f"{self._waiting} plan requests are waiting for a worker already: try again "
                                     "later (or start the service with more --workers)")
            self._waiting += 1
            self._live.append(job)
        try:
            try:
                worker = self._take(job)
            finally:
                with self._lock:
                    self._waiting -= 1
            try:
                self.jobs += 1
                start = time.perf_counter()
                answer = worker.run(job.body, self.timeout_s, lambda: self._why_stop(job))
                answer["seconds"] = time.perf_counter() - start
                return answer
            finally:
                self._idle.put(worker)
        except JobFailed as exc:
            if exc.status == GONE:
                with self._lock:
                    self.cancelled += 1
            raise
        finally:
            with self._lock:
                self._live.remove(job)

    def _take(self, job: Job) -> Worker:
        """The first free worker; JobFailed when the client goes or the service stops first."""
        while True:
            try:
                worker: Worker | None = self._idle.get(timeout=POLL_S)
            except queue.Empty:
                worker = None
            if self.stopping.is_set() or job.gone.is_set():
                if worker is not None:
                    self._idle.put(worker)
                if self.stopping.is_set():
                    raise JobFailed(503, STOPPING)
                raise JobFailed(GONE, "the client hung up before a worker was free")
            if worker is not None:
                return worker

    def _why_stop(self, job: Job) -> JobFailed | None:
        """Why a running job must end now: the service stops, or every client of its probe has gone."""
        if self.stopping.is_set():
            return JobFailed(503, STOPPING)
        if job.gone.is_set():
            with self._lock:
                shared = any(o is not job and o.key & job.key and not o.gone.is_set() for o in self._live)
            if not shared:
                return JobFailed(GONE, "every client that asked for this probe hung up")
        return None

    def shutdown(self) -> None:
        """Answer every waiting and running job 503 (their workers stopped) within a few seconds, and
        every new one at once: the service is stopping. Safe to call from a signal handler."""
        self.stopping.set()

    def stop(self) -> None:
        self.stopping.set()
        if self._starter is not None:
            self._starter.join()
        for w in self.workers:
            w.stop()
