"""The plan store as a database: entries, plans, measurements, claims, pruning, and several writers at once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from autotune.errors import BadInput
from autotune.results.device import DeviceInfo
from autotune.results.plan import Plan
from autotune.results.probe import ProbeResult, Trial
from autotune.store import Observation, open_store
from autotune.store.schema import STORE_SCHEMA
from autotune.store.store import Store, accuracy, owner_id

from ..stores import execute, rows

FP = "ab" * 32
OTHER = "cd" * 32


def probe_result(*, max_micro_batch: int = 48, max_batch: int = 1024, limited_by: str = "memory",
                 kind: str = "cuda", peak: int = 900) -> ProbeResult:
    device = DeviceInfo(name="cuda:0", kind=kind, estimated=kind == "estimate", capacity_bytes=1000,
                        capacity_source="test", measured_by="test", summary="cuda:0 (Test GPU)", torch="2",
                        model="Test GPU")
    return ProbeResult(workload="mlp", device=device, estimated=kind == "estimate", max_micro_batch=max_micro_batch,
                       max_batch=max_batch, capacity_bytes=1000, usable_bytes=900, margin=0.1, peak_bytes=peak,
                       predicted_peak_bytes=peak, breakdown={"activations": peak}, limited_by=limited_by,
                       curve_lines=((100.0, 16.0),),
                       trials=(Trial(batch=max_micro_batch, source="real", peak_bytes=peak, fits=True, seconds=0.1),),
                       fingerprint=FP)


@pytest.fixture
def store(store_url) -> Iterator[Store]:
    """A new store, on SQLite and on PostgreSQL."""
    made = Store(store_url)
    yield made
    made.close()


@pytest.fixture
def sqlite_store(tmp_path) -> Store:
    """A new store in an SQLite file (for what a file does: be removed, replaced, read-only)."""
    return Store(f"sqlite:///{tmp_path / 'plans.db'}")


def served(result: ProbeResult) -> ProbeResult:
    """``result`` as the store serves it: a hit, when put."""
    return replace(result, from_store=True)


def test_an_entry_round_trips_with_its_probe_result_and_parts(store):
    result = probe_result()
    assert store.get(FP) is None
    assert store.put(FP, parts={"margin": 0.1}, result=result)
    entry = store.get(FP)
    assert entry is not None and entry.valid and entry.hits == 0
    assert entry.probe() == result and entry.components == {"margin": 0.1}
    assert (entry.device, entry.device_kind, entry.max_micro_batch) == ("Test GPU", "cuda", 48)
    store.put(FP, result=served(result))
    store.put(FP, result=served(result))
    assert store.get(FP).hits == 2 and store.get(FP).last_hit_at is not None


@pytest.mark.parametrize("limited_by,stored_max,asked,answers", [
    ("memory", 48, 48, True),       # the limit equals the max memory set
    ("memory", 48, 4096, True),     # memory set it: any larger limit has the same answer
    ("memory", 48, 47, True),       # a smaller limit: the probe would stop there, and 47 < 48 fits
    ("memory", 48, 1, True),
    ("max_batch", 64, 64, True),    # the limit set it: that limit
    ("max_batch", 64, 32, True),    # and every smaller one
    ("max_batch", 64, 65, False),   # more might fit
    ("max_batch", 64, 128, False),
])
def test_an_entry_answers_the_limits_its_answer_holds_for(store, limited_by, stored_max, asked, answers):
    store.put(FP, parts={}, result=probe_result(max_micro_batch=stored_max, limited_by=limited_by,
                                                max_batch=stored_max if limited_by == "max_batch" else 1024))
    assert store.get(FP).answers(asked) is answers


def test_an_invalidated_entry_answers_nothing_and_says_why(store):
    store.put(FP, parts={}, result=probe_result())
    store.put(FP, invalid="micro-batch 48 ran out of memory")
    entry = store.get(FP)
    assert not entry.valid and not entry.answers(4096)
    assert entry.invalid_reason == "micro-batch 48 ran out of memory"
    assert store.put(FP, parts={}, result=probe_result(max_micro_batch=40))  # a new probe replaces it
    assert store.get(FP).valid and store.get(FP).max_micro_batch == 40


def test_a_limited_result_never_replaces_one_that_memory_limited(store):
    assert store.put(FP, parts={}, result=probe_result(max_micro_batch=48, limited_by="memory"))
    assert not store.put(FP, parts={}, result=probe_result(max_micro_batch=16, max_batch=16,
                                                           limited_by="max_batch"))
    assert store.get(FP).max_micro_batch == 48
    assert store.put(FP, parts={}, result=probe_result(max_micro_batch=50, limited_by="memory"))
    assert store.get(FP).max_micro_batch == 50


def test_a_result_limited_lower_never_replaces_one_limited_higher(store):
    assert store.put(FP, parts={}, result=probe_result(max_micro_batch=101, max_batch=101, limited_by="max_batch"))
    assert not store.put(FP, parts={}, result=probe_result(max_micro_batch=100, max_batch=100,
                                                           limited_by="max_batch"))
    assert store.get(FP).max_batch == 101
    assert store.put(FP, parts={}, result=probe_result(max_micro_batch=102, max_batch=102, limited_by="max_batch"))
    assert store.put(FP, parts={}, result=probe_result(max_micro_batch=48, limited_by="memory"))
    assert store.get(FP).limited_by == "memory"


def test_plans_are_kept_per_target_and_replaced_when_made_again(store):
    from autotune.planning.planner import make_plan

    store.put(FP, parts={}, result=probe_result())
    for target in (100, 200, 100):
        store.put(FP, plan=make_plan(target, 48))
    made = [Plan.from_dict(p) for p in store.plans(FP)]
    assert sorted(p.target_batch for p in made) == [100, 200]
    assert made[0].target_batch == 100  # the most recent first


def test_measurements_and_how_far_the_estimates_were(store):
    rows = [
        Observation(fingerprint=FP, source="probe", device="H100", device_kind="cuda", batch=8,
                    peak_reserved_bytes=110, peak_allocated_bytes=100, estimated_peak_bytes=100),
        Observation(fingerprint=FP, source="confirm", device="H100", device_kind="cuda", batch=8,
                    peak_reserved_bytes=130, estimated_peak_bytes=100),
        Observation(fingerprint=FP, source="probe", device="H100", device_kind="cuda", batch=9, oom=True,
                    estimated_peak_bytes=120, runs_before=1),
        Observation(fingerprint=OTHER, source="run", device="A100", device_kind="cuda", batch=4,
                    peak_reserved_bytes=90, estimated_peak_bytes=100, throughput=250.0),
    ]
    ids = store.record(*rows)
    assert len(ids) == 4 and len(set(ids)) == 4
    assert [o.batch for o in store.observations(FP)] == [8, 8, 9]
    table = {a["device"]: a for a in store.accuracy()}
    assert table["H100"]["measurements"] == 3 and table["H100"]["ooms"] == 1
    assert table["H100"]["compared"] == 2
    assert table["H100"]["mean_error"] == pytest.approx(0.2)
    assert table["H100"]["worst_error"] == pytest.approx(0.3)
    assert table["H100"]["allocated_mean_error"] == pytest.approx(0.0)
    assert table["H100"]["ooms_estimated_to_fit"] == 1
    assert table["A100"]["mean_error"] == pytest.approx(-0.1)
    assert store.observations(OTHER)[0].throughput == 250.0
    assert [o.runs_before for o in store.observations(FP)] == [0, 0, 1]
    from sqlalchemy import text

    with store.engine.begin() as conn:  # the table's column keeps its name: stores written before read the same
        assert sorted(conn.execute(text("SELECT retries FROM autotune_measurements")).scalars()) == [0, 0, 0, 1]


def test_a_reported_measurement_takes_runs_before_under_its_former_name_too():
    pytest.importorskip("pydantic")
    from autotune.serve.bodies import MeasurementRequest

    body = {"fingerprint": FP, "device": "NVIDIA H100", "batch": 8, "peak_reserved_bytes": 100}
    assert MeasurementRequest.model_validate({**body, "retries": 2}).runs_before == 2
    assert MeasurementRequest.model_validate({**body, "runs_before": 3}).model_dump()["runs_before"] == 3


def test_accuracy_ignores_rows_without_both_figures():
    rows = [Observation(fingerprint=FP, source="run", device="cpu", device_kind="cpu", batch=2,
                        peak_reserved_bytes=100)]
    assert accuracy(rows)[0]["compared"] == 0 and accuracy(rows)[0]["mean_error"] is None


def test_observations_are_validated():
    with pytest.raises(ValueError, match="source"):
        Observation(fingerprint=FP, source="guess", device="x", device_kind="cuda", batch=1)
    with pytest.raises(ValueError, match="batch"):
        Observation(fingerprint=FP, source="run", device="x", device_kind="cuda", batch=0)
    with pytest.raises(ValueError, match="peak_reserved_bytes"):
        Observation(fingerprint=FP, source="run", device="x", device_kind="cuda", batch=1, peak_reserved_bytes=-1)


def test_find_takes_a_unique_prefix(store):
    store.put(FP, parts={}, result=probe_result())
    store.put("ab" * 31 + "ff", parts={}, result=probe_result())
    with pytest.raises(BadInput, match="several"):
        store.find("ababab")
    assert store.find(FP[:-1]).fingerprint == FP
    with pytest.raises(BadInput, match="no entry"):
        store.find("0123456")
    with pytest.raises(BadInput, match="at least 6 hex"):
        store.find("ab")


def test_rm_and_gc(store):
    store.put(FP, parts={}, result=probe_result())
    store.put(OTHER, parts={}, result=probe_result())
    store.put(FP, plan=Plan.from_dict(_plan_dict()))
    store.record(Observation(fingerprint=FP, source="run", device="x", device_kind="cuda", batch=1,
                             peak_reserved_bytes=1))
    assert store.remove([FP]) == 1
    assert store.get(FP) is None and store.plans(FP) == [] and store.observations(FP) == []
    store.put(OTHER, invalid="the confirm run disagreed")
    assert store.gc(dry_run=True)["entries"] == 1 and store.get(OTHER) is not None
    assert store.gc()["entries"] == 1 and store.get(OTHER) is None
    store.put(FP, parts={}, result=probe_result())
    assert store.gc(older_than_s=3600)["entries"] == 0
    assert store.gc(older_than_s=0)["entries"] == 1


def _plan_dict() -> dict:
    from autotune.planning.planner import make_plan

    return make_plan(96, 48).to_dict()


def test_a_store_written_by_a_newer_autotune_is_refused(store_url):
    url = store_url
    store = Store(url)
    from sqlalchemy import update

    from autotune.store import schema

    with store.engine.begin() as conn:
        conn.execute(update(schema.info).where(schema.info.c.key == "schema").values(value=str(STORE_SCHEMA + 1)))
    store.engine.dispose()
    with pytest.raises(BadInput, match="newer"):
        Store(url)


@pytest.mark.parametrize("url,match", [
    ("not a url", "not a database URL"),
    ("nosuchdb://x/y", "names no database driver"),
    ("sqlite:////no/such/folder/plans.db", "does not exist"),
])
def test_unusable_urls_are_refused_naming_the_parameter(url, match):
    with pytest.raises(BadInput, match=f"^store .*{match}"):
        open_store(url)


def test_a_claim_is_held_once_and_taken_over_from_a_dead_process(store):
    assert store.take(FP, "me") is None
    assert store.take(FP, "someone-else:1:1") == "me"  # "me" is no host:pid: assumed alive
    store.release(FP, "me")
    assert store.take(FP, "someone-else:1:1") is None
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = f"{socket.gethostname()}:{dead.stdout.strip()}:1"
    store.release(FP, "someone-else:1:1")
    assert store.take(FP, gone) is None
    assert store.take(FP, "alive") is None, "a claim whose process is gone is taken over"
    assert store.take(OTHER, "x", lease_s=-1) is None
    assert store.take(OTHER, "y") is None, "a claim whose lease ran out is taken over"


def test_single_flight_makes_the_second_wait_for_the_first(store):
    order: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with store.claim(FP) as waited:
            assert not waited
            inside.set()
            time.sleep(0.5)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(5)
    waits: list[str] = []
    with store.claim(FP, on_wait=waits.append, poll_s=0.02) as waited:
        order.append("second in")
    thread.join()
    assert waited and order == ["first done", "second in"] and len(waits) == 1
    assert store.take(FP, owner_id()) is None  # released


#: A claim's owner on another host: whether its process lives cannot be seen from here.
ELSEWHERE = "gpu-node-9:4242:1"


def test_a_claim_from_another_host_ends_with_its_lease(store):
    assert store.take(FP, ELSEWHERE, lease_s=0.5) is None
    (expires,) = rows(store.url, "autotune_claims", "expires_at")[0]
    assert expires == pytest.approx(time.time() + 0.5, abs=0.3)  # every process sees until when it holds
    assert store.take(FP, owner_id()) == ELSEWHERE
    time.sleep(0.6)
    assert store.take(FP, owner_id()) is None, "a claim whose lease ran out is taken over"
    assert rows(store.url, "autotune_claims", "owner") == [(owner_id(),)]


def _plant_claim(url: str, fingerprint: str, owner: str, ahead_s: float) -> None:
    """A claim row written behind the store's back: claimed now, expiring ``ahead_s`` from now."""
    now = time.time()
    execute(url, "INSERT INTO autotune_claims VALUES (:fp, :owner, :now, :until)", fp=fingerprint, owner=owner,
            now=now, until=now + ahead_s)


