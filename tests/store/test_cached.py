"""Probing through the store: hits without probing, confirm runs that keep the store honest, measurements."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sqlalchemy import update

import autotune
from autotune.devices import get_device
from autotune.errors import BadInput
from autotune.probing import finder
from autotune.results.request import ProbeRequest
from autotune.store import cached, open_store, schema
from autotune.store.fingerprint import fingerprint
from autotune.store.store import Store
from autotune.workload import load_workload

BUDGET = "3MB"  # mlp fits 307 samples: memory sets the max


@pytest.fixture
def url(store_url) -> str:
    """A new store's URL, on SQLite and on PostgreSQL."""
    return store_url


@pytest.fixture
def counted(monkeypatch):
    """How often the probe ran in full, and how many real fit-rule runs a store hit made."""
    calls = {"probe": 0, "confirm": 0}
    real_probe, real_trial = finder.find_max_micro_batch, cached.run_trial

    def probe(*args, **kwargs):
        calls["probe"] += 1
        return real_probe(*args, **kwargs)

    def trial(*args, **kwargs):
        calls["confirm"] += 1
        return real_trial(*args, **kwargs)

    monkeypatch.setattr(finder, "find_max_micro_batch", probe)
    monkeypatch.setattr(cached, "run_trial", trial)
    return calls


def _cpu_plan(url: str, target: int = 1021, budget: str = BUDGET):
    return autotune.plan(target, probe="mlp", device="cpu", memory_budget=budget, store=url)


def _set_probe(url: str, digest: str, **changes) -> None:
    """Plant a fault: change the stored probe result behind the store's back."""
    store = open_store(url)
    stored = replace(store.get(digest).probe(), **changes)
    with store.engine.begin() as conn:
        conn.execute(update(schema.entries).where(schema.entries.c.fingerprint == digest).values(
            probe=json.dumps(stored.to_dict()), max_micro_batch=stored.max_micro_batch))


def test_an_estimate_seen_before_is_answered_from_the_store_without_estimating(url, counted):
    first = autotune.plan(512, probe="mlp", device="estimate", memory_budget="1GiB", store=url)
    assert counted["probe"] == 1 and not first.probe.from_store
    second = autotune.plan(512, probe="mlp", device="estimate", memory_budget="1GiB", store=url)
    assert counted == {"probe": 1, "confirm": 0}, "the second plan estimated again"
    assert second.probe.from_store and second.probe.fingerprint == first.probe.fingerprint
    assert second.notes[0].startswith(f"from the store (fingerprint {first.probe.fingerprint[:12]}, measured ")
    assert second.micro_batch == first.micro_batch and second.schedule == first.schedule
    store = open_store(url)
    assert store.get(first.probe.fingerprint).hits == 1
    assert [p["target_batch"] for p in store.plans(first.probe.fingerprint)] == [512]
    assert store.observations() == [], "an estimate measures nothing real"


def test_an_answer_stored_between_the_look_and_the_claim_is_served_not_probed_again(url, counted, monkeypatch):
    # Two jobs at once on a busy machine: the other job stored its answer after this one looked (a miss), and
    # let go of its claim before this one asked for it, so this one never waited. Holding the claim, it looks again.
    autotune.plan(512, probe="mlp", device="estimate", memory_budget="1GiB", store=url)  # the other job
    looks, real_get = [], Store.get

    def get(self, digest=None, **kwargs):
        looks.append(digest)
        return None if len(looks) == 1 else real_get(self, digest, **kwargs)  # the first look came too early

    monkeypatch.setattr(Store, "get", get)
    second = autotune.plan(512, probe="mlp", device="estimate", memory_budget="1GiB", store=url)
    assert len(looks) >= 2 and counted["probe"] == 1, "the job probed what the store already held"
    assert second.probe.from_store


