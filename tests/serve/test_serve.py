"""autotune serve, tested as it runs: a real server process on a free localhost port, a real HTTP client,
its store on SQLite (a file in a temporary folder) and on a real PostgreSQL server; one server per database
serves the module's tests, jobs whose ranks differ among them."""

from __future__ import annotations

import concurrent.futures
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..stores import execute, rows
from .server import PLAN, SLOW, Server, metrics, said

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token-for-the-tests-0123456789"

PROBES = {
    "dies.py": "import os\n\ndef build():\n    os._exit(3)\n",
    "failing.py": (
        "import torch\nfrom torch import nn\nfrom autotune import Workload\n\n"
        "def loss(model, batch):\n    raise ValueError('the loss of this probe is broken')\n\n"
        "def build():\n    return Workload(name='failing', model=lambda: nn.Linear(4, 1),\n"
        "                    batch=lambda n, g: torch.randn(n, 4, generator=g), loss=loss)\n"),
    "reads.py": (
        "import torch\nfrom torch import nn\nfrom autotune import Workload\n\n"
        "def loss(model, batch):\n    return open('/srv/secret/dataset/train.bin')\n\n"
        "def build():\n    return Workload(name='reads', model=lambda: nn.Linear(4, 1),\n"
        "                    batch=lambda n, g: torch.randn(n, 4, generator=g), loss=loss)\n"),
    "small.py": (
        "import torch\nfrom torch import nn\nfrom autotune import Workload\n\n"
        "def build(width=8):\n    return Workload(name='small', model=lambda: nn.Linear(4, width),\n"
        "                    batch=lambda n, g: torch.randn(n, 4, generator=g),\n"
        "                    loss=lambda m, b: m(b).pow(2).mean())\n\n"
        "def build_wide():\n    return build(64)\n\n"
        "def helper(x):\n    return x\n"),
    "slow.py": SLOW,
    "syntax.py": "import torch\n\ndef build(:\n    pass\n",
    "opens.py": "def build():\n    return open('/srv/secret/dataset/train.bin')\n",
    "segfault.py": "import ctypes\n\ndef build():\n    ctypes.string_at(0)\n",
    "exits.py": "import sys\n\ndef build():\n    sys.exit(0)\n",
    "interrupted.py": "def build():\n    raise KeyboardInterrupt\n",
    "raises.py": "import os\n\nCONFIG = os.environ['AUTOTUNE_TEST_NO_SUCH_VARIABLE']\n\ndef build():\n    pass\n",
}


@pytest.fixture(scope="module")
def probes_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("probes")
    for name, text in PROBES.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, probes_dir, module_store_url) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("serve"), store=module_store_url, token=TOKEN,
                     extra=("--probes", str(probes_dir), "--workers", "2", "--probe-timeout", "120",
                            "--read-timeout", "4"))
    yield running
    running.stop()


def test_healthz_and_the_api_description(server):
    with server.client() as http:
        health = http.get("/healthz").json()
        assert health["status"] == "ok" and health["store"] == _database(server) and health["workers"] == 2
        assert server.store.partition("://")[2] not in json.dumps(health)  # never where the store is
        assert http.head("/healthz").status_code == 200
        paths = http.get("/openapi.json").json()["paths"]
        assert {"/v1/plan", "/v1/plans", "/v1/plans/{fingerprint}", "/v1/plans/{fingerprint}/report",
                "/v1/measurements", "/healthz"} <= set(paths)


def test_the_second_identical_request_is_answered_from_the_store(server):
    with server.client() as http:
        first = http.post("/v1/plan", json=PLAN)
        assert first.status_code == 200, first.text
        second = http.post("/v1/plan", json=PLAN)
        assert second.status_code == 200, second.text
    a, b = first.json(), second.json()
    assert list(a) == list(b) == ["plan", "cached", "fingerprint"]  # as PlanAnswer describes them (test_api.py)
    assert (a["cached"], b["cached"]) == (False, True)
    assert a["fingerprint"] == b["fingerprint"] and len(a["fingerprint"]) == 64
    assert a["plan"]["schedule"] == b["plan"]["schedule"] and a["plan"]["target_batch"] == 512
    assert b["plan"]["probe"]["from_store"] and b["plan"]["probe"]["source"] == "mlp"
    assert b["plan"]["notes"][0].startswith("from the store (fingerprint ")


def test_an_fsdp_request_is_planned_sharded_and_kept_apart_from_ddp(server):
    body = {**PLAN, "world_size": 2, "margin": 0.3}
    with server.client() as http:
        ddp = http.post("/v1/plan", json=body)
        fsdp = http.post("/v1/plan", json={**body, "parallel": "fsdp"})
    assert ddp.status_code == 200 and fsdp.status_code == 200, (ddp.text, fsdp.text)
    a, b = ddp.json(), fsdp.json()
    assert (a["plan"]["parallel"], b["plan"]["parallel"]) == ("ddp", "fsdp")
    assert b["plan"]["probe"]["parallel"] == "fsdp" and b["plan"]["probe"]["world_size"] == 2
    assert a["fingerprint"] != b["fingerprint"] and not b["cached"]