def test_a_claim_reaching_further_than_any_lease_is_taken_over_and_cleared(store, caplog):
    from autotune.store.claims import MAX_LEASE_S

    _plant_claim(store.url, FP, ELSEWHERE, 1e9)  # a holder whose clock is far ahead, or a row changed by hand
    _plant_claim(store.url, OTHER, ELSEWHERE, 1e9)
    with caplog.at_level("WARNING", logger="autotune.store"):
        assert store.take(FP, owner_id()) is None  # not waited for: 31 years
    store.release(FP, owner_id())
    assert f"the claim on {FP[:12]} by process 4242 on gpu-node-9 runs out 1e+09 s from now, later than any lease " \
           f"allows ({MAX_LEASE_S:.0f} s): its host's clock is ahead, or the row was changed by hand; taken over" \
           in caplog.text
    assert store.gc(dry_run=True)["claims"] == 1 and len(rows(store.url, "autotune_claims")) == 1
    assert store.gc()["claims"] == 1 and rows(store.url, "autotune_claims") == []
    _plant_claim(store.url, FP, ELSEWHERE, MAX_LEASE_S - 5)  # within the longest lease: held, and kept by gc
    assert store.take(FP, owner_id()) == ELSEWHERE and store.gc()["claims"] == 0


def test_a_lease_is_timed_by_the_servers_clock(postgres, monkeypatch):
    from types import SimpleNamespace

    from autotune.store import claims

    url = postgres.database()
    try:
        store = Store(url)
        ahead = time.time() + 3600
        monkeypatch.setattr(claims, "time", SimpleNamespace(time=lambda: ahead))  # this host's clock an hour ahead
        assert store.take(FP, owner_id(), lease_s=30) is None
        monkeypatch.undo()
        (claimed, expires), = rows(url, "autotune_claims", "claimed_at", "expires_at")
        assert claimed == pytest.approx(time.time(), abs=5) and expires - claimed == pytest.approx(30, abs=0.1)
        store.close()
    finally:
        postgres.drop(url)


