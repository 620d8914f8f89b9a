"""Two `autotune serve` replicas on one plan store, under load: latency, errors, probes per fingerprint.

    python bench/serve_load.py                                   # SQLite and PostgreSQL, 2,000 requests
    python bench/serve_load.py --databases postgresql --requests 500 --clients 8
    python bench/serve_load.py --postgres postgresql://USER@HOST:5432/postgres   # a server you have

For each database: a fresh store (an SQLite file; a new database on the PostgreSQL server given, else on
one started here with PostgreSQL's initdb and pg_ctl, as tests/postgres.py does), and two replicas on it
(``autotune serve --workers 2``, each on its own port of 127.0.0.1). ``--stored`` settings (the mlp probe
on a 24 GiB estimate, each at another margin: another fingerprint) are probed first, through replica A.
Then ``--clients`` threads, each with its own keep-alive HTTP client, send ``--requests`` plan requests
between them, the replicas taken in turn: 95% for a stored fingerprint (a target of 256 to 2048), 5% for
a new one (each new fingerprint asked twice, at random times, so some are asked of both replicas at
once). Reported per database: requests, errors (any answer but 200, and connection failures), latency
of stored and of new plans (p50, p99, max), requests per second, and probes per fingerprint (how many
answers said ``"cached": false``): every new fingerprint should be probed once, every stored one never.
Target (issue 32): 0 errors, one probe per fingerprint, p99 of a stored plan under 50 ms on this machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, machine

sys.path.insert(0, ROOT)
from tests.postgres import Server as Postgres  # noqa: E402  (the tests' own server starter, not copied)

PROBE = {"probe": "mlp", "device": "estimate", "memory_budget": "24GiB"}
TARGETS = (256, 512, 1024, 2048)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_replica(store: str, folder: Path, workers: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    log = open(folder / f"serve-{port}.log", "w")  # noqa: SIM115 (the process holds it)
    process = subprocess.Popen([sys.executable, "-m", "autotune", "serve", "--store", store, "--port", str(port),
                                "--workers", str(workers)], stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"the replica did not start: {(folder / f'serve-{port}.log').read_text()[-2000:]}")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user and system) of a replica's server process, and of its children (workers and the
    forkserver; those that ended included)."""
    import psutil

    server = psutil.Process(pid)
    mine = server.cpu_times()
    children = sum(c.cpu_times().user + c.cpu_times().system for c in server.children(recursive=True))
    return mine.user + mine.system, children + mine.children_user + mine.children_system


