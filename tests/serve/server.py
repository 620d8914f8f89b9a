"""``autotune serve`` in a process of its own for the service's tests, and what they ask it."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

#: A plan request the store answers quickly (an estimate on a 1 GiB budget).
PLAN = {"target_batch": 512, "probe": "mlp", "device": "estimate", "memory_budget": "1GiB"}

#: A probe whose fingerprint is taken at once (batch 2) and whose probe then sleeps (larger batches):
#: it holds its store claim while it sleeps.
SLOW = (
    "import time\nimport torch\nfrom torch import nn\nfrom autotune import Workload\n\n"
    "def loss(model, batch):\n    if batch.shape[0] > 3:\n        time.sleep(60)\n"
    "    return model(batch).pow(2).mean()\n\n"
    "def build():\n    return Workload(name='slow', model=lambda: nn.Linear(4, 1),\n"
    "                    batch=lambda n, g: torch.randn(n, 4, generator=g), loss=loss)\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``autotune serve`` in a process of its own, on ``store`` (by default an SQLite file in ``tmp``)."""

    def __init__(self, tmp: Path, *, store: str | None = None, token: str | None = None,
                 extra: tuple[str, ...] = ()):
        self.folder = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = store or f"sqlite:///{tmp / 'plans.db'}"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        if token:
            path = tmp / "token"
            path.write_text(token + "\n")
            path.chmod(0o600)
            extra = ("--token-file", str(path), *extra)
        self.log = open(tmp / f"serve-{self.port}.log", "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "autotune", "serve", "--store", self.store, "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        with self.client(timeout=1) as http:
            while time.monotonic() < deadline:
                assert self.process.poll() is None, Path(self.log.name).read_text()
                try:
                    if http.get("/healthz").status_code == 200:
                        return
                except httpx.HTTPError:  # not listening yet: a refused connection costs nothing, look again soon
                    time.sleep(0.05)
        raise AssertionError(f"the server did not start: {Path(self.log.name).read_text()}")

    def client(self, *, authorized: bool = True, timeout: float = 300) -> httpx.Client:
        """A client of this server, with its token unless ``authorized`` is false."""
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers if authorized else {})

    def kill(self) -> None:
        """SIGKILL the server and everything it started."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # workers left behind, if any
        except ProcessLookupError:
            pass
        self.log.close()


def side_by_side(folders: list[Path], store: str, extra: tuple[str, ...]) -> list[Server]:
    """Servers on one store, one per folder, started side by side (each started one stopped if another fails)."""
    with concurrent.futures.ThreadPoolExecutor(len(folders)) as pool:
        starting = [pool.submit(Server, folder, store=store, extra=extra) for folder in folders]
    made = [s.result() for s in starting if s.exception() is None]
    if len(made) < len(folders):
        for server in made:
            server.stop()
        raise next(e for s in starting if (e := s.exception()) is not None)
    return made


def post_plan(server: Server, body: dict) -> httpx.Response | httpx.HTTPError:
    """POST ``body`` to the server's /v1/plan: its answer, or the client's error (a server killed mid-answer)."""
    with server.client(timeout=180) as http:
        try:
            return http.post("/v1/plan", json=body)
        except httpx.HTTPError as exc:
            return exc


def metrics(server: Server) -> dict:
    """The service's metrics: a sample with no labels by its name, else by its name and its labels' values in
    the order of their names (``endpoint``, ``method``, ``status``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as http:
        answer = http.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain"), answer.text
    found: dict = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            key = (sample.name, *(sample.labels[k] for k in sorted(sample.labels))) if sample.labels else sample.name
            found[key] = sample.value
    return found


def said(answer: httpx.Response) -> str:
    """An error answer's words: its one line, or, for a bad input's 422 (FastAPI's ``detail`` list), the ``msg``
    of each field at fault, each checked to name its field."""
    detail = answer.json()["detail"]
    if isinstance(detail, str):
        return detail
    for item in detail:
        assert item["loc"][0] == "body" and (len(item["loc"]) == 1 or str(item["loc"][-1]) in item["msg"]), item
    return "; ".join(item["msg"] for item in detail)
