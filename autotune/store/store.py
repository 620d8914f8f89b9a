"""The plan store: probe results by fingerprint, the plans made from them, and what real runs measured.

    store = open_store("sqlite:///plans.db")          # or postgresql://host/db for a team
    entry = store.get(fingerprint)                    # None, or the stored probe result and its record
    with store.claim(fingerprint):                    # this process probes it; others asking wait
        store.put(fingerprint, result=result, parts=parts, measurements=observed)

A probe goes through the store by those three calls only (:mod:`autotune.store.cached`): ``get`` by
key (a fingerprint, or a request the service answered before), ``claim`` (probe once, wherever the
others asking run), and ``put`` a result with its measurements, in one transaction. The rest is for
looking inside and pruning (``autotune store``, the service's listings). Any SQLAlchemy URL works;
SQLite needs nothing started, PostgreSQL (psycopg 3, the ``postgres`` extra) serves a team. Several
processes may use one store at once: every write is one short transaction, tried again when another
writer got there first (:mod:`autotune.store.database` says how each database does it); claims
(:mod:`autotune.store.claims`) let one process probe a fingerprint while the others wait for its
answer. A store opened to read (``mode="read"``) or to prune (``mode="write"``) must exist already;
one opened to read is opened read-only. A store of an earlier layout is brought up to date when
opened (:mod:`autotune.store.migrations`). An SQLite file that is removed or replaced while a process
holds the store open is noticed at the next transaction and opened afresh. No torch here: the
service and ``autotune store`` read the store without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, SQLAlchemyError

from ..errors import BadInput, first_line
from . import claims, schema
from .claims import LEASE_S, POLL_S, owner_id
from .database import MODES, READING, Mode, engine, identity, in_memory, retryable, sqlite_file
from .migrations import prepare
from .rows import accuracy, entry_row, keeps, plan_row
from .schema import Entry, Observation

if TYPE_CHECKING:
    from ..results.plan import Plan
    from ..results.probe import ProbeResult

R = TypeVar("R")
_log = logging.getLogger("autotune.store")

#: The fingerprint prefix people type must be at least this long.
MIN_PREFIX = 6

_OPEN: dict[tuple[str, str], Store] = {}
_OPEN_LOCK = threading.Lock()


class StoreUnavailable(BadInput):
    """A store that was open and cannot be reached any more (its file removed, and no new one can be made)."""


def open_store(url: str, *, name: str = "store", mode: Mode = "create") -> Store:
    """The store at ``url``, one per URL, mode and process; BadInput naming ``name`` when the URL
    cannot be used, or (``mode`` "read" or "write") when no store is there."""
    from ..dburl import check_storage

    check_storage(url, name, store=True)
    with _OPEN_LOCK:
        if (url, mode) not in _OPEN:
            _OPEN[url, mode] = Store(url, name=name, mode=mode)
        return _OPEN[url, mode]


class Store:
    """One database holding probe results, plans and measurements (see :mod:`autotune.store.schema`)."""

    def __init__(self, url: str, *, name: str = "store", mode: Mode = "create"):
        from ..dburl import shown_url

        if mode not in MODES:
            raise ValueError(f"store mode must be one of {MODES}, got {mode!r}")
        self.url = url
        self.shown = shown_url(url) or url
        self.name = name
        self.mode = mode
        self.file = sqlite_file(url)
        self.reopened = 0
        #: The layout the store was brought from when this process opened it; None when it was not changed.
        self.migrated_from: int | None = None
        self._reopen_lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        """Connect, and make the tables or bring them up to date; remember which file this is."""
        if self.mode != "create" and in_memory(self.url):
            raise BadInput(f"{self.name} {self.shown!r}: no store there: an in-memory database lives only inside "
                           "the process that made it; name the store's file, e.g. sqlite:///plans.db")
        if self.mode != "create" and self.file is not None and not self.file.is_file():
            raise BadInput(f"{self.name} {self.shown!r}: no store there ({self.file} does not exist); autotune "
                           "probe, plan, run or serve with --store make one")
        self.engine = engine(self.url, readonly=self.mode == "read")
        try:
            try:
                self._prepare()
            except OperationalError:
                if self.mode != "read" or self.file is None:
                    raise
                # A read-only file in a folder this process cannot write: SQLite cannot make the files
                # it shares with writers, so the file is read as it is, assumed unchanging.
                self.engine.dispose()
                self.engine = engine(self.url, readonly=True, immutable=True)
                self._prepare()
        except SQLAlchemyError as exc:
            self.engine.dispose()
            if "readonly" in str(exc):
                raise BadInput(f"{self.name} {self.shown!r} is read-only here, and {self._purpose} needs to write it: "
                               "run as a user who may, or give another store") from None
            raise BadInput(f"{self.name} {self.shown!r} cannot be opened: {first_line(exc)}") from None
        self.identity = identity(self.file)

    # -- transactions -------------------------------------------------------------------

    def _prepare(self) -> None:
        self.migrated_from = self._run(lambda conn: prepare(conn, mode=self.mode, name=self.name, shown=self.shown),
                                       retry=(OperationalError, IntegrityError), fresh=False)

    def _run(self, work: Callable[[Connection], R], *, retry: tuple[type[Exception], ...] = (IntegrityError,),
             attempts: int = 4, fresh: bool = True) -> R:
        """``work`` in one transaction, tried again when another writer got there first (or the server
        aborted it so that another could go on)."""
        if fresh:
            self.check()
        for attempt in range(attempts):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except DBAPIError as exc:
                if attempt == attempts - 1 or not (isinstance(exc, retry) or retryable(exc)):
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _read(self, work: Callable[[Connection], R]) -> R:
        """``work`` in a transaction that only reads (on SQLite it waits for no writer), tried once more
        on a fresh connection when the one it had was gone."""
        self.check()
        for attempt in range(2):
            try:
                with self.engine.connect() as conn:
                    return work(conn.execution_options(**{READING: True}))
            except DBAPIError as exc:
                if attempt or not exc.connection_invalidated:
                    raise
        raise AssertionError("unreachable")

    @property
    def _purpose(self) -> str:
        return "pruning it" if self.mode == "write" else "keeping probe results in it"

    def check(self) -> None:
        """Open the store afresh when its SQLite file was removed or replaced since it was opened
        (writes would go to a file no one else sees); BadInput when it cannot be."""
        if self.file is None or identity(self.file) == self.identity:
            return
        with self._reopen_lock:
            if identity(self.file) == self.identity:  # another thread has opened it afresh
                return
            _log.warning("autotune store: %s was removed or replaced while open; opening it afresh", self.file)
            self.engine.dispose()
            self.reopened += 1
            try:
                self._open()
            except BadInput as exc:
                raise StoreUnavailable(f"{exc} (its file was removed or replaced while open)") from None

    def healthy(self) -> str | None:
        """None when the store answers a read now (opened afresh if its file was replaced), else why not."""
        try:
            self._read(lambda c: c.execute(select(schema.info.c.value).limit(1)).scalar())
        except (BadInput, SQLAlchemyError) as exc:
            return str(exc) if isinstance(exc, BadInput) else f"store {self.shown!r}: {first_line(exc)}"
        return None

    def close(self) -> None:
        self.engine.dispose()
        with _OPEN_LOCK:
            if _OPEN.get((self.url, self.mode)) is self:
                del _OPEN[self.url, self.mode]

    # -- the cache's interface: get, claim, put -------------------------------------------

    def get(self, fingerprint: str | None = None, *, request: str | None = None) -> Entry | None:
        """The entry stored under ``fingerprint`` (served or invalidated, readable or damaged), or the one
        that answered the service's ``request`` (a digest of its settings) before; None when there is none."""
        e, r = schema.entries, schema.requests
        query = select(e).where(e.c.fingerprint == fingerprint) if request is None else \
            select(e).join(r, r.c.fingerprint == e.c.fingerprint).where(r.c.key == request)
        row = self._read(lambda c: c.execute(query).first())
        return None if row is None else Entry.from_row(row)

    @contextlib.contextmanager
    def claim(self, fingerprint: str, *, on_wait: Callable[[str], None] | None = None,
              lease_s: float = LEASE_S, poll_s: float = POLL_S) -> Iterator[bool]:
        """Hold the claim on ``fingerprint`` inside the block (renewed while it runs), waiting while
        another process holds it; yields whether it waited. Holding the claim, look in the store again:
        another process may have stored its answer since the last look, whether this one waited or not."""
        owner = owner_id()
        waited = False
        while (holder := self.take(fingerprint, owner, lease_s)) is not None:
            if not waited and on_wait is not None:
                on_wait(holder)
            waited = True
            time.sleep(poll_s)
        beat = claims.Heartbeat(lambda: self.renew(fingerprint, owner, lease_s), lease_s, fingerprint[:12])
        try:
            yield waited
        finally:
            beat.stop()
            self.release(fingerprint, owner)

    def put(self, fingerprint: str, *, result: ProbeResult | None = None, parts: dict[str, Any] | None = None,
            plan: Plan | None = None, measurements: Sequence[Observation] = (), invalid: str | None = None,
            request: str | None = None) -> bool:
        """Keep what a probe of ``fingerprint`` gave, in one transaction:

        - ``result`` served from the entry there (``from_store``): a hit is counted;
        - a new ``result`` (with its fingerprint's ``parts``): stored, unless the served entry there answers
          every limit it answers (memory set its max, and not the new one's; or both stopped at their own
          limit, and its limit is not smaller); False when that entry is kept instead;
        - ``invalid``: the entry is no longer served, and keeps why;
        - ``plan``: kept beside the entry, the latest per target, world size, ``multiple_of`` and uniformity;
        - ``measurements``: added;
        - ``request``: the service's request digest, answered by this fingerprint from now on.
        """
        new = entry_row(result, parts or {}) if result is not None and not result.from_store else None
        planned = plan_row(plan) if plan is not None else None
        now = time.time()
        e = schema.entries

        def write(conn: Connection) -> bool:
            kept = True
            if new is not None:
                assert result is not None
                kept = _keep(conn, fingerprint, new, result)
            elif result is not None:
                conn.execute(update(e).where(e.c.fingerprint == fingerprint).values(hits=e.c.hits + 1,
                                                                                    last_hit_at=now))
            if invalid is not None:
                conn.execute(update(e).where(e.c.fingerprint == fingerprint).values(invalidated_at=now,
                                                                                    invalid_reason=invalid))
            if planned is not None:
                _upsert(conn, schema.plans, {"fingerprint": fingerprint, "key": planned[0]}, planned[1])
            if request is not None:
                _upsert(conn, schema.requests, {"key": request}, {"fingerprint": fingerprint, "created_at": now})
            _insert_measurements(conn, measurements, now)
            return kept

        return self._run(write)

    def served(self, hits: Mapping[str, int], plans: Sequence[tuple[str, Plan]] = ()) -> None:
        """Count the hits a service served from entries (fingerprint -> how many) and keep the plans it made
        from them (fingerprint, plan), in one transaction: what :meth:`put` keeps for an answer, for many."""
        now = time.time()
        rows = sorted(((fingerprint, plan_row(plan)) for fingerprint, plan in plans),
                      key=lambda row: (row[0], row[1][0]))  # rows locked in one order: no deadlock between two
        e = schema.entries

        def write(conn: Connection) -> None:
            for fingerprint, n in sorted(hits.items()):
                conn.execute(update(e).where(e.c.fingerprint == fingerprint).values(hits=e.c.hits + n,
                                                                                    last_hit_at=now))
            for fingerprint, (key, values) in rows:
                _upsert(conn, schema.plans, {"fingerprint": fingerprint, "key": key}, values)

        if hits or rows:
            self._run(write)

    # -- claims, one step at a time (what claim() is made of; the service drops a stopped worker's) ---------

    def take(self, fingerprint: str, owner: str, lease_s: float = LEASE_S) -> str | None:
        """Take the claim on ``fingerprint``: None when it is ``owner``'s now, else who holds it."""
        try:
            return self._run(lambda conn: claims.take(conn, fingerprint, owner, lease_s), attempts=1)
        except IntegrityError:  # another process inserted its claim between our look and our insert
            return self._run(lambda conn: claims.holder(conn, fingerprint))

    def renew(self, fingerprint: str, owner: str, lease_s: float = LEASE_S) -> bool:
        """Extend ``owner``'s claim by ``lease_s`` from now; False when it holds it no more."""
        return self._run(lambda conn: claims.renew(conn, fingerprint, owner, lease_s))

    def release(self, fingerprint: str, owner: str) -> None:
        self._run(lambda conn: claims.release(conn, fingerprint, owner))

    def release_all(self, owner_prefix: str) -> int:
        """Drop every claim of owners starting with ``owner_prefix`` (a process that was stopped)."""
        return self._run(lambda conn: claims.release_all(conn, owner_prefix))

    # -- looking inside -----------------------------------------------------------------------

    def find(self, prefix: str) -> Entry:
        """The one entry whose fingerprint starts with ``prefix``; BadInput when none or several do."""
        prefix = prefix.strip().lower()
        if len(prefix) < MIN_PREFIX or any(ch not in "0123456789abcdef" for ch in prefix):
            raise BadInput(f"fingerprint {prefix!r} must be at least {MIN_PREFIX} hex digits of a fingerprint "
                           "that autotune store ls shows")
        rows = self._read(lambda c: c.execute(select(schema.entries).where(
            schema.entries.c.fingerprint.startswith(prefix, autoescape=True)).limit(2)).all())
        if not rows:
            raise BadInput(f"no entry with fingerprint {prefix} in {self.shown} (autotune store ls and GET /v1/plans "
                           "list the entries)")
        if len(rows) > 1:
            raise BadInput(f"fingerprint {prefix} is the start of several entries' fingerprints: give more digits")
        return Entry.from_row(rows[0])

    def entries(self, *, limit: int | None = None) -> list[Entry]:
        """Every entry, the most recent first."""
        query = select(schema.entries).order_by(schema.entries.c.created_at.desc())
        if limit is not None:
            query = query.limit(limit)
        return [Entry.from_row(r) for r in self._read(lambda c: c.execute(query).all())]

    def plans(self, fingerprint: str) -> list[dict[str, Any]]:
        """The plans made from an entry (Plan JSON), the most recent first."""
        t = schema.plans
        rows = self._read(lambda c: c.execute(select(t.c.plan).where(t.c.fingerprint == fingerprint)
                                              .order_by(t.c.created_at.desc(), t.c.id.desc())).scalars().all())
        out = []
        for text in rows:
            try:
                data = json.loads(text)
            except (TypeError, ValueError):  # a row changed outside autotune: skipped, as a damaged entry is
                data = None
            if isinstance(data, dict):
                out.append(data)
            else:
                _log.warning("autotune store: a damaged plan of entry %s is skipped", fingerprint[:12])
        return out

    def record(self, *observations: Observation) -> list[int]:
        """Add measurements (a job's, reported over HTTP); their ids."""
        return self._run(lambda conn: _insert_measurements(conn, observations, time.time())) if observations else []

    def observations(self, fingerprint: str | None = None, *, limit: int | None = None) -> list[Observation]:
        """Measurements (of one fingerprint, or all), in the order they were recorded."""
        m = schema.measurements
        query = select(m).order_by(m.c.id)
        if fingerprint is not None:
            query = query.where(m.c.fingerprint == fingerprint)
        if limit is not None:
            query = query.order_by(None).order_by(m.c.id.desc()).limit(limit)
        rows = []
        for row in self._read(lambda c: c.execute(query).all()):
            try:
                rows.append(Observation.from_row(row))
            except (TypeError, ValueError):  # a row changed outside autotune: skipped, as a damaged entry is
                _log.warning("autotune store: damaged measurement %s is skipped", row.id)
        return sorted(rows, key=lambda o: o.id or 0)

    def accuracy(self, fingerprint: str | None = None) -> list[dict[str, Any]]:
        """Per device: how far the estimates were from what real runs measured."""
        return accuracy(self.observations(fingerprint))

    def counts(self) -> dict[str, int]:
        def work(conn: Connection) -> dict[str, int]:
            return {"entries": _count(conn, schema.entries, None), "plans": _count(conn, schema.plans, None),
                    "measurements": _count(conn, schema.measurements, None)}

        return self._read(work)

    # -- pruning ------------------------------------------------------------------------------

    def remove(self, fingerprints: Sequence[str]) -> int:
        """Remove entries with their plans, measurements, claims and requests; how many entries went."""
        keys = list(fingerprints)

        def write(conn: Connection) -> int:
            for table in (schema.plans, schema.measurements, schema.claims, schema.requests):
                conn.execute(delete(table).where(table.c.fingerprint.in_(keys)))
            return conn.execute(delete(schema.entries).where(schema.entries.c.fingerprint.in_(keys))).rowcount

        return self._run(write) if keys else 0

    def gc(self, *, older_than_s: float | None = None, dry_run: bool = False) -> dict[str, int]:
        """Remove invalidated entries, claims whose lease ran out (or that run out further ahead than any
        lease: :func:`~autotune.store.claims.stale`), and with ``older_than_s`` entries
        neither made nor served since then and measurements older than that. Counts of what went
        (or would go, with ``dry_run``)."""
        now = time.time()
        e, m = schema.entries, schema.measurements
        stale: Any = e.c.invalidated_at.is_not(None)
        if older_than_s is not None:
            cutoff = now - older_than_s
            stale = stale | ((e.c.created_at < cutoff) & (func.coalesce(e.c.last_hit_at, 0.0) < cutoff))

        def work(conn: Connection) -> dict[str, int]:
            keys = list(conn.execute(select(e.c.fingerprint).where(stale)).scalars())
            old_claims = claims.stale(claims.database_now(conn))
            measured: Any = m.c.fingerprint.in_(keys)
            if older_than_s is not None:
                measured = measured | (m.c.recorded_at < now - older_than_s)
            counts = {
                "entries": len(keys),
                "plans": _count(conn, schema.plans, schema.plans.c.fingerprint.in_(keys)),
                "measurements": _count(conn, m, measured),
                "claims": _count(conn, schema.claims, old_claims),
            }
            if not dry_run:
                for table in (schema.plans, schema.requests):
                    conn.execute(delete(table).where(table.c.fingerprint.in_(keys)))
                conn.execute(delete(m).where(measured))
                conn.execute(delete(schema.claims).where(old_claims))
                conn.execute(delete(e).where(e.c.fingerprint.in_(keys)))
            return counts

        return self._run(work)