@pytest.mark.parametrize("heartbeat", [True, False])
def test_a_claim_is_renewed_while_it_is_held(store, monkeypatch, heartbeat):
    from autotune.store import claims

    if not heartbeat:  # plant the fault: no renewal, and the claim goes with its first lease
        monkeypatch.setattr(claims.Heartbeat, "_beat", lambda self: None)
    with store.claim(FP, lease_s=0.6):
        time.sleep(1.5)  # past two leases
        taken = store.take(FP, ELSEWHERE)
    assert (taken is not None) is heartbeat
    if heartbeat:
        assert store.take(FP, ELSEWHERE) is None  # let go at the end of the block


def test_a_read_waits_for_no_writer(store):
    store.put(FP, parts={}, result=probe_result())
    holding, done = threading.Event(), threading.Event()

    def write() -> None:  # a writer holding its transaction (on SQLite, the write lock) for up to 10 s
        with store.engine.begin():
            holding.set()
            done.wait(10)

    writer = threading.Thread(target=write)
    writer.start()
    assert holding.wait(10)
    read = store.get(FP)
    still_held = not done.is_set() and writer.is_alive()
    done.set()
    writer.join()
    assert read is not None and still_held, "the read waited for the writer to finish"


def test_of_many_asking_at_once_one_gets_the_claim(store):
    start = threading.Barrier(8)
    got: list[str | None] = []

    def ask(i: int) -> None:
        start.wait(10)
        got.append(store.take(FP, f"node-{i}:1:1"))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(g is None for g in got) == [False] * 7 + [True], got
    (owner,) = rows(store.url, "autotune_claims", "owner")
    assert all(g == owner[0] for g in got if g is not None), got  # each loser names the holder


