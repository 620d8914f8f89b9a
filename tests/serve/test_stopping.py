"""Stopping ``autotune serve`` while it probes: the running probe ends, its claim is released and its
request answered, within seconds (a server of its own, on a free localhost port)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from ..stores import rows
from .server import PLAN, SLOW, Server, metrics

pytestmark = pytest.mark.slow


def test_sigterm_ends_a_running_probe_answers_503_and_releases_its_claim(tmp_path, store_url):
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "slow.py").write_text(SLOW)
    server = Server(tmp_path, store=store_url, extra=("--probes", str(tmp_path / "probes"), "--probe-timeout", "60"))
    try:
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
    finally:
        server.stop()


def test_a_probe_past_the_time_limit_is_stopped_with_504_and_the_next_request_is_served(tmp_path, store_url):
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "sleepy.py").write_text(SLOW)  # sleeps holding its store claim
    server = Server(tmp_path, store=store_url, extra=("--probes", str(tmp_path / "probes"), "--probe-timeout", "2"))
    try:
        with server.client(timeout=60) as http:
            start = time.monotonic()
            sleepy = http.post("/v1/plan", json={**PLAN, "probe": "sleepy", "target_batch": 64})
            took = time.monotonic() - start
            after = http.post("/v1/plan", json={**PLAN, "target_batch": 64})
        counted = metrics(server)
    finally:
        server.stop()
    assert sleepy.status_code == 504, sleepy.text
    assert sleepy.json()["detail"] == ("probe 'sleepy' ran past the 2 s limit (--probe-timeout) and was stopped; "
                                       "the service is fine, the next request starts a new worker")
    assert rows(store_url, "autotune_claims") == []  # the stopped worker's claim released
    assert took < 40, f"the time-limit answer took {took:.1f} s"
    assert after.status_code == 200 and after.json()["plan"]["target_batch"] == 64, after.text
    assert counted["autotune_workers_restarted_total"] >= 1
    assert counted[("autotune_requests_total", "/v1/plan", "POST", "504")] == 1