def _keep(conn: Connection, fingerprint: str, row: dict[str, Any], result: ProbeResult) -> bool:
    """Store a new probe result under ``fingerprint`` (its row locked while it is decided), unless the
    entry there is kept instead (:func:`~autotune.store.rows.keeps`)."""
    e = schema.entries
    old = conn.execute(select(e).where(e.c.fingerprint == fingerprint).with_for_update()).first()
    if old is None:
        conn.execute(insert(e).values(fingerprint=fingerprint, **row))  # a race is an IntegrityError: tried again
        return True
    if keeps(Entry.from_row(old), result):
        return False
    conn.execute(update(e).where(e.c.fingerprint == fingerprint).values(**row))
    return True


def _upsert(conn: Connection, table: Any, key: dict[str, Any], values: dict[str, Any]) -> None:
    """Update the row of ``table`` with ``key``, or insert it (a race is an IntegrityError: tried again)."""
    where = [table.c[k] == v for k, v in key.items()]
    if not conn.execute(update(table).where(*where).values(**values)).rowcount:
        conn.execute(insert(table).values(**key, **values))


def _insert_measurements(conn: Connection, observations: Sequence[Observation], now: float) -> list[int]:
    ids = []
    for o in observations:
        row = o.row()
        row["recorded_at"] = row["recorded_at"] or now
        key = conn.execute(insert(schema.measurements).values(**row)).inserted_primary_key
        ids.append(int(key[0]) if key is not None else 0)
    return ids


def _count(conn: Connection, table: Any, where: Any) -> int:
    query = select(func.count()).select_from(table)
    if where is not None:
        query = query.where(where)
    return int(conn.execute(query).scalar() or 0)
