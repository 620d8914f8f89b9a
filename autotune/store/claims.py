"""Claims: which process probes a fingerprint now, so that the processes, service replicas and hosts
asking for it at the same time probe it once and the others wait for its answer. No torch here.

A claim is a row of ``autotune_claims``: who holds it (host, process, thread) and until when
(``expires_at``). The holder renews it every third of its lease while it probes (:class:`Heartbeat`),
so a claim outlives its holder by at most one lease (:data:`LEASE_S`), wherever the holder ran: a
process killed on another host, or a host that went away, frees its fingerprints once the lease runs
out, which the row shows everyone. On the holder's own host a claim whose process is gone is taken
over at once. Leases are timed by the database's clock (:func:`database_now`): a PostgreSQL server's,
so that hosts whose clocks differ agree on when a lease runs out; an SQLite file has no clock of its
own, so there each process's host times it (the processes sharing a file share a host, or nearly one
clock). A claim that runs out further ahead than any lease (:data:`MAX_LEASE_S`) was written by a
host whose clock is ahead, or changed by hand: it is taken over, and ``autotune store gc`` removes it.
A claim is taken in one transaction: on PostgreSQL its row is locked (``SELECT ... FOR UPDATE``) and
a new one inserted with ``ON CONFLICT DO NOTHING``, so that of two processes asking at once exactly
one gets it; on SQLite ``BEGIN IMMEDIATE``'s write lock does the same.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..errors import BadInput
from . import schema

#: How long a claim holds unless its holder renews it (a third of this apart, while it probes).
LEASE_S = 30.0
#: No lease is longer: a claim that runs out further ahead than this is broken (its holder's clock is ahead).
MAX_LEASE_S = 2 * LEASE_S
#: How often a process waiting for another's probe looks again.
POLL_S = 0.2

_log = logging.getLogger("autotune.store")


def owner_id() -> str:
    """Who holds a claim: host, process and thread."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def owner_words(owner: str) -> str:
    """A claim's owner as people read it: ``process 4242 on gpu-node-3``."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    return f"process {pid} on {host}" if pid.isdigit() else owner


def alive(owner: str) -> bool:
    """Is the process holding a claim still running? Known on this host only; elsewhere assumed so
    (its claim then ends with its lease)."""
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


def take(conn: Connection, fingerprint: str, owner: str, lease_s: float) -> str | None:
    """Take the claim on ``fingerprint`` for ``owner`` in this transaction: None when it is the
    owner's now, else who holds it."""
    t = schema.claims
    _check_lease(lease_s)
    row = conn.execute(select(t).where(t.c.fingerprint == fingerprint).with_for_update()).first()
    now = database_now(conn)
    if row is not None:
        if row.owner != owner and now < row.expires_at <= now + MAX_LEASE_S and alive(row.owner):
            return str(row.owner)
        if row.owner != owner and row.expires_at > now + MAX_LEASE_S:
            _log.warning("autotune store: the claim on %s by %s runs out %.3g s from now, later than any lease "
                         "allows (%.0f s): its host's clock is ahead, or the row was changed by hand; taken over",
                         fingerprint[:12], owner_words(row.owner), row.expires_at - now, MAX_LEASE_S)
        conn.execute(update(t).where(t.c.fingerprint == fingerprint)
                     .values(owner=owner, claimed_at=now, expires_at=now + lease_s))
        return None
    values = {"fingerprint": fingerprint, "owner": owner, "claimed_at": now, "expires_at": now + lease_s}
    if conn.execute(_insert_new(conn, values)).first() is not None:
        return None
    return holder(conn, fingerprint)


def holder(conn: Connection, fingerprint: str) -> str:
    """Who holds the claim on ``fingerprint`` that another transaction inserted just now (its insert won
    over ours): read back, so that a waiting process names it; "another process" if it let go already."""
    t = schema.claims
    owner = conn.execute(select(t.c.owner).where(t.c.fingerprint == fingerprint)).scalar()
    return "another process" if owner is None else str(owner)


def _insert_new(conn: Connection, values: dict[str, Any]) -> Any:
    """An insert of a claim that returns its row, and nothing when another transaction inserted one first
    (an insert's row count is not known on every driver: psycopg's is -1)."""
    t = schema.claims
    name = conn.dialect.name
    if name == "postgresql":
        from sqlalchemy.dialects import postgresql

        made: Any = postgresql.insert(t).values(**values).on_conflict_do_nothing(index_elements=["fingerprint"])
    elif name == "sqlite":
        from sqlalchemy.dialects import sqlite

        made = sqlite.insert(t).values(**values).on_conflict_do_nothing(index_elements=["fingerprint"])
    else:  # the primary key refuses a second insert (Store.take says "another process")
        made = insert(t).values(**values)
    return made.returning(t.c.fingerprint)


def renew(conn: Connection, fingerprint: str, owner: str, lease_s: float) -> bool:
    """Extend the owner's claim by a lease from now; False when it is not the owner's any more."""
    t = schema.claims
    _check_lease(lease_s)
    done = conn.execute(update(t).where((t.c.fingerprint == fingerprint) & (t.c.owner == owner))
                        .values(expires_at=database_now(conn) + lease_s))
    return bool(done.rowcount)


def stale(now: float) -> Any:
    """Which claims ``autotune store gc`` removes at ``now`` (:func:`database_now`): those whose lease ran out,
    and those that run out further ahead than any lease."""
    t = schema.claims
    return (t.c.expires_at < now) | (t.c.expires_at > now + MAX_LEASE_S)


def database_now(conn: Connection) -> float:
    """The time by the database's clock, in seconds since 1970: a PostgreSQL server's, which every host
    using it shares; for SQLite, which has no clock of its own, this host's."""
    if conn.dialect.name == "postgresql":
        return float(conn.execute(select(func.extract("epoch", func.clock_timestamp()))).scalar_one())
    return time.time()


def _check_lease(lease_s: float) -> None:
    if lease_s > MAX_LEASE_S:
        raise ValueError(f"a claim's lease must be at most {MAX_LEASE_S} s, got {lease_s}")


def release(conn: Connection, fingerprint: str, owner: str) -> None:
    t = schema.claims
    conn.execute(delete(t).where((t.c.fingerprint == fingerprint) & (t.c.owner == owner)))


def release_all(conn: Connection, owner_prefix: str) -> int:
    """Drop every claim of owners starting with ``owner_prefix`` (a process that was stopped)."""
    t = schema.claims
    return int(conn.execute(delete(t).where(t.c.owner.startswith(owner_prefix, autoescape=True))).rowcount)


class Heartbeat:
    """Renews a claim every third of its lease (a daemon thread), until stopped or the claim is lost."""

    def __init__(self, renew: Callable[[], bool], lease_s: float, what: str):
        self._renew = renew
        self._every = lease_s / 3
        self._what = what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="autotune-claim", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._every):
            try:
                if not self._renew():
                    _log.warning("autotune store: the claim on %s was taken over (it was not renewed in time); "
                                 "the probe goes on, and the store keeps the better answer", self._what)
                    return
            except (SQLAlchemyError, BadInput) as exc:  # the store is away for now: the next beat tries again
                _log.warning("autotune store: the claim on %s could not be renewed (%s)", self._what,
                             str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