def bodies(n: int, stored: int, seed: int) -> list[tuple[str, dict]]:
    """``n`` requests: 95% for the ``stored`` margins, 5% for new margins (each asked twice), shuffled."""
    rng = random.Random(seed)
    new = max(1, round(n * 0.05) // 2)
    out = [("new", {**PROBE, "target_batch": 1024, "margin": round(0.5 + 0.001 * i, 3)}) for i in range(new)] * 2
    while len(out) < n:
        out.append(("stored", {**PROBE, "target_batch": rng.choice(TARGETS),
                               "margin": round(0.1 + 0.001 * rng.randrange(stored), 3)}))
    rng.shuffle(out)
    return out


def load(replicas: list[str], work: list[tuple[str, dict]], clients: int) -> tuple[list[dict], float]:
    """Send ``work`` from ``clients`` threads, each with a keep-alive connection to every replica (the
    standard library's HTTP client: it costs the 2 CPUs a fraction of what httpx does, so that what is
    timed is the service); request i goes to replica i mod 2."""
    import http.client
    import json

    todo: queue.Queue[tuple[int, str, dict]] = queue.Queue()
    for i, (kind, body) in enumerate(work):
        todo.put((i, kind, body))
    done: list[dict] = []
    lock = threading.Lock()
    hosts = [url.removeprefix("http://").split(":") for url in replicas]

    def client() -> None:
        conns = [http.client.HTTPConnection(host, int(port), timeout=300) for host, port in hosts]
        try:
            while True:
                try:
                    i, kind, body = todo.get_nowait()
                except queue.Empty:
                    return
                conn = conns[i % len(conns)]
                start = time.perf_counter()
                try:
                    try:
                        conn.request("POST", "/v1/plan", body=json.dumps(body),
                                     headers={"content-type": "application/json"})
                    except (BrokenPipeError, ConnectionResetError):  # the server closed the idle keep-alive
                        conn.close()  # connection before this request was sent: sent again on a new one
                        conn.request("POST", "/v1/plan", body=json.dumps(body),
                                     headers={"content-type": "application/json"})
                    answer = conn.getresponse()
                    data = answer.read()
                    row = {"status": answer.status}
                    if answer.status == 200:
                        parsed = json.loads(data)
                        row.update(cached=parsed["cached"], fingerprint=parsed["fingerprint"])
                    else:
                        row.update(error=f"{answer.status} {data.decode(errors='replace')[:300]}")
                except (OSError, http.client.HTTPException) as exc:
                    conn.close()
                    row = {"status": type(exc).__name__, "error": f"{type(exc).__name__}: {exc}"}
                row.update(kind=kind, seconds=time.perf_counter() - start, margin=body["margin"])
                with lock:
                    done.append(row)
        finally:
            for conn in conns:
                conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(database: str, args: argparse.Namespace, postgres: Postgres | None, folder: Path) -> dict:
    import httpx

    store = f"sqlite:///{folder / 'plans.db'}" if database == "sqlite" else postgres.database()  # type: ignore
    started = [start_replica(store, folder, args.workers) for _ in range(2)]
    try:
        urls = [url for _, url in started]
        with httpx.Client(base_url=urls[0], timeout=600) as http:  # the stored fingerprints, probed through A
            for i in range(args.stored):
                answer = http.post("/v1/plan", json={**PROBE, "target_batch": max(TARGETS),
                                                     "margin": round(0.1 + 0.001 * i, 3)})
                assert answer.status_code == 200, answer.text
        with httpx.Client(base_url=urls[1], timeout=600) as http:  # B's workers up, as in service
            http.post("/v1/plan", json={**PROBE, "target_batch": 8, "margin": 0.95})
        before = [cpu_seconds(process.pid) for process, _ in started]
        rows, wall = load(urls, bodies(args.requests, args.stored, args.seed), args.clients)
        server_cpu = sum(cpu_seconds(process.pid)[0] - b[0] for (process, _), b in zip(started, before))
        worker_cpu = sum(cpu_seconds(process.pid)[1] - b[1] for (process, _), b in zip(started, before))
    finally:
        for process, _ in started:
            process.terminate()
        for process, _ in started:
            process.wait(60)
        if postgres is not None and database != "sqlite":
            postgres.drop(store)
    probes: collections.Counter[float] = collections.Counter(r["margin"] for r in rows if r.get("cached") is False)
    new = {r["margin"] for r in rows if r["kind"] == "new"}
    return {
        "database": database, "requests": len(rows), "errors": sum(r["status"] != 200 for r in rows),
        "stored": [r["seconds"] for r in rows if r["kind"] == "stored" and r["status"] == 200],
        "new": [r["seconds"] for r in rows if r["kind"] == "new" and r["status"] == 200],
        "rate": len(rows) / wall, "new_fingerprints": len(new), "server_cpu": server_cpu, "worker_cpu": worker_cpu,
        "probes_new": [probes.get(m, 0) for m in sorted(new)],
        "probed_stored": sum(n for m, n in probes.items() if m not in new),
        "errors_said": collections.Counter(r["error"] for r in rows if "error" in r),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--databases", nargs="+", choices=("sqlite", "postgresql"), default=["sqlite", "postgresql"])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--stored", type=int, default=20, help="stored fingerprints the 95%% are spread over")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per replica")
    parser.add_argument("--postgres", metavar="URL", default=None,
                        help="a PostgreSQL server's URL (a role that may create databases); default: start one")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(machine())
    print("# load average (1, 5, 15 min) at the start: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    postgres = None
    if "postgresql" in args.databases:
        if args.postgres:
            os.environ["AUTOTUNE_TEST_POSTGRES"] = args.postgres
        postgres = Postgres.start(durable=True)
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for database in args.databases:
                folder = Path(tmp) / database
                folder.mkdir()
                results.append(run(database, args, postgres, folder))
    finally:
        if postgres is not None:
            postgres.stop()
    print("# load average at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(f"2 replicas x {args.workers} workers, one store; {args.clients} clients, {args.requests} plan requests "
          f"(95% for {args.stored} stored fingerprints, 5% new, each new one asked twice); latency as a client waits")
    print(f"{'database':<11} {'requests':>8} {'errors':>6} {'stored p50 ms':>13} {'stored p99 ms':>13} "
          f"{'stored max ms':>13} {'new p50 s':>9} {'new p99 s':>9} {'req/s':>6} {'new fps':>7} "
          f"{'probes per new fp':>17} {'stored re-probed':>16}")
    for r in results:
        per = r["probes_new"]
        print(f"{r['database']:<11} {r['requests']:>8} {r['errors']:>6} {1000 * pct(r['stored'], 0.5):>13.1f} "
              f"{1000 * pct(r['stored'], 0.99):>13.1f} {1000 * max(r['stored'], default=float('nan')):>13.1f} "
              f"{pct(r['new'], 0.5):>9.2f} {pct(r['new'], 0.99):>9.2f} {r['rate']:>6.0f} {r['new_fingerprints']:>7} "
              f"{f'{min(per)}..{max(per)}' if per else '-':>17} {r['probed_stored']:>16}")
        for said, n in r["errors_said"].items():
            print(f"  {r['database']}: {n} x {said}")
        if r["stored"]:
            print(f"  {r['database']}: stored plans, mean {1000 * statistics.fmean(r['stored']):.1f} ms over "
                  f"{len(r['stored'])}; target p99 < 50 ms: {'HOLDS' if pct(r['stored'], 0.99) < 0.05 else 'MISSED'}; "
                  f"CPU: servers {1000 * r['server_cpu'] / r['requests']:.1f} ms a request, workers "
                  f"{r['worker_cpu']:.1f} s in all")


if __name__ == "__main__":
    os.environ.pop("AUTOTUNE_STORE", None)
    main()
