"""The plan store's layout, versioned: a store is made at this autotune's layout, and one written by an
earlier autotune is brought up to date when it is opened, with every entry kept. No torch here.

The version is the ``schema`` row of ``autotune_store_info`` (the store's version table). A store of
an earlier layout is brought up to date through :data:`MIGRATIONS`, in order, inside the transaction
that opens it and under the layout lock (:func:`~autotune.store.database.lock_layout` on PostgreSQL,
the write lock that ``BEGIN IMMEDIATE`` takes on SQLite; both databases change tables
transactionally), the version row moved in the same transaction: a store is at one layout or the
next, never between, and of several processes that open it at once one migrates and the others find
it done. A store opened read-only is never changed: it is read as it is when its layout is at least
:data:`~autotune.store.schema.READS_FROM`. A store written by a newer autotune is refused.

Migrations are a short list of SQLAlchemy steps, not alembic. The store already had its version row;
alembic would add its own version table, a script folder and ``env.py`` shipped inside the package
and its configuration, to run steps that SQLAlchemy's DDL runs as well (create a table, an index,
add a column), and the steps must run under the store's own lock in the transaction that opens it,
which alembic's command runner does not do. Importing ``alembic.migration`` and
``alembic.operations`` after SQLAlchemy costs 0.14 s on a 2-core machine (the best of 3), on every
open of a store, up to date or not, in every job and service worker. Should a later layout need a
table rebuilt on SQLite (which cannot drop or retype a column in place), alembic's
``Operations.batch_alter_table`` does that inside a step here: alembic is installed with optuna.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import insert, inspect, select, update
from sqlalchemy.engine import Connection

from ..errors import BadInput
from . import schema
from .database import Mode, lock_layout

_log = logging.getLogger("autotune.store")


def _layout_2(conn: Connection) -> None:
    """The service's request keys (``autotune_requests``); indexes for listing entries by when they were
    made and for pruning measurements by age."""
    schema.requests.create(conn, checkfirst=True)
    for table, name in ((schema.entries, "autotune_entries_created_at"),
                        (schema.measurements, "autotune_measurements_recorded_at")):
        next(i for i in table.indexes if i.name == name).create(conn, checkfirst=True)


#: layout -> the step that brings a store of the layout before it there. Steps only add (tables, indexes,
#: nullable columns), so that an autotune of the previous layout still reads a store they changed.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {2: _layout_2}


def prepare(conn: Connection, *, mode: Mode, name: str, shown: str) -> int | None:
    """Make the store's tables (``mode`` "create", when there are none), or check its layout and bring
    it up to date (not when ``mode`` is "read"): the layout it was brought from, None when it was not
    changed. BadInput naming ``name`` when it is no store, is damaged or is newer than this autotune."""
    if mode != "read":
        lock_layout(conn)
    exists = inspect(conn).has_table(schema.info.name)
    if not exists and mode != "create":
        raise BadInput(f"{name} {shown!r}: no store there (the database has no autotune tables); "
                       "autotune probe, plan, run or serve with --store make one")
    found = conn.execute(select(schema.info.c.value).where(schema.info.c.key == "schema")).scalar() \
        if exists else None
    if found is None and mode == "create":
        schema.metadata.create_all(conn, checkfirst=True)
        conn.execute(insert(schema.info).values(key="schema", value=str(schema.STORE_SCHEMA)))
        return None
    layout = int(found) if isinstance(found, str) and found.isascii() and found.isdigit() else 0
    if layout < 1:
        raise BadInput(f"{name} {shown!r} is damaged: its layout row ({schema.info.name} 'schema') holds {found!r}, "
                       "not a layout number (they count from 1): restore the store from a backup, or start a new one")
    if layout > schema.STORE_SCHEMA:
        raise BadInput(f"{name} {shown!r} has layout {found}, newer than the {schema.STORE_SCHEMA} this autotune "
                       "reads: upgrade autotune (pip install -U autotune)")
    if layout == schema.STORE_SCHEMA or (mode == "read" and layout >= schema.READS_FROM):
        return None
    if mode == "read":
        raise BadInput(f"{name} {shown!r} has layout {found}, older than this autotune reads without bringing it up "
                       "to date: run autotune store migrate --store URL once (it brings the store up to date, every "
                       "entry kept)")
    migrate(conn, layout)
    _log.info("autotune store: %s brought from layout %d to %d", shown, layout, schema.STORE_SCHEMA)
    return layout


def migrate(conn: Connection, layout: int) -> None:
    """Bring a store of ``layout`` up to :data:`~autotune.store.schema.STORE_SCHEMA`, step by step."""
    for version in range(layout + 1, schema.STORE_SCHEMA + 1):
        MIGRATIONS[version](conn)
    conn.execute(update(schema.info).where(schema.info.c.key == "schema").values(value=str(schema.STORE_SCHEMA)))