_WRITER = """
import sys, time
from autotune.store.store import Store
from autotune.store.schema import Observation
from autotune.planning.planner import make_plan
url, me, n, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
store = Store(url)
time.sleep(max(0.0, start - time.time()))  # both write from the same moment
for i in range(n):
    store.record(Observation(fingerprint=me * 32, source="reported", device=me, device_kind="cuda", batch=i + 1,
                             peak_reserved_bytes=i))
    store.put(me * 32, plan=make_plan(i + 1, 8))
    store.take("ee" * 32, me) is None and store.release("ee" * 32, me)
print("ok")
"""


@pytest.mark.slow
def test_two_processes_writing_one_store_at_once_lose_nothing(store_url):
    url = store_url
    n = 150
    Store(url)  # made once; the writers open it concurrently
    start = str(time.time() + 3)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, url, me, str(n), start], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for me in ("aa", "bb")]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    store = Store(url)
    for me in ("aa", "bb"):
        assert [o.batch for o in store.observations(me * 32)] == list(range(1, n + 1))
        assert sorted(json.loads(json.dumps(p))["target_batch"] for p in store.plans(me * 32)) == \
            list(range(1, n + 1))
    assert store.counts()["measurements"] == 2 * n


def _damage(store: Store, **values) -> None:
    """Plant a fault: change an entry's row behind the store's back."""
    from sqlalchemy import update

    from autotune.store import schema

    with store.engine.begin() as conn:
        conn.execute(update(schema.entries).where(schema.entries.c.fingerprint == FP).values(**values))