def test_a_real_device_confirms_a_stored_answer_with_one_real_run(url, counted):
    first = _cpu_plan(url)
    assert first.probe.max_micro_batch == 307 and first.probe.limited_by == "memory"
    counted["confirm"] = 0
    second = _cpu_plan(url)
    assert counted == {"probe": 1, "confirm": 1}
    assert second.probe.from_store and second.probe.max_micro_batch == 307
    assert second.probe.trials[-1].source == "real" and second.probe.trials[-1].batch == 307
    assert "confirmed by one real run" in second.notes[0]
    sources = [o.source for o in open_store(url).observations(first.probe.fingerprint)]
    assert sources.count("probe") == first.probe.real_runs and sources[-1] == "confirm"


def test_a_max_that_memory_set_answers_larger_and_smaller_targets(url, counted):
    _cpu_plan(url, 1021)
    assert _cpu_plan(url, 4096).probe.from_store  # per rank 4096 > 307: memory still sets the max
    smaller = _cpu_plan(url, 200)  # the probe would stop at 200, which fits: the stored 307 answers it
    assert counted["probe"] == 1 and smaller.probe.from_store
    assert (smaller.probe.max_micro_batch, smaller.probe.max_batch, smaller.probe.limited_by) == (200, 200, "max_batch")
    entry = open_store(url).get(smaller.probe.fingerprint)
    assert entry.max_micro_batch == 307 and entry.limited_by == "memory", "the memory-limited entry is kept"


def test_a_stored_probe_serves_every_target_it_answers_without_probing_again(url, counted):
    # Targets 100, 101, 100 probed three times, and 100 after 2048 found the memory limit once more.
    served = [_cpu_plan(url, t, "8MiB").probe.from_store for t in (100, 101, 100)]
    assert served == [False, False, True] and counted["probe"] == 2
    big = _cpu_plan(url, 2048, "8MiB")
    assert (big.probe.max_micro_batch, big.probe.limited_by, counted["probe"]) == (1419, "memory", 3)
    counted["confirm"] = 0
    small = _cpu_plan(url, 100, "8MiB")
    assert small.probe.from_store and counted == {"probe": 3, "confirm": 1}  # one confirm run, no probe
    assert "this probe stops at 100" in small.probe.notes[1]
    fresh = autotune.plan(100, probe="mlp", device="cpu", memory_budget="8MiB", store=False)
    assert small.schedule == fresh.schedule and small.probe.max_micro_batch == fresh.probe.max_micro_batch == 100
    assert small.probe.limited_by == fresh.probe.limited_by == "max_batch"
    assert small.predicted_peak_bytes == fresh.predicted_peak_bytes  # the CPU's estimate is exact
    entry = open_store(url).get(big.probe.fingerprint)
    assert (entry.max_micro_batch, entry.limited_by, entry.hits) == (1419, "memory", 1)


def test_an_estimate_serves_a_smaller_target_from_the_memory_limit_it_found(url, counted):
    big = autotune.plan(10**6, probe="mlp", device="estimate", memory_budget="1GiB", store=url)
    assert big.probe.limited_by == "memory"
    small = autotune.plan(512, probe="mlp", device="estimate", memory_budget="1GiB", store=url)
    assert counted == {"probe": 1, "confirm": 0} and small.probe.from_store
    assert small.micro_batch == small.probe.max_micro_batch == 512 and small.probe.allocated_peak_bytes is None
    assert small.probe.breakdown["parameters"] == big.probe.breakdown["parameters"]
    assert 0 < small.probe.peak_bytes < big.probe.peak_bytes


@pytest.mark.parametrize("damage", ["{not json", "{}"])
def test_a_damaged_entry_is_probed_again_and_replaced(url, counted, damage):
    first = _cpu_plan(url, 64)
    digest = first.probe.fingerprint
    store = open_store(url)
    with store.engine.begin() as conn:
        conn.execute(update(schema.entries).where(schema.entries.c.fingerprint == digest).values(probe=damage))
    again = _cpu_plan(url, 64)
    assert counted["probe"] == 2 and not again.probe.from_store and again.probe.fingerprint == digest
    entry = store.get(digest)
    assert entry.damage is None and entry.valid and entry.probe().max_micro_batch == 64
    assert _cpu_plan(url, 64).probe.from_store


