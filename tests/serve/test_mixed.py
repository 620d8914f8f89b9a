"""autotune serve plans jobs whose ranks differ: a device (or a budget) per rank in a request, the plan
that gives each rank its own micro-batch and micro-steps, stored under fingerprints that cover every
rank's device in order, and reused. A real server on SQLite and on PostgreSQL, as in test_serve."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import Server, said

pytestmark = pytest.mark.slow

MIXED = {"target_batch": 512, "probe": "mlp", "device": "estimate:A100-80GB,estimate:T4-16GB"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_store_url) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("serve"), store=module_store_url, extra=("--probe-timeout", "120"))
    yield running
    running.stop()


def plan(server: Server, body: dict) -> dict:
    with server.client() as http:
        answer = http.post("/v1/plan", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def shares(answer: dict) -> list[tuple[str, int]]:
    """(device, samples) of each rank of a mixed plan."""
    made = answer["plan"]
    assert made["mixed"] is not None, "the plan gives every rank the same micro-batch"
    return [(r["device"], n) for r, n in zip(made["mixed"]["ranks"], made["per_rank_batch"], strict=True)]


def test_a_mixed_request_is_planned_per_rank_stored_and_reused(server):
    first, second = plan(server, MIXED), plan(server, MIXED)
    (a100, big), (t4, small) = shares(first)
    assert (a100, t4) == ("estimate:A100-80GB", "estimate:T4-16GB")
    assert big + small == 512 and big > small, "the A100 does not take the larger share"
    assert first["plan"]["world_size"] == 2 and first["plan"]["world_size_source"] == "the device list"
    assert (first["cached"], second["cached"]) == (False, True)
    assert second["fingerprint"] == first["fingerprint"]
    assert shares(second) == shares(first) and second["plan"]["schedule"] == first["plan"]["schedule"]
    assert second["plan"]["probe"]["from_store"]
    smaller = plan(server, {**MIXED, "target_batch": 256})  # within what rank 0's entry answers alone
    assert smaller["cached"] and smaller["fingerprint"] == first["fingerprint"]
    assert [d for d, _ in shares(smaller)] == [a100, t4] and sum(n for _, n in shares(smaller)) == 256
    with server.client() as http:
        entry = http.get(f"/v1/plans/{first['fingerprint']}").json()
    assert sorted((p["target_batch"], p["world_size"]) for p in entry["plans"]) == [(256, 2), (512, 2)]
    parts = entry["entry"]["components"]
    assert (parts["device"]["name"], [r["name"] for r in parts["ranks"]]) == \
        ("estimate:A100-80GB", ["estimate:A100-80GB", "estimate:T4-16GB"])


def test_the_fingerprint_covers_every_rank_s_device_in_order(server):
    body = {**MIXED, "margin": 0.2}  # settings no other test asks for
    ours = plan(server, body)
    swapped = plan(server, {**body, "device": "estimate:T4-16GB,estimate:A100-80GB"})
    alone = plan(server, {**body, "device": "estimate:A100-80GB"})
    assert [d for d, _ in shares(swapped)] == ["estimate:T4-16GB", "estimate:A100-80GB"]
    assert shares(swapped)[1][1] > shares(swapped)[0][1]
    assert alone["plan"]["mixed"] is None and alone["plan"]["world_size"] == 1
    assert len({ours["fingerprint"], swapped["fingerprint"], alone["fingerprint"]}) == 3
    ranks = [{r["fingerprint"] for r in a["plan"]["mixed"]["ranks"]} for a in (ours, swapped)]
    assert len(ranks[0]) == len(ranks[1]) == 2 and not ranks[0] & ranks[1], \
        "the A100 of A100,T4 and the A100 of T4,A100 share a fingerprint"
    assert alone["fingerprint"] not in ranks[0] | ranks[1]
    assert not (ours["cached"] or swapped["cached"] or alone["cached"])


def test_counts_and_a_budget_per_rank(server):
    counted = plan(server, {**MIXED, "device": "estimate:H100-80GB*2,estimate:A10G-24GB*2"})
    assert [d for d, _ in shares(counted)] == ["estimate:H100-80GB"] * 2 + ["estimate:A10G-24GB"] * 2
    assert sum(n for _, n in shares(counted)) == 512 and counted["plan"]["world_size"] == 4
    body = {**MIXED, "target_batch": 4096, "device": "estimate", "memory_budget": "1GiB,672MiB"}  # 28 MiB usable
    budgets, again = plan(server, body), plan(server, body)
    ranks = budgets["plan"]["mixed"]["ranks"]
    assert [r["budget_bytes"] for r in ranks] == [2**30, 672 * 2**20]
    assert ranks[1]["max_micro_batch"] < ranks[0]["max_micro_batch"] and shares(budgets)[0][1] > shares(budgets)[1][1]
    assert (budgets["cached"], again["cached"]) == (False, True) and shares(again) == shares(budgets)


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