@pytest.mark.parametrize("values,words", [
    ({"probe": "{not json"}, "probe result cannot be read (JSONDecodeError"),
    ({"probe": "{}"}, "probe result cannot be read (ResultFileError"),
    ({"components": "[1, 2"}, "parts are not a JSON object"),
    pytest.param({"max_micro_batch": "abc"}, "max_micro_batch column holds 'abc'", marks=pytest.mark.sqlite_only(
        "PostgreSQL enforces column types: an integer column cannot hold 'abc'")),
    ({"max_micro_batch": 47}, "max_micro_batch column (47) disagrees"),
])
def test_a_damaged_entry_is_listed_answers_nothing_and_can_be_removed(store, values, words):
    from autotune.store.schema import DamagedEntry

    store.put(FP, parts={"margin": 0.1}, result=probe_result())
    store.put(OTHER, parts={}, result=probe_result())
    _damage(store, **values)
    entry = store.get(FP)
    assert entry.damage is not None and words in entry.damage
    assert not entry.answers(4096) and entry.to_dict(probe=True)["probe"] is None
    assert entry.to_dict()["damaged"] == entry.damage
    with pytest.raises(DamagedEntry, match=f"entry {FP[:12]} is damaged: .*autotune store rm {FP[:12]}"):
        entry.probe()
    assert {e.fingerprint: e.damage is None for e in store.entries()} == {FP: False, OTHER: True}
    assert store.find(FP[:8]).fingerprint == FP
    assert store.put(FP, parts={}, result=probe_result(max_micro_batch=16, max_batch=16, limited_by="max_batch"))
    assert store.get(FP).damage is None and store.get(FP).max_micro_batch == 16  # replaced
    _damage(store, probe="{}")
    assert store.remove([FP]) == 1 and store.get(FP) is None


def test_damaged_plans_and_measurements_are_skipped(store):
    from sqlalchemy import update

    from autotune.store import schema

    store.put(FP, parts={}, result=probe_result())
    store.put(FP, plan=Plan.from_dict(_plan_dict()))
    store.record(*[Observation(fingerprint=FP, source="run", device="x", device_kind="cuda", batch=b,
                               peak_reserved_bytes=1) for b in (1, 2)])
    with store.engine.begin() as conn:
        conn.execute(update(schema.plans).values(plan="{not json"))
        conn.execute(update(schema.measurements).where(schema.measurements.c.batch == 1).values(batch=0))
    assert store.plans(FP) == []
    assert [o.batch for o in store.observations(FP)] == [2]
    assert store.accuracy(FP)[0]["measurements"] == 1


