"""Stopping ``autotune serve`` while it probes: the running probe ends, its claim is released and its
request answered, within seconds (a server of its own, on a free localhost port)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from ..stores import rows
from .server import PLAN, SLOW, Server

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
