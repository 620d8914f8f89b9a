"""How long a plan takes when the plan store has the answer (a hit) and when it has not (a miss).

    python bench/store_latency.py                       # mlp, gpt, gpt-1b; API, command line, HTTP
    python bench/store_latency.py --repeat 5 --only mlp gpt --modes api http

Three ways in, each timed as a user waits for it (medians of ``--repeat``):

- ``api``: ``autotune.plan(..., store=URL)`` in a warm process. A miss takes the
  fingerprint and probes (on ``--device estimate``: the estimate); a hit takes the
  fingerprint and reads the store. ``cpu`` rows: a real device, where a hit
  also makes one confirm run of the fit rule. The fingerprint's own share is
  shown (its op trace is a forward and backward on shape-only tensors).
- ``cli``: ``autotune plan --store URL`` as a new process: torch's import and the
  interpreter's start come on top, for hits and misses alike.
- ``http``: ``POST /v1/plan`` to ``autotune serve`` with warm workers, from a
  real HTTP client; every miss asks for a fingerprint not seen before (another
  margin), every hit repeats a request.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine

import autotune
from autotune.devices import get_device
from autotune.results.request import ProbeRequest
from autotune.store.fingerprint import fingerprint
from autotune.units import parse_size
from autotune.workload import load_workload

#: label -> (probe, device, memory budget, target batch)
CASES = {
    "mlp": ("mlp", "estimate", "24GiB", 4096),
    "gpt": ("gpt", "estimate", "24GiB", 1024),
    "gpt-1b": ("gpt:build_1b", "estimate", "80GiB", 512),
    "mlp-cpu": ("mlp", "cpu", "3MB", 1021),
}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def api_case(label: str, repeat: int, folder: Path) -> dict[str, float]:
    probe, device, budget, target = CASES[label]
    misses, hits = [], []
    for i in range(repeat):
        url = f"sqlite:///{folder / f'api-{label}-{i}.db'}"
        for times in (misses, hits):
            start = time.perf_counter()
            plan = autotune.plan(target, probe=probe, device=device, memory_budget=budget, store=url)
            times.append(time.perf_counter() - start)
            assert plan.probe is not None and plan.probe.from_store is (times is hits)
    wl, dev = load_workload(probe), get_device(device, memory_budget=parse_size(budget))
    prints = []
    for _ in range(repeat):
        start = time.perf_counter()
        fingerprint(wl, dev, ProbeRequest())
        prints.append(time.perf_counter() - start)
    return {"miss": median(misses), "hit": median(hits), "fingerprint": median(prints)}


def cli_case(label: str, repeat: int, folder: Path) -> dict[str, float]:
    probe, device, budget, target = CASES[label]
    misses, hits = [], []
    for i in range(repeat):
        url = f"sqlite:///{folder / f'cli-{label}-{i}.db'}"
        for times, word in ((misses, False), (hits, True)):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "autotune", "plan", "--target-batch", str(target), "--probe",
                                   probe, "--device", device, "--memory-budget", budget, "--store", url],
                                  capture_output=True, text=True, check=True)
            times.append(time.perf_counter() - start)
            assert ("from the store" in done.stdout) is word, done.stdout
    return {"miss": median(misses), "hit": median(hits)}


def http_cases(labels: list[str], repeat: int, folder: Path) -> dict[str, dict[str, float]]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "autotune", "serve", "--store", f"sqlite:///{folder / 'http.db'}",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, dict[str, float]] = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            for _ in range(300):
                try:
                    http.get("/healthz")
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            http.post("/v1/plan", json={"target_batch": 8, "probe": "mlp", "device": "estimate",
                                        "memory_budget": "24GiB"})  # the worker is up and warm
            for label in labels:
                probe, device, budget, target = CASES[label]
                if device != "estimate":
                    continue
                misses, hits = [], []
                for i in range(repeat):
                    body = {"target_batch": target, "probe": probe, "device": device, "memory_budget": budget,
                            "margin": round(0.1 + 0.001 * (i + 1), 3)}
                    for times, cached in ((misses, False), (hits, True)):
                        start = time.perf_counter()
                        answer = http.post("/v1/plan", json=body)
                        times.append(time.perf_counter() - start)
                        assert answer.status_code == 200 and answer.json()["cached"] is cached, answer.text
                out[label] = {"miss": median(misses), "hit": median(hits)}
    finally:
        server.terminate()
        server.wait(30)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), default=["mlp", "gpt", "gpt-1b", "mlp-cpu"])
    parser.add_argument("--modes", nargs="+", choices=("api", "cli", "http"), default=["api", "cli", "http"])
    args = parser.parse_args()
    print(machine())
    autotune.plan(64, probe="mlp", device="estimate", memory_budget="24GiB", store=False)  # torch warmed up
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for mode in args.modes:
            if mode == "http":
                found = http_cases(args.only, args.repeat, folder)
                rows += [("http", label, found[label]) for label in args.only if label in found]
                continue
            for label in args.only:
                if mode == "cli" and CASES[label][1] != "estimate":
                    continue
                run = api_case if mode == "api" else cli_case
                rows.append((mode, label, run(label, args.repeat, folder)))
    print(f"medians of {args.repeat}; seconds a caller waits for a plan")
    print(f"{'mode':<5} {'case':<8} {'device':<26} {'miss s':>8} {'hit s':>8} {'miss/hit':>9} {'fingerprint s':>14}")
    for mode, label, t in rows:
        probe, device, budget, _ = CASES[label]
        where = f"{device} {budget}" + (" (confirm run)" if device != "estimate" else "")
        shown = f"{t['fingerprint']:.3f}" if "fingerprint" in t else "-"
        print(f"{mode:<5} {label:<8} {where:<26} {t['miss']:>8.3f} {t['hit']:>8.3f} {t['miss'] / t['hit']:>8.1f}x "
              f"{shown:>14}")


if __name__ == "__main__":
    os.environ.pop("AUTOTUNE_STORE", None)
    main()
