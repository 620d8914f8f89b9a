"""How a store's database is reached: which URLs name an SQLite file, an in-memory database or a
PostgreSQL server, the engines (read-only or not), the lock that makes a store's layout change one
process at a time, and which file an SQLite store is now. No torch here.

SQLite serialises writers with its file lock: every transaction begins with ``BEGIN IMMEDIATE``, so
writers queue (for :data:`SQLITE_TIMEOUT_S`) instead of failing. PostgreSQL runs transactions side by
side: the store locks the rows it changes (``SELECT ... FOR UPDATE``), inserts with
``ON CONFLICT``, retries a transaction the server chose to abort (a deadlock, a serialisation
failure), and changes its layout under a transaction-scoped advisory lock (:func:`lock_layout`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from sqlalchemy.engine import Connection, Engine

from ..dburl import store_url

#: How a store is opened: made if new (probing, planning, serving), or only if it exists already,
#: to prune it ("write") or to read it, read-only ("read").
Mode = Literal["create", "write", "read"]
MODES = ("create", "write", "read")
#: How long SQLite waits for another writer's transaction before giving up.
SQLITE_TIMEOUT_S = 60.0
#: How long connecting to a database server may take before the store says it cannot be reached.
CONNECT_TIMEOUT_S = 10
#: Connections to a database server a process keeps open (a service's threads each use one while they
#: read): opening one costs a PostgreSQL backend's start, more than most queries.
POOL_SIZE = 16
#: The advisory lock (a PostgreSQL bigint key: "autotune" in ASCII, halved) held while a store's layout is
#: made or brought up to date.
LAYOUT_LOCK = int.from_bytes(b"autotune", "big") >> 1
#: SQLSTATEs of transactions PostgreSQL aborted so that others could go on: tried again.
RETRY_STATES = ("40001", "40P01")  # serialization_failure, deadlock_detected


def backend(url: str) -> str:
    """The database a URL names: ``sqlite``, ``postgresql``, ..."""
    from sqlalchemy.engine import make_url

    return make_url(url).get_backend_name()


def in_memory(url: str) -> bool:
    """Is ``url`` an in-memory SQLite database (private to the connection that opened it)?"""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return False
    database = parsed.database or ""
    return database in ("", ":memory:") or "mode=memory" in database or parsed.query.get("mode") == "memory"


def sqlite_file(url: str) -> Path | None:
    """The file an SQLite URL names (None for another database, or an in-memory one)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or in_memory(url):
        return None
    database = parsed.database or ""
    if database.startswith("file:"):
        database = database.removeprefix("file:").partition("?")[0]
    return Path(database)


def identity(path: Path | None) -> tuple[int, int] | None:
    """Which file ``path`` is now (device and inode), None when there is none."""
    if path is None:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


#: The execution option of a connection that only reads: on SQLite its transactions take no write lock
#: (in WAL, a reader waits for no writer).
READING = "autotune_reading"


def engine(url: str, *, readonly: bool = False, immutable: bool = False) -> Engine:
    """An engine. SQLite waits for other writers, takes its write lock at the start of every
    transaction that may write (no deadlock between two readers that both want to write; a connection
    with the :data:`READING` option only reads, and waits for no one), and journals in WAL.
    ``readonly``: an SQLite file is opened read-only (``immutable`` too: read without locks, for a
    file in a folder this process cannot write); a PostgreSQL store runs read-only transactions."""
    from urllib.parse import quote

    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import StaticPool

    parsed = make_url(store_url(url))
    if parsed.get_backend_name() != "sqlite":
        db_engine = create_engine(parsed, pool_size=POOL_SIZE, max_overflow=POOL_SIZE,
                                  connect_args=_server_connect_args(parsed))
        return db_engine.execution_options(postgresql_readonly=True) if readonly and _postgres(parsed) else db_engine
    memory = in_memory(url)
    file = sqlite_file(url)
    if readonly and file is not None:
        query = {"mode": "ro", "uri": "true", **({"immutable": "1"} if immutable else {})}
        parsed = parsed.set(database=f"file:{quote(str(file))}", query=query)
    db_engine = create_engine(parsed, connect_args={"timeout": SQLITE_TIMEOUT_S, "check_same_thread": False},
                              **({"poolclass": StaticPool} if memory else {}))

    @event.listens_for(db_engine, "connect")
    def connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # transactions begin where SQLAlchemy says, as below
        if not memory and not readonly:
            dbapi_connection.execute("PRAGMA journal_mode=WAL")

    @event.listens_for(db_engine, "begin")
    def begin(conn: Connection) -> None:
        reading = readonly or conn.get_execution_options().get(READING, False)
        conn.exec_driver_sql("BEGIN" if reading else "BEGIN IMMEDIATE")

    return db_engine


def _postgres(parsed: Any) -> bool:
    return bool(parsed.get_backend_name() == "postgresql")


def _server_connect_args(parsed: Any) -> dict[str, Any]:
    """A database server is given up on after :data:`CONNECT_TIMEOUT_S`; on PostgreSQL the connection
    also sends TCP keepalives, so that a server that went away is noticed (what the URL says wins)."""
    if not _postgres(parsed):
        return {}
    given = set(parsed.query)
    wanted = {"connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1, "keepalives_idle": 30,
              "keepalives_interval": 10, "keepalives_count": 3}
    return {k: v for k, v in wanted.items() if k not in given}


def lock_layout(conn: Connection) -> None:
    """Hold the store's layout lock until this transaction ends: one process at a time makes the
    tables or brings them up to date. SQLite's ``BEGIN IMMEDIATE`` holds its write lock already."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({LAYOUT_LOCK})")


def retryable(exc: BaseException) -> bool:
    """Is a transaction that failed so worth trying again: the server aborted it so that another could go
    on, or the connection had gone (the server restarted; the engine connects afresh)? Connections are
    not checked before each use (a round trip per query on a server): a dead one fails once, here."""
    return bool(getattr(exc, "connection_invalidated", False)) or \
        getattr(getattr(exc, "orig", None), "sqlstate", None) in RETRY_STATES