def test_a_confirm_run_that_disagrees_invalidates_the_entry_and_the_probe_runs(url, counted):
    first = _cpu_plan(url)
    digest = first.probe.fingerprint
    _set_probe(url, digest, peak_bytes=int(first.probe.peak_bytes * 0.8))  # a stored peak no run bears out
    again = _cpu_plan(url)
    assert counted["probe"] == 2 and not again.probe.from_store
    confirm = [o for o in open_store(url).observations(digest) if o.source == "confirm"]
    assert len(confirm) == 1 and "above the stored" in confirm[0].note
    entry = open_store(url).get(digest)
    assert entry.valid and entry.probe().peak_bytes == again.probe.peak_bytes  # replaced by the new probe


def test_a_stored_max_that_no_longer_fits_is_caught(url, counted):
    first = _cpu_plan(url)
    _set_probe(url, first.probe.fingerprint, max_micro_batch=400)  # more than 3MB holds
    again = _cpu_plan(url)
    assert not again.probe.from_store and again.probe.max_micro_batch == 307
    note = [o.note for o in open_store(url).observations(first.probe.fingerprint) if o.source == "confirm"][0]
    assert "micro-batch 400" in note and ("out of memory" in note or "over the" in note)


def test_a_stored_max_with_room_for_more_now_is_caught(url, counted):
    wl, dev = load_workload("mlp"), get_device("cpu", memory_budget=4_000_000)
    small = _cpu_plan(url, budget=BUDGET).probe  # 307 under 3MB
    digest = fingerprint(wl, dev, ProbeRequest()).digest
    open_store(url).put(digest, result=replace(small, fingerprint=digest))  # the 3MB answer, stored for 4MB
    bigger = _cpu_plan(url, budget="4MB")
    assert not bigger.probe.from_store and bigger.probe.max_micro_batch > 307
    note = [o.note for o in open_store(url).observations(digest) if o.source == "confirm"][0]
    assert note.startswith("micro-batch 308 would fit")


def test_a_run_records_what_it_measured(url):
    plan = _cpu_plan(url, 64)
    result = autotune.run(plan=plan, steps=2, verify=False, store=url)
    rows = [o for o in open_store(url).observations(plan.probe.fingerprint) if o.source == "run"]
    assert len(rows) == 1
    row = rows[0]
    assert row.batch == plan.micro_batch and row.peak_reserved_bytes == result.peak_bytes
    assert row.peak_allocated_bytes == result.allocated_peak_bytes is not None
    assert row.estimated_peak_bytes == plan.predicted_peak_bytes and row.throughput == result.samples_per_s
    assert row.device.startswith("cpu") and not row.oom


def test_no_store_when_asked_for_none(url, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_STORE", url)
    result = autotune.probe("mlp", device="estimate", memory_budget="1GiB", max_batch=64, store=False)
    assert result.fingerprint is None and not open_store(url).entries()
    taken = autotune.probe("mlp", device="estimate", memory_budget="1GiB", max_batch=64)
    assert taken.fingerprint is not None and open_store(url).get(taken.fingerprint) is not None


def test_an_unusable_store_fails_before_any_work(counted):
    with pytest.raises(BadInput, match="store .*does not exist"):
        autotune.plan(64, probe="mlp", device="cpu", memory_budget=BUDGET, store="sqlite:////no/such/dir/p.db")
    with pytest.raises(BadInput, match="neither a database URL"):
        autotune.probe("mlp", device="cpu", memory_budget=BUDGET, store=42)  # type: ignore[arg-type]
    assert counted["probe"] == 0


def test_a_workload_without_a_fingerprint_is_probed_and_not_kept(url):
    import torch
    from torch import nn

    def model() -> nn.Module:
        net = nn.Linear(4, 1)
        net.weight.detach().numpy()  # needs real data: cannot be built on shape-only tensors
        return net

    wl = autotune.Workload(name="real-only", model=model, batch=lambda n, g: torch.randn(n, 4, generator=g),
                           loss=lambda m, b: m(b).pow(2).mean())
    result = autotune.probe(wl, device="cpu", memory_budget="1MB", max_batch=16, store=url)
    assert result.fingerprint is None and "not kept in the store" in result.notes[-1]
    assert Store(url).entries() == []
