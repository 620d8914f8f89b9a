"""How a store's database is reached: which URLs name an SQLite file or an in-memory database,
the engines (read-only or not), and which file an SQLite store is now. No torch here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from sqlalchemy.engine import Connection, Engine

#: How a store is opened: made if new (probing, planning, serving), or only if it exists already,
#: to prune it ("write") or to read it, read-only ("read").
Mode = Literal["create", "write", "read"]
MODES = ("create", "write", "read")
#: How long SQLite waits for another writer's transaction before giving up.
SQLITE_TIMEOUT_S = 60.0


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


def engine(url: str, *, readonly: bool = False, immutable: bool = False) -> Engine:
    """An engine; SQLite waits for other writers, takes its write lock at the start of every
    transaction (no deadlock between two readers that both want to write), and journals in WAL.
    ``readonly``: an SQLite file is opened read-only (``immutable`` too: read without locks, for a
    file in a folder this process cannot write); other databases are only read by the caller."""
    from urllib.parse import quote

    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import StaticPool

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    memory = in_memory(url)
    file = sqlite_file(url)
    if readonly and file is not None:
        query = {"mode": "ro", "uri": "true", **({"immutable": "1"} if immutable else {})}
        parsed = parsed.set(database=f"file:{quote(str(file))}", query=query)
    made = create_engine(parsed, connect_args={"timeout": SQLITE_TIMEOUT_S, "check_same_thread": False},
                         **({"poolclass": StaticPool} if memory else {}))

    @event.listens_for(made, "connect")
    def connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # transactions begin where SQLAlchemy says, as below
        if not memory and not readonly:
            dbapi_connection.execute("PRAGMA journal_mode=WAL")

    @event.listens_for(made, "begin")
    def begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")

    return made