def test_concurrent_requests_for_one_fingerprint_probe_once(server):
    body = {**PLAN, "margin": 0.25}  # a fingerprint no other test asks for
    with server.client() as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: http.post("/v1/plan", json=body), range(4)))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert sorted(a.json()["cached"] for a in answers) == [False, True, True, True]
    assert len({a.json()["fingerprint"] for a in answers}) == 1


def test_entries_plans_reports_and_measurements(server):
    with server.client() as http:
        made = http.post("/v1/plan", json={**PLAN, "target_batch": 300}).json()
        fp = made["fingerprint"]
        listed = http.get("/v1/plans").json()["plans"]
        assert fp in [e["fingerprint"] for e in listed]
        entry = http.get(f"/v1/plans/{fp[:10]}").json()
        assert entry["entry"]["fingerprint"] == fp and entry["entry"]["probe"]["workload"] == "mlp"
        assert 300 in [p["target_batch"] for p in entry["plans"]]
        report = http.get(f"/v1/plans/{fp}/report")
        assert report.status_code == 200 and report.headers["content-type"].startswith("text/html")
        assert "<html" in report.text and "mlp" in report.text
        measured = {"fingerprint": fp, "device": "NVIDIA H100 80GB HBM3", "batch": 64,
                    "peak_reserved_bytes": 2_000_000, "peak_allocated_bytes": 1_800_000, "throughput": 5000.0}
        answer = http.post("/v1/measurements", json=measured)
        assert answer.status_code == 201, answer.text
        assert answer.json()["estimated_peak_bytes"] > 0 and answer.json()["error"] is not None
        rows = http.get(f"/v1/plans/{fp}").json()["measurements"]
        assert rows[-1]["device"] == "NVIDIA H100 80GB HBM3" and rows[-1]["source"] == "reported"
        assert http.get(f"/v1/plans/{'0' * 64}").status_code == 404
        assert http.post("/v1/measurements", json={**measured, "fingerprint": "0" * 64}).status_code == 404
        assert http.post("/v1/measurements", json={**measured, "peak_reserved_bytes": -1}).status_code == 422
        assert http.post("/v1/measurements", json={**measured, "peak_reserved_bytes": None}).status_code == 422


def test_only_served_probes_run(server):
    with server.client() as http:
        names = {p["name"]: p for p in http.get("/v1/probes").json()["probes"]}
        assert {"mlp", "gpt", "convnet", "small", "dies"} <= set(names)
        assert names["small"]["functions"] == ["build", "build_wide"] and not names["small"]["builtin"]
        wide = http.post("/v1/plan", json={**PLAN, "probe": "small:build_wide"})
        assert wide.status_code == 200, wide.text
        assert wide.json()["plan"]["probe"]["source"] == "small:build_wide"
        for probe in ("nope", "../probes/small", "/etc/passwd", "autotune.probes.mlp", "small.py", "small:helper",
                      "small:_private", "os:system"):
            answer = http.post("/v1/plan", json={**PLAN, "probe": probe})
            assert answer.status_code == 404, (probe, answer.text)
            assert "/v1/probes" in said(answer) or "no function" in said(answer)


@pytest.mark.parametrize("body,status,words", [
    ({**PLAN, "target_batch": -5}, 422, "target_batch -5"),
    ({**PLAN, "target_batch": 0}, 422, "target_batch"),
    ({**PLAN, "target_batch": 10**12}, 422, "target_batch"),
    ({**PLAN, "target_batch": "512"}, 422, "valid integer"),
    ({k: v for k, v in PLAN.items() if k != "target_batch"}, 422, "target_batch is missing"),
    ({**PLAN, "margin": 1.5}, 422, "margin"),
    ({**PLAN, "world_size": 0}, 422, "world_size"),
    ({**PLAN, "device": "cpu"}, 422, "device"),
    ({**PLAN, "device": "cuda:0"}, 422, "device"),
    ({**PLAN, "memory_budget": "lots"}, 422, "is not a size"),
    ({**PLAN, "memory_budget": None}, 422, "needs memory_budget"),
    ({**PLAN, "memory_budget": "100MiB"}, 422, "memory_budget 100.0 MiB is not more than the 640.0 MiB a CUDA context"),
    ({**PLAN, "precision": "bf16"}, 422, "precision \"bf16\" is not planned here: the service plans fp32 only"),
    ({**PLAN, "precision": "fp8"}, 422, "precision"),
    ({**PLAN, "probe_file": "/tmp/x.py"}, 422, "probe_file is not a field"),
    ({**PLAN, "target_batch": 7, "uniform": True, "multiple_of": 2}, 422, ""),
])
def test_bad_requests_get_one_clear_error(server, body, status, words):
    with server.client() as http:
        answer = http.post("/v1/plan", json=body)
    assert answer.status_code == status, answer.text
    detail = said(answer)
    assert isinstance(detail, str) and "\n" not in detail and words in detail


