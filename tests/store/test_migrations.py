"""A store written by an earlier autotune opens under this one with every entry, plan and measurement:
an SQLite file and a PostgreSQL dump of layout 1 (tests/store/data/README.md says how they were made)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autotune.errors import BadInput
from autotune.store import Observation, schema
from autotune.store.migrations import MIGRATIONS
from autotune.store.store import Store

from ..stores import execute, rows

DATA = Path(__file__).parent / "data"
#: What the layout-1 stores hold: fingerprint -> (workload, max micro-batch, served, hits, plans' targets).
ENTRIES = {
    "b20792745014": ("mlp", 512, True, 1, [512]),
    "b74b3f97479c": ("mlp", 307, True, 0, [1021]),
    "d79703e28a73": ("mlp", 96, False, 0, [96]),
}


@pytest.fixture
def old_store(store_url) -> str:
    """A store of layout 1 at ``store_url``: the SQLite file copied there, or the dump restored into it."""
    if store_url.startswith("sqlite"):
        shutil.copy(DATA / "store_schema1.db", store_url.removeprefix("sqlite:///"))
    else:
        restore(store_url, DATA / "store_schema1.sql")
    return store_url


def restore(url: str, dump: Path) -> None:
    """Run a plain ``pg_dump`` file (its psql meta-commands, ``\\restrict``, left out) against ``url``."""
    import psycopg

    script = "\n".join(line for line in dump.read_text().splitlines() if not line.startswith("\\"))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(script)


def test_the_fixtures_are_of_the_previous_layout(old_store):
    assert rows(old_store, "autotune_store_info", "key", "value") == [("schema", "1")]
    assert "autotune_requests" not in _tables(old_store)


def test_a_store_of_the_previous_layout_opens_with_every_entry(old_store):
    store = Store(old_store)
    try:
        assert rows(old_store, "autotune_store_info", "value") == [(str(schema.STORE_SCHEMA),)]
        entries = {e.short: e for e in store.entries()}
        assert set(entries) == set(ENTRIES)
        for short, (workload, m, valid, hits, targets) in ENTRIES.items():
            entry = entries[short]
            assert (entry.workload, entry.max_micro_batch, entry.valid, entry.hits) == (workload, m, valid, hits)
            assert entry.damage is None and entry.probe().max_micro_batch == m
            assert [p["target_batch"] for p in store.plans(entry.fingerprint)] == targets
        assert store.counts() == {"entries": 3, "plans": 3, "measurements": 3}
        assert {o.source for o in store.observations()} == {"probe", "run", "reported"}
        # what layout 2 added works, and new rows take ids after the old ones
        first = entries["b20792745014"]
        store.put(first.fingerprint, request="f0" * 32, measurements=[Observation(
            fingerprint=first.fingerprint, source="reported", device="NVIDIA A100", device_kind="cuda", batch=8,
            peak_reserved_bytes=1000)])
        assert store.get(request="f0" * 32).fingerprint == first.fingerprint
        assert [o.id for o in store.observations()] == [1, 2, 3, 4]
        assert {"autotune_entries_created_at", "autotune_measurements_recorded_at"} <= _indexes(old_store)
    finally:
        store.close()


def test_answers_stored_under_the_previous_layout_still_serve(old_store):
    from autotune.store.answer import for_estimate

    store = Store(old_store)
    try:
        entry = store.find("b20792745014")
        served = for_estimate(entry, 512)
        assert served.from_store and served.max_micro_batch == 512 and served.notes[0].startswith("from the store")
        store.put(entry.fingerprint, result=served)
        assert store.get(entry.fingerprint).hits == 2
    finally:
        store.close()


def test_a_store_is_read_as_it_is_without_being_changed(old_store):
    reader = Store(old_store, mode="read")
    try:
        assert {e.short for e in reader.entries()} == set(ENTRIES)
    finally:
        reader.close()
    assert rows(old_store, "autotune_store_info", "value") == [("1",)], "a reader migrated the store"


def test_a_layout_this_autotune_cannot_read_as_it_is_is_refused_to_readers(old_store, monkeypatch):
    monkeypatch.setattr(schema, "READS_FROM", 2)
    with pytest.raises(BadInput, match="has layout 1, older than this autotune reads without bringing it up to date: "
                                       "run autotune store migrate --store URL once"):
        Store(old_store, name="--store", mode="read")


def test_a_dry_run_changes_nothing_and_migrate_brings_the_store_up_to_date(old_store, capsys):
    from autotune.cli import main
    from autotune.store import store as module

    before = _file_bytes(old_store)
    assert main(["store", "gc", "--dry-run", "--older-than", "0", "--store", old_store]) == 0
    assert "would remove 3 entries, 3 plans, 3 measurements, 0 claims" in capsys.readouterr().out
    assert rows(old_store, "autotune_store_info", "value") == [("1",)], "a dry run migrated the store"
    assert _file_bytes(old_store) == before
    assert main(["store", "migrate", "--store", old_store]) == 0
    assert capsys.readouterr().out.strip().endswith(": brought from layout 1 to 2, every entry kept")
    assert rows(old_store, "autotune_store_info", "value") == [("2",)] and len(rows(old_store, "autotune_entries")) == 3
    for opened in list(module._OPEN.values()):
        opened.close()
    assert main(["store", "migrate", "--store", old_store]) == 0
    assert capsys.readouterr().out.strip().endswith(" is at layout 2 already: nothing to do")


def _file_bytes(url: str) -> bytes | None:
    """The SQLite file's bytes (None for a server's database)."""
    return Path(url.removeprefix("sqlite:///")).read_bytes() if url.startswith("sqlite") else None


def test_a_failing_step_leaves_the_store_as_it_was(old_store, monkeypatch):
    def broken(conn):
        MIGRATIONS_BEFORE[2](conn)  # the step's own work done, then it fails
        raise RuntimeError("a step that fails half way")

    MIGRATIONS_BEFORE = dict(MIGRATIONS)
    monkeypatch.setitem(MIGRATIONS, 2, broken)
    with pytest.raises(RuntimeError, match="half way"):
        Store(old_store)
    assert rows(old_store, "autotune_store_info", "value") == [("1",)]
    assert "autotune_requests" not in _tables(old_store), "half a migration was kept"
    monkeypatch.setitem(MIGRATIONS, 2, MIGRATIONS_BEFORE[2])
    Store(old_store).close()
    assert rows(old_store, "autotune_store_info", "value") == [("2",)]


def test_every_layout_has_its_step():
    assert sorted(MIGRATIONS) == list(range(2, schema.STORE_SCHEMA + 1))


def test_a_damaged_version_row_is_not_migrated(old_store):
    execute(old_store, "update autotune_store_info set value = 'x' where key = 'schema'")
    with pytest.raises(BadInput, match="is damaged: its layout row"):
        Store(old_store)


def _tables(url: str) -> set[str]:
    from sqlalchemy import create_engine, inspect

    from autotune.dburl import store_url

    engine = create_engine(store_url(url))
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _indexes(url: str) -> set[str]:
    from sqlalchemy import create_engine, inspect

    from autotune.dburl import store_url

    engine = create_engine(store_url(url))
    try:
        found = inspect(engine)
        return {i["name"] for t in found.get_table_names() for i in found.get_indexes(t)}
    finally:
        engine.dispose()
