"""Two ``autotune serve`` replicas on one store, on SQLite and on a real PostgreSQL server: a request to
either reuses what the other probed, and a replica killed while probing blocks its fingerprint only
until its claim's lease runs out; a store that fails is said and counted."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..stores import GATED, execute, rows
from .server import PLAN, Server, metrics, post_plan, side_by_side

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, module_store_url) -> Iterator[tuple[Server, Server, Path]]:
    """Replicas A and B on one store, serving the gated probe (its estimate waits for the file ``go``)."""
    folder = tmp_path_factory.mktemp("replicas")
    (folder / "probes").mkdir()
    (folder / "probes" / "gated.py").write_text(GATED.replace("os.environ['AUTOTUNE_TEST_GATE']",
                                                              repr(str(folder / "go"))))
    extra = ("--probes", str(folder / "probes"), "--probe-timeout", "120")
    for name in ("a", "b"):
        (folder / name).mkdir()
    made = side_by_side([folder / "a", folder / "b"], module_store_url, extra)
    yield made[0], made[1], folder
    for server in made:
        server.stop()


def test_a_request_to_either_replica_reuses_what_the_other_probed(replicas):
    a, b, _ = replicas
    with a.client() as http:
        probed = http.post("/v1/plan", json=PLAN).json()
    with b.client() as http:
        reused = [http.post("/v1/plan", json={**PLAN, "target_batch": t}).json() for t in (512, 256)]
        health = http.get("/healthz").json()
    assert not probed["cached"] and [r["cached"] for r in reused] == [True, True]
    assert {r["fingerprint"] for r in reused} == {probed["fingerprint"]}
    assert reused[0]["plan"]["schedule"] == probed["plan"]["schedule"]
    assert health["jobs"] == 0, "B took the fingerprint again instead of answering from the store"
    assert metrics(b)[("autotune_plans_total", "hit")] == 2


def test_a_replica_killed_while_probing_blocks_the_fingerprint_only_until_its_lease_runs_out(replicas):
    a, b, folder = replicas  # A is killed: the module's last test but one
    body = {**PLAN, "probe": "gated", "target_batch": 64}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        asked_a = pool.submit(post_plan, a, body)
        (held,) = _claims_once(a.store, lambda claims: claims, asked_a)  # A's worker probes, holding the claim
        a.kill()
        assert isinstance(asked_a.result(), httpx.HTTPError)
        # As if A had run on another host, where B cannot see that its process is gone: the claim holds
        # until its lease runs out, two seconds from now, and the row says so to every replica.
        lease_ends = time.time() + 2
        execute(b.store, "update autotune_claims set owner = :owner, expires_at = :ends",
                owner="elsewhere:" + held[1].partition(":")[2], ends=lease_ends)
        asked_b = pool.submit(post_plan, b, body)
        (taken,) = _claims_once(b.store, lambda claims: [c for c in claims if not c[1].startswith("elsewhere:")],
                                asked_b)
        assert taken[1].startswith(socket.gethostname() + ":") and taken[2] >= lease_ends - 0.01, (taken, lease_ends)
        (folder / "go").touch()
        answer = asked_b.result()
    assert not isinstance(answer, Exception) and answer.status_code == 200, answer
    assert not answer.json()["cached"] and answer.json()["fingerprint"] == held[0]  # probed once more, by B
    assert rows(b.store, "autotune_claims") == []



def _claims_once(store: str, pick, asked: concurrent.futures.Future, timeout: float = 180) -> list:
    """The claims ``pick`` keeps of the store's (fingerprint, owner, claimed_at, expires_at), once there are any."""
    deadline = time.monotonic() + timeout
    while not (found := pick(claims := rows(store, "autotune_claims", "fingerprint", "owner", "claimed_at",
                                            "expires_at"))):
        assert time.monotonic() < deadline and not asked.done(), (claims, asked.done() and asked.result())
        time.sleep(0.05)
    return found


def test_a_store_that_fails_is_answered_503_and_counted(replicas, request):
    _, b, _ = replicas  # after A was killed: the store goes now, the last test of the module
    if b.store.startswith("sqlite"):  # the store's folder goes: it cannot be made again
        import shutil

        shutil.rmtree(Path(b.store.removeprefix("sqlite:///")).parent)
    else:  # the database goes, its connections with it
        request.getfixturevalue("postgres").execute(f'DROP DATABASE "{b.store.rsplit("/", 1)[1]}" WITH (FORCE)')
    with b.client() as http:
        failed = http.post("/v1/plan", json={**PLAN, "target_batch": 100})
        health = http.get("/healthz")
    assert failed.status_code == 503 and "\n" not in failed.json()["detail"], failed.text
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    where = b.store.partition("://")[2]  # the SQLite file's path; PostgreSQL's user, host, port and database
    for said in (failed.text, health.text):
        assert not [part for part in where.replace("@", "/").replace(":", "/").split("/") if len(part) > 4 and
                    part in said and part not in "postgresql"], said
    assert metrics(b)[("autotune_store_errors_total", "server")] >= 1
