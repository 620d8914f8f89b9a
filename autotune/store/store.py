"""The plan store: probe results by fingerprint, the plans made from them, and what real runs measured.

    store = open_store("sqlite:///plans.db")          # or postgresql://host/db for a team
    entry = store.entry(fingerprint)                  # None, or the stored probe result and its record

Any SQLAlchemy URL works; SQLite needs nothing started. Several processes may
use one store at once: every write is one short transaction (on SQLite taken
with ``BEGIN IMMEDIATE``, so that writers queue instead of failing), and
claims (:meth:`Store.single_flight`) let one process probe a fingerprint while
the others wait for its answer. A store opened to read (``mode="read"``) or to
prune (``mode="write"``) must exist already; one opened to read is opened
read-only. An SQLite file that is removed or replaced while a process holds the
store open is noticed at the next transaction and opened afresh. No torch here:
the service and ``autotune store`` read the store without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import delete, func, insert, inspect, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from ..errors import BadInput
from . import schema
from .database import MODES, Mode, engine, identity, in_memory, sqlite_file
from .schema import Entry, Observation

if TYPE_CHECKING:
    from ..results.device import DeviceInfo
    from ..results.plan import Plan
    from ..results.probe import ProbeResult

R = TypeVar("R")
_log = logging.getLogger("autotune.store")

#: A claim older than this is taken over (its owner crashed on another host); on this host a claim
#: whose process is gone is taken over at once.
LEASE_S = 3600.0
#: How often a process waiting for another's probe looks again.
POLL_S = 0.2
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

    check_storage(url, name)
    with _OPEN_LOCK:
        if (url, mode) not in _OPEN:
            _OPEN[url, mode] = Store(url, name=name, mode=mode)
        return _OPEN[url, mode]


def device_label(info: DeviceInfo) -> str:
    """A device as the store groups measurements: the GPU model, the CPU, or what the estimate stands for."""
    if info.kind == "cuda":
        return info.model or info.name
    if info.kind == "cpu":
        return f"cpu ({info.model})" if info.model else "cpu"
    return info.summary.split("; ")[0]


def owner_id() -> str:
    """Who holds a claim: host, process and thread."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def owner_words(owner: str) -> str:
    """A claim's owner as people read it: ``process 4242 on gpu-node-3``."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    return f"process {pid} on {host}" if pid.isdigit() else owner


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
        self._reopen_lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        """Connect and check (or make) the tables; remember which file this is."""
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
            raise BadInput(f"{self.name} {self.shown!r} cannot be opened: {_first_line(exc)}") from None
        self.identity = identity(self.file)

    # -- transactions -------------------------------------------------------------------

    def _prepare(self) -> None:
        def make(conn: Connection) -> None:
            if self.mode == "create":
                schema.metadata.create_all(conn, checkfirst=True)
            elif not inspect(conn).has_table(schema.info.name):
                raise BadInput(f"{self.name} {self.shown!r}: no store there (the database has no autotune tables); "
                               "autotune probe, plan, run or serve with --store make one")
            found = conn.execute(select(schema.info.c.value).where(schema.info.c.key == "schema")).scalar()
            if found is None and self.mode == "create":
                conn.execute(insert(schema.info).values(key="schema", value=str(schema.STORE_SCHEMA)))
            elif not isinstance(found, str) or not found.isdigit():
                raise BadInput(f"{self.name} {self.shown!r} is damaged: its layout row ({schema.info.name} 'schema') "
                               f"holds {found!r}, not a layout number: restore the store from a backup, or start "
                               "a new one")
            elif int(found) > schema.STORE_SCHEMA:
                raise BadInput(f"{self.name} {self.shown!r} has layout {found}, newer than the {schema.STORE_SCHEMA} "
                               "this autotune reads: upgrade autotune (pip install -U autotune)")

        self._run(make, retry=(OperationalError, IntegrityError), fresh=False)

    def _run(self, work: Callable[[Connection], R], *, retry: tuple[type[Exception], ...] = (IntegrityError,),
             attempts: int = 4, fresh: bool = True) -> R:
        """``work`` in one transaction, tried again when another writer got there first."""
        if fresh:
            self.check()
        for attempt in range(attempts):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except retry:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _read(self, work: Callable[[Connection], R]) -> R:
        self.check()
        with self.engine.connect() as conn:
            return work(conn)

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
            return str(exc) if isinstance(exc, BadInput) else f"store {self.shown!r}: {_first_line(exc)}"
        return None

    def close(self) -> None:
        self.engine.dispose()
        with _OPEN_LOCK:
            if _OPEN.get((self.url, self.mode)) is self:
                del _OPEN[self.url, self.mode]

    # -- entries --------------------------------------------------------------------------

    def entry(self, fingerprint: str) -> Entry | None:
        """The entry stored under ``fingerprint`` (served or invalidated), or None."""
        row = self._read(lambda c: c.execute(
            select(schema.entries).where(schema.entries.c.fingerprint == fingerprint)).first())
        return None if row is None else Entry.from_row(row)

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

    def put(self, fingerprint: str, components: dict[str, Any], result: ProbeResult) -> bool:
        """Store ``result`` under ``fingerprint``; False when the served entry there answers every
        limit ``result`` answers (memory set its max, and not ``result``'s; or both stopped at their
        own limit, and its limit is not smaller), and is kept instead."""
        import autotune

        row = {
            "workload": result.workload, "device": device_label(result.device), "device_kind": result.device.kind,
            "estimated": result.estimated, "max_micro_batch": result.max_micro_batch, "max_batch": result.max_batch,
            "limited_by": result.limited_by, "created_at": time.time(), "hits": 0, "last_hit_at": None,
            "invalidated_at": None, "invalid_reason": None, "components": json.dumps(components, sort_keys=True),
            "probe": json.dumps(result.to_dict(), sort_keys=True), "autotune_version": autotune.__version__,
        }
        table = schema.entries

        def write(conn: Connection) -> bool:
            old = conn.execute(select(table).where(table.c.fingerprint == fingerprint)).first()
            if old is None:
                conn.execute(insert(table).values(fingerprint=fingerprint, **row))
                return True
            if _keeps(Entry.from_row(old), result):
                return False
            conn.execute(update(table).where(table.c.fingerprint == fingerprint).values(**row))
            return True

        return self._run(write)

    def served(self, fingerprint: str) -> None:
        """Count a hit."""
        table = schema.entries
        self._run(lambda c: c.execute(update(table).where(table.c.fingerprint == fingerprint)
                                      .values(hits=table.c.hits + 1, last_hit_at=time.time())))

    def invalidate(self, fingerprint: str, reason: str) -> None:
        """Stop serving an entry, and keep why."""
        table = schema.entries
        self._run(lambda c: c.execute(update(table).where(table.c.fingerprint == fingerprint)
                                      .values(invalidated_at=time.time(), invalid_reason=reason)))

    def remove(self, fingerprints: Sequence[str]) -> int:
        """Remove entries with their plans and measurements; how many entries went."""
        keys = list(fingerprints)

        def write(conn: Connection) -> int:
            for table in (schema.plans, schema.measurements, schema.claims):
                conn.execute(delete(table).where(table.c.fingerprint.in_(keys)))
            return conn.execute(delete(schema.entries).where(schema.entries.c.fingerprint.in_(keys))).rowcount

        return self._run(write) if keys else 0

    def gc(self, *, older_than_s: float | None = None, dry_run: bool = False) -> dict[str, int]:
        """Remove invalidated entries, claims whose lease ran out, and with ``older_than_s`` entries
        neither made nor served since then and measurements older than that. Counts of what went
        (or would go, with ``dry_run``)."""
        now = time.time()
        e = schema.entries
        stale: Any = e.c.invalidated_at.is_not(None)
        if older_than_s is not None:
            cutoff = now - older_than_s
            stale = stale | ((e.c.created_at < cutoff) & (func.coalesce(e.c.last_hit_at, 0.0) < cutoff))

        def work(conn: Connection) -> dict[str, int]:
            keys = list(conn.execute(select(e.c.fingerprint).where(stale)).scalars())
            old = schema.measurements.c.recorded_at < now - older_than_s if older_than_s is not None else None
            counts = {
                "entries": len(keys),
                "plans": _count(conn, schema.plans, schema.plans.c.fingerprint.in_(keys)),
                "measurements": _count(conn, schema.measurements, schema.measurements.c.fingerprint.in_(keys)
                                       if old is None else schema.measurements.c.fingerprint.in_(keys) | old),
                "claims": _count(conn, schema.claims, schema.claims.c.expires_at < now),
            }
            if not dry_run:
                conn.execute(delete(schema.plans).where(schema.plans.c.fingerprint.in_(keys)))
                m = schema.measurements
                conn.execute(delete(m).where(m.c.fingerprint.in_(keys) if old is None else
                                             m.c.fingerprint.in_(keys) | old))
                conn.execute(delete(schema.claims).where(schema.claims.c.expires_at < now))
                conn.execute(delete(e).where(e.c.fingerprint.in_(keys)))
            return counts

        return self._run(work)

    # -- plans ------------------------------------------------------------------------------

    def put_plan(self, fingerprint: str, plan: Plan) -> None:
        """Keep the plan made from an entry (the latest per target, world size, multiple and uniformity)."""
        key = f"{plan.target_batch}/{plan.world_size}/{plan.multiple_of}/{plan.uniform}"
        table = schema.plans
        values = {"target_batch": plan.target_batch, "world_size": plan.world_size, "created_at": time.time(),
                  "plan": json.dumps(plan.to_dict(), sort_keys=True)}

        def write(conn: Connection) -> None:
            done = conn.execute(update(table).where((table.c.fingerprint == fingerprint) & (table.c.key == key))
                                .values(**values)).rowcount
            if not done:
                conn.execute(insert(table).values(fingerprint=fingerprint, key=key, **values))

        self._run(write)

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

    # -- measurements -----------------------------------------------------------------------

    def record(self, *observations: Observation) -> list[int]:
        """Add measurements; their ids."""
        now = time.time()

        def write(conn: Connection) -> list[int]:
            ids = []
            for o in observations:
                row = o.row()
                row["recorded_at"] = row["recorded_at"] or now
                key = conn.execute(insert(schema.measurements).values(**row)).inserted_primary_key
                ids.append(int(key[0]) if key is not None else 0)
            return ids

        return self._run(write) if observations else []

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

    # -- claims -----------------------------------------------------------------------------

    def claim(self, fingerprint: str, owner: str, lease_s: float = LEASE_S) -> str | None:
        """Take the claim on ``fingerprint``: None when it is ours now, else who holds it."""
        t = schema.claims

        def write(conn: Connection) -> str | None:
            now = time.time()
            row = conn.execute(select(t).where(t.c.fingerprint == fingerprint)).first()
            if row is not None and row.owner != owner and row.expires_at > now and _alive(row.owner):
                return str(row.owner)
            conn.execute(delete(t).where(t.c.fingerprint == fingerprint))
            conn.execute(insert(t).values(fingerprint=fingerprint, owner=owner, claimed_at=now,
                                          expires_at=now + lease_s))
            return None

        try:
            return self._run(write, attempts=1)
        except IntegrityError:  # another process inserted its claim between our look and our insert
            return "another process"

    def release(self, fingerprint: str, owner: str) -> None:
        t = schema.claims
        self._run(lambda c: c.execute(delete(t).where((t.c.fingerprint == fingerprint) & (t.c.owner == owner))))

    def release_all(self, owner_prefix: str) -> int:
        """Drop every claim of owners starting with ``owner_prefix`` (a process that was stopped)."""
        t = schema.claims
        return self._run(lambda c: c.execute(delete(t).where(t.c.owner.startswith(owner_prefix,
                                                                                    autoescape=True))).rowcount)

    @contextlib.contextmanager
    def single_flight(self, fingerprint: str, *, on_wait: Callable[[str], None] | None = None,
                      lease_s: float = LEASE_S, poll_s: float = POLL_S) -> Iterator[bool]:
        """Hold the claim on ``fingerprint`` inside the block, waiting while another process holds it.
        Yields whether it waited. Holding the claim, look in the store again: another process may have
        stored its answer since the last look, whether this one waited for it or not."""
        owner = owner_id()
        waited = False
        while (holder := self.claim(fingerprint, owner, lease_s)) is not None:
            if not waited and on_wait is not None:
                on_wait(holder)
            waited = True
            time.sleep(poll_s)
        try:
            yield waited
        finally:
            self.release(fingerprint, owner)


def accuracy(observations: Sequence[Observation]) -> list[dict[str, Any]]:
    """Per device label: measurements, OOMs, and the estimate's error over those with an estimate
    (signed mean, mean of the absolute, the worst, and the same for the allocated peak)."""
    groups: dict[str, list[Observation]] = {}
    for o in observations:
        groups.setdefault(o.device, []).append(o)
    out = []
    for device, rows in sorted(groups.items()):
        errors = [e for o in rows if (e := o.error) is not None]
        alloc = [(o.peak_allocated_bytes - o.estimated_peak_bytes) / o.estimated_peak_bytes for o in rows
                 if o.peak_allocated_bytes is not None and o.estimated_peak_bytes and not o.oom]
        out.append({
            "device": device, "kind": rows[0].device_kind, "measurements": len(rows),
            "ooms": sum(o.oom for o in rows), "compared": len(errors),
            "mean_error": statistics.fmean(errors) if errors else None,
            "mean_abs_error": statistics.fmean(abs(e) for e in errors) if errors else None,
            "worst_error": max(errors, key=abs) if errors else None,
            "allocated_mean_error": statistics.fmean(alloc) if alloc else None,
            "ooms_estimated_to_fit": sum(o.oom and o.estimated_peak_bytes is not None for o in rows),
        })
    return out


def _keeps(old: Entry, new: ProbeResult) -> bool:
    """Is the stored ``old`` kept instead of ``new``: served, readable, and answering every limit ``new`` answers?"""
    if not old.valid or old.damage is not None:
        return False
    if old.limited_by == "memory":
        return new.limited_by != "memory"
    return new.limited_by == "max_batch" and new.max_batch <= old.max_batch


def _count(conn: Connection, table: Any, where: Any) -> int:
    query = select(func.count()).select_from(table)
    if where is not None:
        query = query.where(where)
    return int(conn.execute(query).scalar() or 0)


def _alive(owner: str) -> bool:
    """Is the process holding a claim still running? Known on this host only; elsewhere assumed so."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