def test_bodies_too_large_or_not_json_are_refused_before_parsing(server):
    with server.client() as http:
        huge = http.post("/v1/plan", content=b'{"target_batch": 8, "pad": "' + b"x" * 100_000 + b'"}',
                         headers={"content-type": "application/json"})
        assert huge.status_code == 413 and "over" in said(huge)

        def chunks():  # no Content-Length: the size is counted as the body arrives
            yield b'{"target_batch": 8, "pad": "'
            for _ in range(40):
                yield b"x" * 1024
            yield b'"}'

        streamed = http.post("/v1/plan", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        broken = http.post("/v1/plan", content=b"{not json", headers={"content-type": "application/json"})
        assert broken.status_code == 400 and "not JSON" in said(broken)


def test_a_client_that_trickles_its_request_is_answered_408_and_disconnected(server):
    """Partial headers, and whole headers with part of the body, trickled a byte a second: each connection is
    cut off once its request has not arrived whole within --read-timeout (4 s here)."""
    started = (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
               b"POST /v1/plan HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 200\r\n\r\n{\"target_batch\": ")
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in started]
    try:
        for sock, first in zip(slow, started):
            sock.sendall(first)
        for _ in range(12):  # a byte a second until the server has answered each (past 4 s), or for 12 s
            if len(select.select(slow, [], [], 1)[0]) == len(slow):
                break
            for sock in slow:
                try:
                    sock.sendall(b"1")
                except OSError:  # cut off already
                    pass
        answers = [_until_closed(sock) for sock in slow]
    finally:
        for sock in slow:
            sock.close()
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive whole within 4 s" in answer, answer
    with server.client() as http:
        assert http.get("/healthz").status_code == 200