@pytest.mark.parametrize("value", ["abc", "", "-1", "0", "00", "\u00b2"])
def test_a_damaged_layout_row_is_named_not_an_internal_error(store_url, value):
    from sqlalchemy import update

    from autotune.store import schema

    url = store_url
    store = Store(url)
    with store.engine.begin() as conn:
        conn.execute(update(schema.info).where(schema.info.c.key == "schema").values(value=value))
    store.engine.dispose()
    for mode in ("create", "read"):
        with pytest.raises(BadInput, match=f"^store .* is damaged: its layout row .* holds {value!r}, not a layout "
                                           r"number \(they count from 1\): restore"):
            Store(url, mode=mode)


def test_reading_never_makes_a_store(tmp_path):
    url = f"sqlite:///{tmp_path / 'typo.db'}"
    for mode in ("read", "write"):
        with pytest.raises(BadInput, match="^--store .*typo.db'?: no store there .*typo.db does not exist"):
            Store(url, name="--store", mode=mode)
    assert not (tmp_path / "typo.db").exists()
    with pytest.raises(BadInput, match="in-memory database lives only inside the process"):
        Store("sqlite://", mode="read")
    other = tmp_path / "other.db"
    import sqlite3

    sqlite3.connect(other).execute("create table t (x)").connection.commit()  # a database, not a store
    with pytest.raises(BadInput, match="no store there .*no autotune tables"):
        Store(f"sqlite:///{other}", mode="read")


def test_reading_never_makes_a_store_on_a_server(postgres):
    url = postgres.database()  # a database, not a store
    try:
        for mode in ("read", "write"):
            with pytest.raises(BadInput, match="^--store .*: no store there .*no autotune tables"):
                Store(url, name="--store", mode=mode)
        from sqlalchemy import create_engine, inspect

        from autotune.dburl import store_url

        engine = create_engine(store_url(url))
        assert inspect(engine).get_table_names() == []
        engine.dispose()
    finally:
        postgres.drop(url)


def test_a_store_read_is_opened_read_only(store):
    result = probe_result()
    store.put(FP, parts={}, result=result)
    reader = Store(store.url, mode="read")
    assert [e.fingerprint for e in reader.entries()] == [FP]
    from sqlalchemy.exc import InternalError, OperationalError

    with pytest.raises((OperationalError, InternalError), match="readonly|read-only transaction"):
        reader.put(FP, result=served(result))
    reader.close()
    assert store.get(FP).hits == 0


def test_a_store_whose_server_dropped_its_connections_connects_afresh(postgres):
    url = postgres.database()
    try:
        store = Store(url)
        store.put(FP, parts={}, result=probe_result())
        name = url.rsplit("/", 1)[1]
        postgres.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        assert store.get(FP) is not None  # a read on a connection that went, tried again on a new one
        postgres.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        assert store.put(FP, result=served(probe_result())) and store.get(FP).hits == 1  # and a write
        store.close()
    finally:
        postgres.drop(url)


def test_a_store_file_removed_while_open_is_opened_afresh(sqlite_store):
    store = sqlite_store
    store.put(FP, parts={}, result=probe_result())
    assert store.file is not None
    for path in store.file.parent.glob(store.file.name + "*"):
        path.unlink()
    store.put(OTHER, parts={}, result=probe_result())  # written to the new file, which others see
    again = Store(store.url)
    assert [e.fingerprint for e in again.entries()] == [OTHER]
    assert [e.fingerprint for e in store.entries()] == [OTHER]


def test_a_store_whose_folder_went_is_unhealthy(tmp_path):
    import shutil

    folder = tmp_path / "gone"
    folder.mkdir()
    store = Store(f"sqlite:///{folder / 'plans.db'}")
    assert store.healthy() is None
    shutil.rmtree(folder)
    problem = store.healthy()
    assert problem is not None and "cannot be opened" in problem and "removed or replaced while open" in problem
