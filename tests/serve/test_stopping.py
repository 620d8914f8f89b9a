"""Stopping ``autotune serve`` while it probes: the running probe ends, its claim is released and its
request answered, within seconds (two servers on one store, on free localhost ports, shared by the tests)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..stores import rows
from .server import PLAN, SLOW, Server, metrics, post_plan, side_by_side

pytestmark = pytest.mark.slow


def _sigterm_mid_probe(server: Server, store_url: str) -> None:
    """SIGTERM to ``server`` while it probes ``slow``: the probe ends, its request is answered 503 and its
    claim released, within seconds."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        def ask() -> httpx.Response:
            with server.client(timeout=20) as http:
                return http.post("/v1/plan", json={**PLAN, "probe": "slow", "target_batch": 64})

        asked = pool.submit(ask)
        deadline = time.monotonic() + 60
        while not rows(store_url, "autotune_claims"):  # the probe is running once it holds its claim
            assert time.monotonic() < deadline and not asked.done(), "the probe never started"
            time.sleep(0.1)
        stopped = time.monotonic()
        server.process.terminate()
        answer = asked.result()
        server.process.wait(15)
        took = time.monotonic() - stopped
    assert answer.status_code == 503 and "the service is stopping" in answer.json()["detail"], answer.text
    assert took < 10, f"the server took {took:.1f} s to stop"
    assert rows(store_url, "autotune_claims") == []


#: The servers' probe time limit (--probe-timeout): what the sleepy probe waits for its 504, and well over what the
#: gated probe takes once its gate is open and what each probe takes to hold its claim.
LIMIT_S = 3


@pytest.fixture(scope="module")
def servers(tmp_path_factory, module_store_url) -> Iterator[tuple[Server, Server, Path]]:
    """Servers A and B on one store, started side by side, serving ``sleepy`` and ``slow`` (which sleep holding
    their store claim) and ``gated`` (whose estimate waits for the file ``go``)."""
    from ..stores import GATED

    folder = tmp_path_factory.mktemp("stopping")
    (folder / "probes").mkdir()
    (folder / "probes" / "sleepy.py").write_text(SLOW)
    (folder / "probes" / "slow.py").write_text(SLOW)
    (folder / "probes" / "gated.py").write_text(GATED.replace("os.environ['AUTOTUNE_TEST_GATE']",
                                                              repr(str(folder / "go"))))
    for name in ("a", "b"):
        (folder / name).mkdir()
    made = side_by_side([folder / "a", folder / "b"], module_store_url,
                        ("--probes", str(folder / "probes"), "--probe-timeout", str(LIMIT_S)))
    yield made[0], made[1], folder
    for server in made:
        server.stop()


def test_a_probe_past_the_time_limit_is_stopped_with_504_and_the_next_request_is_served(servers):
    server = servers[0]  # A, before the next test kills it
    with server.client(timeout=60) as http:
        start = time.monotonic()
        sleepy = http.post("/v1/plan", json={**PLAN, "probe": "sleepy", "target_batch": 64})
        took = time.monotonic() - start
        after = http.post("/v1/plan", json={**PLAN, "target_batch": 64})
    counted = metrics(server)
    assert sleepy.status_code == 504, sleepy.text
    assert sleepy.json()["detail"] == (f"probe 'sleepy' ran past the {LIMIT_S} s limit (--probe-timeout) and was "
                                       "stopped; the service is fine, the next request starts a new worker")
    assert rows(server.store, "autotune_claims") == []  # the stopped worker's claim released
    assert took < 40, f"the time-limit answer took {took:.1f} s"
    assert after.status_code == 200 and after.json()["plan"]["target_batch"] == 64, after.text
    assert counted["autotune_workers_restarted_total"] >= 1
    assert counted[("autotune_requests_total", "/v1/plan", "POST", "504")] == 1


def test_a_server_killed_mid_probe_takes_its_workers_and_claims_and_sigterm_ends_a_probe_with_503(servers):
    """``kill -9`` of server A alone (not its process group): its worker, the forkserver and the resource tracker
    end too, the claim is free well within its lease, and replica B probes the workload itself. Then SIGTERM to
    B while it probes: the probe ends, its request is answered 503 and its claim released
    (:func:`_sigterm_mid_probe`)."""
    from autotune.store.claims import LEASE_S

    a, b, folder = servers
    store_url = a.store
    body = {**PLAN, "probe": "gated", "target_batch": 64}
    probed = metrics(b)["autotune_probe_seconds_count"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(post_plan, a, body)
        deadline = time.monotonic() + 120
        while not (held := rows(store_url, "autotune_claims", "fingerprint", "owner")):
            assert time.monotonic() < deadline and not asked.done(), "the probe never started"
            time.sleep(0.1)
        family = _descendants(a.process.pid)
        assert len(family) >= 2, family  # the worker and the forkserver at least
        os.kill(a.process.pid, signal.SIGKILL)
        a.process.wait(30)
        killed = time.monotonic()
        while (left := [p for p in family if _running(p)]) or rows(store_url, "autotune_claims"):
            assert time.monotonic() - killed < LEASE_S, (left, rows(store_url, "autotune_claims", "owner"))
            time.sleep(0.2)
        assert isinstance(asked.result(), httpx.HTTPError)
    (folder / "go").touch()
    answer = post_plan(b, body)
    assert not isinstance(answer, Exception) and answer.status_code == 200, answer
    assert not answer.json()["cached"] and answer.json()["fingerprint"] == held[0][0]  # probed by B
    assert metrics(b)["autotune_probe_seconds_count"] == probed + 1
    _sigterm_mid_probe(b, store_url)


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [c for c, p in parents.items() if p == parent]
        found += children
        todo += children
    return found


def _running(pid: int) -> bool:
    """Is ``pid`` a process that has not ended (a zombie has)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