def _until_closed(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (socket.timeout when it did not)."""
    got = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def test_the_server_process_never_loads_torch(server):
    # The workers import torch; the server only passes their answers on (plain data, which unpickles
    # without it), after the tests before this one have planned, listed and reported through it.
    maps = Path(f"/proc/{server.process.pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc to see what a process has loaded")
    with server.client() as http:
        assert http.post("/v1/plan", json={**PLAN, "target_batch": 96}).status_code == 200
    assert "libtorch" not in maps.read_text()


def test_a_setting_the_planning_refuses_is_a_422_naming_its_field_with_the_librarys_data(server):
    """A budget no GPU can have is refused where the device is made: the 422 lists it under its field, with the
    limit and the fix as data."""
    with server.client() as http:
        answer = http.post("/v1/plan", json={**PLAN, "memory_budget": "100MiB"})
    assert answer.status_code == 422, answer.text
    [item] = answer.json()["detail"]
    assert item["loc"] == ["body", "memory_budget"] and item["input"] == "100MiB", item
    assert item["ctx"] == {"limit": 640 * 2**20, "fix": "give the GPU's memory, e.g. 24GiB"}, item


def test_a_probe_that_fails_or_kills_its_worker_is_an_error_not_a_dead_service(server):
    before = metrics(server)
    with server.client() as http:
        failing = http.post("/v1/plan", json={**PLAN, "probe": "failing"})
        assert failing.status_code == 422, failing.text
        assert "the loss of this probe is broken" in said(failing)
        reads = http.post("/v1/plan", json={**PLAN, "probe": "reads"})  # its error names a file: not its folders
        assert reads.status_code == 422 and "'train.bin'" in said(reads), reads.text
        assert "/srv" not in reads.text and "secret" not in reads.text
        for _ in range(2):  # each of the two workers, or one of them twice
            dies = http.post("/v1/plan", json={**PLAN, "probe": "dies"})
            assert dies.status_code == 422 and said(dies).startswith(
                "probe 'dies' ended its worker process (exit code 3) while it was planned: a probe's code returns "
                "a workload or raises an error"), dies.text
        for probe, words in (("segfault", "ended its worker process (signal 11)"), ("exits", "called exit(0)"),
                             ("interrupted", "raised KeyboardInterrupt")):
            answer = http.post("/v1/plan", json={**PLAN, "probe": probe})
            assert answer.status_code == 422 and f"probe {probe!r} {words} while it was planned" in \
                said(answer), answer.text
        after = http.post("/v1/plan", json={**PLAN, "probe": "small"})
        assert after.status_code == 200, after.text
        assert http.get("/healthz").json()["status"] == "ok"
    counted = metrics(server)
    # both workers died (or one twice): a request started one again
    assert counted["autotune_workers_restarted_total"] - before.get("autotune_workers_restarted_total", 0) >= 1


def test_metrics_count_requests_hits_misses_and_probes_behind_the_token(server):
    body = {**PLAN, "margin": 0.55}  # a fingerprint no other test asks for
    before = metrics(server)
    with server.client() as http:
        answers = [http.post("/v1/plan", json=body).json()["cached"] for _ in range(2)]
        refused = http.get("/metrics", headers={"Authorization": "Bearer wrong"})
    after = metrics(server)
    assert answers == [False, True]
    assert refused.status_code == 401

    def grew(key: object) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert (grew(("autotune_plans_total", "miss")), grew(("autotune_plans_total", "hit"))) == (1, 1)
    assert grew(("autotune_requests_total", "/v1/plan", "POST", "200")) == 2
    assert grew(("autotune_requests_total", "/metrics", "GET", "401")) == 1
    assert grew(("autotune_requests_total", "/metrics", "GET", "200")) == 1  # the first look, counted after it
    assert grew("autotune_probe_seconds_count") == 1 and grew("autotune_probe_seconds_sum") > 0
    assert grew(("autotune_request_seconds_count", "/v1/plan")) == 2
    for name in ("autotune_jobs_queued", "autotune_workers_busy", "autotune_workers_restarted_total",
                 "autotune_jobs_cancelled_total"):
        assert name in after
    assert after[("autotune_store_errors_total", "server")] == after[("autotune_store_errors_total", "worker")] == 0


def test_an_entry_removed_elsewhere_is_probed_again_a_second_later(server):
    from autotune.store.store import Store

    body = {**PLAN, "margin": 0.85}
    with server.client() as http:
        first = http.post("/v1/plan", json=body).json()
        assert http.post("/v1/plan", json=body).json()["cached"]  # answered here, from the store
        remover = Store(server.store, mode="write")  # as autotune store rm does, from another process
        assert remover.remove([first["fingerprint"]]) == 1
        remover.close()
        time.sleep(1.2)  # the service reads an entry it answered from again once it is a second old
        again = http.post("/v1/plan", json=body).json()
    assert not first["cached"] and not again["cached"] and again["fingerprint"] == first["fingerprint"]


def test_every_request_is_one_access_log_line(server):
    body = {**PLAN, "margin": 0.65}
    with server.client() as http:
        fp = http.post("/v1/plan", json=body).json()["fingerprint"]
        http.post("/v1/plan", json=body)
    with server.client(authorized=False) as http:
        http.get(f"/v1/plans/{fp}")
    deadline = time.monotonic() + 10  # a request's line is written once its answer is sent: soon after it comes
    while True:
        lines = [json.loads(line) for line in Path(server.log.name).read_text().splitlines()
                 if line.startswith("{") and line.endswith("}")]
        if any(line["path"] == f"/v1/plans/{fp}" for line in lines) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    plans = [line for line in lines if line["fingerprint"] == fp]
    assert [(p["method"], p["path"], p["status"], p["cached"]) for p in plans] == \
        [("POST", "/v1/plan", 200, False), ("POST", "/v1/plan", 200, True)]
    assert all(p["seconds"] > 0 and p["time"].endswith("+00:00") for p in plans)
    refused = [line for line in lines if line["path"] == f"/v1/plans/{fp}"]
    assert [(r["method"], r["status"], r["cached"], r["fingerprint"]) for r in refused] == [("GET", 401, None, None)]
    assert set(lines[-1]) == {"time", "method", "path", "status", "seconds", "cached", "fingerprint"}


def test_a_request_seen_before_is_answered_without_a_worker(server, probes_dir):
    body = {**PLAN, "margin": 0.75}
    with server.client() as http:
        def jobs() -> int:
            return http.get("/healthz").json()["jobs"]

        first = http.post("/v1/plan", json=body).json()
        probed = jobs()
        again = [http.post("/v1/plan", json={**body, "target_batch": t}).json() for t in (512, 300, 512)]
        assert jobs() == probed, "a request whose settings the store answered before went to a worker"
        assert [a["cached"] for a in again] == [True] * 3 and {a["fingerprint"] for a in again} == \
            {first["fingerprint"]}
        assert [a["plan"]["target_batch"] for a in again] == [512, 300, 512]
        assert again[0]["plan"]["schedule"] == first["plan"]["schedule"]
        assert again[0]["plan"]["notes"][0].startswith("from the store (fingerprint ")
        assert again[0]["plan"]["probe"]["source"] == "mlp" and again[0]["plan"]["probe"]["from_store"]
        wider = http.post("/v1/plan", json={**body, "world_size": 2}).json()  # other settings: a worker answers
        assert jobs() == probed + 1 and not wider["cached"]
        # a probe whose code changed is fingerprinted again by a worker (here to the same graph: the store answers)
        (probes_dir / "edited.py").write_text(PROBES["small.py"])
        kept = http.post("/v1/plan", json={**body, "probe": "edited"}).json()
        (probes_dir / "edited.py").write_text(PROBES["small.py"] + "\n# edited\n")
        edited = http.post("/v1/plan", json={**body, "probe": "edited"}).json()
        assert jobs() == probed + 3 and (kept["cached"], edited["cached"]) == (False, True)
        assert edited["fingerprint"] == kept["fingerprint"]
        assert http.post("/v1/plan", json={**body, "probe": "edited"}).json()["cached"] and jobs() == probed + 3


def test_a_token_is_required_when_given_and_compared_exactly(server):
    with server.client(authorized=False) as http:
        assert http.get("/healthz").status_code == 200  # liveness needs no token
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
                        {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
            answer = http.post("/v1/plan", json=PLAN, headers=headers)
            assert answer.status_code == 401, headers
            assert answer.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/plans").status_code == 401
        assert http.get("/openapi.json").status_code == 401
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert http.get("/v1/plans", headers=good).status_code == 200
        assert http.post("/v1/plan", json={**PLAN, "target_batch": 0}).status_code == 401  # the gate comes first
        past_the_gate = http.post("/v1/plan", json={**PLAN, "target_batch": 0}, headers=good)
        assert past_the_gate.status_code == 422 and "target_batch" in said(past_the_gate)


def test_healthz_says_only_the_status_without_the_token(server):
    with server.client(authorized=False) as http:
        bare = http.get("/healthz")
    with server.client() as http:
        full = http.get("/healthz").json()
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    assert full["status"] == "ok" and full["store"] == _database(server) and "busy" in full


def _database(server: Server) -> str:
    """The kind of database of ``server``'s store: sqlite, postgresql."""
    return server.store.partition(":")[0].partition("+")[0]


@pytest.mark.parametrize("host", ["attacker.example.com", "attacker.example.com:8321", "127.0.0.1.nip.io", ""])
def test_a_request_for_another_host_name_is_refused(server, host):
    with server.client(authorized=False) as http:
        answer = http.get("/healthz", headers={"host": host})
        assert http.get("/healthz", headers={"host": f"localhost:{server.port}"}).status_code == 200
    assert answer.status_code == 421 and "--allowed-hosts" in said(answer), answer.text


def test_a_body_that_is_not_json_or_missing_says_so(server):
    with server.client() as http:
        form = http.post("/v1/plan", content=b"target_batch=512&probe=mlp",  # curl -d without a content type
                         headers={"content-type": "application/x-www-form-urlencoded"})
        empty = http.post("/v1/plan")
        listed = http.post("/v1/plan", json=[PLAN])
    assert form.status_code == 422 and "must be JSON sent with content-type: application/json" in \
        said(form) and "application/x-www-form-urlencoded" in said(form)
    assert empty.status_code == 422 and said(empty).startswith("the body is missing: send a JSON object")
    assert listed.status_code == 422 and said(listed).startswith("the body must be a JSON object")


def test_the_api_lists_only_the_precision_it_plans(server):
    with server.client() as http:
        schema = http.get("/openapi.json").json()["components"]["schemas"]["PlanRequest"]["properties"]
    assert schema["precision"]["enum"] == ["fp32"] if "enum" in schema["precision"] else \
        schema["precision"]["const"] == "fp32"


def test_a_hint_uses_the_request_s_own_fields_and_what_it_suggests_is_accepted(server):
    body = {**PLAN, "margin": 0.15, "target_batch": 143362, "uniform": True}  # max micro-batch 71680
    with server.client() as http:
        refused = http.post("/v1/plan", json=body)
        assert refused.status_code == 422, refused.text
        detail = said(refused)
        assert '"uniform": "force" for 143362 = 3334 x 43 steps' in detail and 'drop "uniform": true' in detail
        assert "uniform='force'" not in detail and "uniform=True" not in detail
        forced = http.post("/v1/plan", json={**body, "uniform": "force"})
    assert forced.status_code == 200, forced.text
    assert forced.json()["plan"]["micro_batch"] == 3334 and forced.json()["plan"]["uniform"]


def test_margins_that_differ_past_four_decimals_share_one_plan(server):
    with server.client() as http:
        answers = [http.post("/v1/plan", json={**PLAN, "margin": m}) for m in (0.2345, 0.2345 + 1e-9, 0.23449999)]
        finer = http.post("/v1/plan", json={**PLAN, "margin": 0.99999})
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert [a.json()["cached"] for a in answers[1:]] == [True, True]
    assert len({a.json()["fingerprint"] for a in answers}) == 1
    assert answers[1].json()["plan"]["probe"]["margin"] == 0.2345
    assert finer.status_code == 422
    assert finer.json()["detail"] == [{"type": "value_error", "loc": ["body", "margin"], "input": 0.99999,
                                       "msg": "margin 0.99999 must be below 1 (margins are taken to 4 decimals): give "
                                              "0.9999 at most", "ctx": {"limit": 0.9999, "fix": "give 0.9999 at most"}}]


def test_a_probe_that_found_the_memory_limit_serves_smaller_targets(server):
    body = {**PLAN, "margin": 0.15}
    with server.client() as http:
        big = http.post("/v1/plan", json={**body, "target_batch": 10**6}).json()
        small = [http.post("/v1/plan", json={**body, "target_batch": t}).json() for t in (512, 513, 512)]
        entry = http.get(f"/v1/plans/{big['fingerprint']}").json()["entry"]
    assert big["plan"]["probe"]["limited_by"] == "memory"
    assert [a["cached"] for a in small] == [True, True, True]
    assert {a["fingerprint"] for a in small} == {big["fingerprint"]}
    assert [a["plan"]["micro_batch"] for a in small] == [512, 513, 512]
    assert entry["limited_by"] == "memory" and entry["max_micro_batch"] == big["plan"]["probe"]["max_micro_batch"]


def test_a_broken_probe_file_is_named_without_server_paths(server, probes_dir):
    with server.client() as http:
        syntax = http.post("/v1/plan", json={**PLAN, "probe": "syntax"})
        raises = http.post("/v1/plan", json={**PLAN, "probe": "raises"})
        opens = http.post("/v1/plan", json={**PLAN, "probe": "opens"})
        listed = {p["name"]: p for p in http.get("/v1/probes").json()["probes"]}
    assert syntax.status_code == 422
    assert said(syntax) == "probe 'syntax' failed to load: SyntaxError at line 3"
    assert listed["syntax"]["error"] == "SyntaxError at line 3" and listed["small"]["error"] is None
    assert raises.status_code == 422, raises.text
    assert said(raises) == "probe 'raises' failed to load: KeyError at line 3"
    assert opens.status_code == 422, opens.text
    assert said(opens) == "probe 'opens' failed to load: FileNotFoundError at line 2"  # not its path
    for answer in (syntax, raises, opens):
        assert str(probes_dir) not in answer.text and "/" not in said(answer)


def test_implausible_measurements_are_refused(server):
    with server.client() as http:
        fp = http.post("/v1/plan", json={**PLAN, "margin": 0.05}).json()["fingerprint"]  # a GPU with 1 GiB
        good = {"fingerprint": fp, "device": "NVIDIA A100", "batch": 64, "peak_reserved_bytes": 2_000_000}
        answers = {
            "huge": http.post("/v1/measurements", json={**good, "peak_reserved_bytes": 2**60}),
            "above": http.post("/v1/measurements", json={**good, "peak_reserved_bytes": 2 * 2**30}),
            "allocated": http.post("/v1/measurements", json={**good, "peak_allocated_bytes": 3_000_000}),
            "estimate": http.post("/v1/measurements", json={**good, "device": "estimate", "oom": True,
                                                             "peak_reserved_bytes": None}),
            "zero": http.post("/v1/measurements", json={**good, "peak_reserved_bytes": 0}),
            "zero allocated": http.post("/v1/measurements", json={**good, "peak_allocated_bytes": 0}),
            "cpu": http.post("/v1/measurements", json={**good, "device_kind": "cpu"}),
            "escape": http.post("/v1/measurements", json={**good, "note": "<b>\u001b[31mRED\u001b[0m"}),
            "bidi": http.post("/v1/measurements", json={**good, "device": "NVIDIA \u202eA100"}),
            "bell": http.post("/v1/measurements", json={**good, "device": "NVIDIA A100\u0007"}),
        }
        kept = http.post("/v1/measurements", json={**good, "peak_allocated_bytes": 1_900_000})
        rows = http.get(f"/v1/plans/{fp}").json()["measurements"]
    assert {k: a.status_code for k, a in answers.items()} == dict.fromkeys(answers, 422), \
        {k: a.text for k, a in answers.items()}
    assert "is above the 1.0 GiB the entry's device has" in said(answers["huge"])
    assert "is above the 1.0 GiB" in said(answers["above"])
    assert "peak_allocated_bytes 3000000 is above peak_reserved_bytes 2000000" in said(answers["allocated"])
    assert "is an estimate, which measures nothing" in said(answers["estimate"])
    assert said(answers["zero"]).startswith("peak_reserved_bytes 0: 0 bytes is not a peak a job ran with")
    assert said(answers["zero allocated"]).startswith("peak_allocated_bytes 0: 0 bytes is not a peak")
    assert said(answers["cpu"]).startswith("device_kind 'cpu' is not the kind of device the entry "
                                                      "planned for (cuda: ")
    assert said(answers["escape"]) == (
        'note "<b>\\u001b[31mRED\\u001b[0m": must be plain text: it holds the control character U+001B at '
        "position 3; send the text without control characters (terminal escapes, tabs, new lines)")
    assert "device" in said(answers["bidi"]) and "U+202E at position 7" in said(answers["bidi"])
    assert said(answers["bell"]).startswith('device "NVIDIA A100\\u0007": must be plain text')
    assert "\x1b" not in answers["escape"].text
    assert kept.status_code == 201 and [r["peak_reserved_bytes"] for r in rows] == [2_000_000]


def test_a_damaged_entry_is_served_as_damaged_then_probed_again(server):
    body = {**PLAN, "margin": 0.35}
    with server.client() as http:
        fp = http.post("/v1/plan", json=body).json()["fingerprint"]
        execute(server.store, "update autotune_entries set probe = '{not json' where fingerprint = :fp", fp=fp)
        listed = http.get("/v1/plans")
        one = http.get(f"/v1/plans/{fp}")
        report = http.get(f"/v1/plans/{fp}/report")
        measured = http.post("/v1/measurements", json={"fingerprint": fp, "device": "NVIDIA A100", "batch": 8,
                                                       "peak_reserved_bytes": 1000})
        again = http.post("/v1/plan", json=body)
        after = http.get(f"/v1/plans/{fp}").json()["entry"]
    assert listed.status_code == 200 and [e["damaged"] for e in listed.json()["plans"] if e["fingerprint"] == fp] \
        == ["its probe result cannot be read (JSONDecodeError: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1))"]
    assert one.status_code == 200 and one.json()["entry"]["probe"] is None and one.json()["plans"]
    assert report.status_code == 200 and "<html" in report.text  # from its plan, which holds the probe
    assert measured.status_code == 409 and f"entry {fp[:12]} is damaged" in said(measured)
    assert again.status_code == 200 and not again.json()["cached"], again.text
    assert after["damaged"] is None and after["valid"] and after["probe"]["workload"] == "mlp"


# Jobs whose ranks differ: a device (or a budget) per rank in a request, the plan that gives each rank its own
# micro-batch and micro-steps, stored under fingerprints that cover every rank's device in order, and reused.

MIXED = {"target_batch": 512, "probe": "mlp", "device": "estimate:A100-80GB,estimate:T4-16GB"}


def _mixed_plan(server: Server, body: dict) -> dict:
    with server.client() as http:
        answer = http.post("/v1/plan", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _shares(answer: dict) -> list[tuple[str, int]]:
    """(device, samples) of each rank of a mixed plan."""
    made = answer["plan"]
    assert made["mixed"] is not None, "the plan gives every rank the same micro-batch"
    return [(r["device"], n) for r, n in zip(made["mixed"]["ranks"], made["per_rank_batch"], strict=True)]


def test_a_mixed_request_is_planned_per_rank_stored_and_reused(server):
    first, second = _mixed_plan(server, MIXED), _mixed_plan(server, MIXED)
    (a100, big), (t4, small) = _shares(first)
    assert (a100, t4) == ("estimate:A100-80GB", "estimate:T4-16GB")
    assert big + small == 512 and big > small, "the A100 does not take the larger share"
    assert first["plan"]["world_size"] == 2 and first["plan"]["world_size_source"] == "the device list"
    assert (first["cached"], second["cached"]) == (False, True)
    assert second["fingerprint"] == first["fingerprint"]
    assert _shares(second) == _shares(first) and second["plan"]["schedule"] == first["plan"]["schedule"]
    assert second["plan"]["probe"]["from_store"]
    smaller = _mixed_plan(server, {**MIXED, "target_batch": 256})  # within what rank 0's entry answers alone
    assert smaller["cached"] and smaller["fingerprint"] == first["fingerprint"]
    assert [d for d, _ in _shares(smaller)] == [a100, t4] and sum(n for _, n in _shares(smaller)) == 256
    with server.client() as http:
        entry = http.get(f"/v1/plans/{first['fingerprint']}").json()
    assert sorted((p["target_batch"], p["world_size"]) for p in entry["plans"]) == [(256, 2), (512, 2)]
    parts = entry["entry"]["components"]
    assert (parts["device"]["name"], [r["name"] for r in parts["ranks"]]) == \
        ("estimate:A100-80GB", ["estimate:A100-80GB", "estimate:T4-16GB"])


def test_the_fingerprint_covers_every_rank_s_device_in_order(server):
    body = {**MIXED, "margin": 0.2}  # settings no other test asks for
    ours = _mixed_plan(server, body)
    swapped = _mixed_plan(server, {**body, "device": "estimate:T4-16GB,estimate:A100-80GB"})
    alone = _mixed_plan(server, {**body, "device": "estimate:A100-80GB"})
    assert [d for d, _ in _shares(swapped)] == ["estimate:T4-16GB", "estimate:A100-80GB"]
    assert _shares(swapped)[1][1] > _shares(swapped)[0][1]
    assert alone["plan"]["mixed"] is None and alone["plan"]["world_size"] == 1
    assert len({ours["fingerprint"], swapped["fingerprint"], alone["fingerprint"]}) == 3
    ranks = [{r["fingerprint"] for r in a["plan"]["mixed"]["ranks"]} for a in (ours, swapped)]
    assert len(ranks[0]) == len(ranks[1]) == 2 and not ranks[0] & ranks[1], \
        "the A100 of A100,T4 and the A100 of T4,A100 share a fingerprint"
    assert alone["fingerprint"] not in ranks[0] | ranks[1]
    assert not (ours["cached"] or swapped["cached"] or alone["cached"])


def test_counts_and_a_budget_per_rank(server):
    counted = _mixed_plan(server, {**MIXED, "device": "estimate:H100-80GB*2,estimate:A10G-24GB*2"})
    assert [d for d, _ in _shares(counted)] == ["estimate:H100-80GB"] * 2 + ["estimate:A10G-24GB"] * 2
    assert sum(n for _, n in _shares(counted)) == 512 and counted["plan"]["world_size"] == 4
    body = {**MIXED, "target_batch": 4096, "device": "estimate", "memory_budget": "1GiB,672MiB"}  # 28 MiB usable
    budgets, again = _mixed_plan(server, body), _mixed_plan(server, body)
    ranks = budgets["plan"]["mixed"]["ranks"]
    assert [r["budget_bytes"] for r in ranks] == [2**30, 672 * 2**20]
    assert ranks[1]["max_micro_batch"] < ranks[0]["max_micro_batch"] and _shares(budgets)[0][1] > _shares(budgets)[1][1]
    assert (budgets["cached"], again["cached"]) == (False, True) and _shares(again) == _shares(budgets)


@pytest.mark.parametrize("body,words", [
    ({**MIXED, "device": "estimate:A100-80GB*1025"}, "1,025 ranks: at most 1,024"),
    ({**MIXED, "device": "estimate:A100-80GB,cuda:0"}, "one per rank such as estimate:A100-80GB,estimate:T4-16GB"),
    ({**MIXED, "device": "estimate:A100-80GB,"}, "one per rank"),
    ({**MIXED, "device": "estimate:A100-80GB*0,estimate:T4-16GB"}, "count"),
    ({**MIXED, "world_size": 3}, 'world_size 3 but the device or memory_budget list names 2 ranks'),
    ({**MIXED, "memory_budget": "1GiB,2GiB,3GiB"}, "device lists 2 ranks and memory_budget 3"),
    ({**MIXED, "device": "estimate", "memory_budget": "1GiB,lots"}, "is not a size"),
    ({**MIXED, "device": "estimate", "memory_budget": "1GiB*2000"}, "2,000 ranks: at most 1,024"),
])
def test_bad_mixed_requests_get_one_clear_error(server, body, words):
    with server.client() as http:
        answer = http.post("/v1/plan", json=body)
    assert answer.status_code == 422, answer.text
    detail = said(answer)
    assert isinstance(detail, str) and "\n" not in detail and words in detail, detail


def _warm(server: Server) -> dict:
    """Both workers started (a plan on each), then the service's health."""
    with server.client() as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert [a.status_code for a in pool.map(lambda _: http.post("/v1/plan", json=PLAN), range(2))] == [200] * 2
        return http.get("/healthz").json()


def test_clients_that_hang_up_stop_their_probe_and_release_its_claim(server):
    body = {**PLAN, "probe": "slow", "target_batch": 64}
    before = _warm(server)

    def hang_up(_: int) -> str:
        with server.client(timeout=1) as http:
            try:
                return str(http.post("/v1/plan", json=body).status_code)
            except httpx.TimeoutException:
                return "gone"

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        assert list(pool.map(hang_up, range(10))) == ["gone"] * 10
    deadline, health = time.monotonic() + 20, {}
    with server.client() as http:
        while time.monotonic() < deadline:
            health = http.get("/healthz").json()
            if health["busy"] == 0 and health["waiting"] == 0:
                break
            time.sleep(0.1)
    assert (health["busy"], health["waiting"]) == (0, 0), health
    assert health["cancelled"] - before["cancelled"] == 10
    assert health["jobs"] - before["jobs"] >= 2  # two ran on the workers (which were stopped), the others waited
    assert _claims(server) == []


def test_a_probe_whose_client_hung_up_runs_on_while_another_waits_for_it(server):
    body = {**PLAN, "probe": "slow", "target_batch": 65}
    before = _warm(server)["cancelled"]

    def ask(timeout: float) -> str:
        with server.client(timeout=timeout) as http:
            try:
                return str(http.post("/v1/plan", json=body).status_code)
            except httpx.TimeoutException:
                return "gone"

    with concurrent.futures.ThreadPoolExecutor(2) as pool, server.client() as http:
        first, second = pool.submit(ask, 1), pool.submit(ask, 3)
        assert first.result() == "gone"
        time.sleep(0.5)
        during = http.get("/healthz").json()  # the first job runs on: the second waits for its probe
        assert second.result() == "gone"
        deadline = time.monotonic() + 20
        while (after := http.get("/healthz").json())["busy"] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert during["busy"] == 2 and during["cancelled"] == before, during
    assert after["busy"] == 0 and after["cancelled"] == before + 2, after  # then both clients had gone
    assert _claims(server) == []


def _claims(server: Server) -> list:
    return rows(server.store, "autotune_claims", "fingerprint", "owner")


def test_a_store_file_removed_while_serving_is_made_again(server):
    if not server.store.startswith("sqlite"):
        pytest.skip("SQLite only: a store that is a file on this machine")
    for path in Path(server.store.removeprefix("sqlite:///")).parent.glob("plans.db*"):
        path.unlink()
    with server.client() as http:
        made = http.post("/v1/plan", json={**PLAN, "margin": 0.45})
        health = http.get("/healthz").json()
    assert made.status_code == 200, made.text
    assert rows(server.store, "autotune_entries", "fingerprint") == [(made.json()["fingerprint"],)]
    assert health["status"] == "ok" and health["store_reopened"] >= 1


def test_a_killed_server_restarts_with_its_store_intact(server):
    # The module's server, killed: this test comes last in the module.
    with server.client() as http:
        made = http.post("/v1/plan", json=PLAN)  # made here, or answered from what an earlier test made
        assert made.status_code == 200, made.text
        listed = http.get("/v1/plans").json()["plans"]
    server.kill()
    second = Server(server.folder, store=server.store)  # the same store, served with no token: open to every request
    try:
        with second.client() as http:  # the store, read without a probe worker
            fp = made.json()["fingerprint"]
            assert http.get("/v1/plans").json()["plans"] == listed
            kept = http.get(f"/v1/plans/{fp}").json()
            assert PLAN["target_batch"] in [p["target_batch"] for p in kept["plans"]]
            assert made.json()["plan"]["schedule"] in [p["schedule"] for p in kept["plans"]]
    finally:
        second.kill()  # before its forkserver has imported torch for a worker no request here needs
