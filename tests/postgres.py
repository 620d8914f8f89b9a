"""A real PostgreSQL server for the store and service tests, and a fresh database per test.

The server is the one ``$AUTOTUNE_TEST_POSTGRES`` names (a URL of a role that may create databases, as
.ci/run gives), or one started here: ``initdb`` and ``pg_ctl`` (PostgreSQL's own tools, found on the
PATH or under /usr/lib/postgresql) into a temporary folder, on a free port of 127.0.0.1, as a user who
is not root (the server refuses root: the ``postgres`` user when there is one), without durability
(fsync off: a test database is thrown away), stopped when the tests end. Every database is made empty
(from ``template0``) and dropped after its test, so that tests (and pytest-xdist workers) never share
one. When no server can be had, :class:`Unavailable` says why, and the tests that need one are skipped
with that reason.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

VARIABLE = "AUTOTUNE_TEST_POSTGRES"
_SETTINGS = ("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "max_connections=300", "-c", "listen_addresses=127.0.0.1")  # the last two always


class Unavailable(Exception):
    """No PostgreSQL server for the tests, and why."""


def tool(name: str) -> str:
    """A PostgreSQL program: on the PATH, else the newest under /usr/lib/postgresql."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        raise Unavailable(f"PostgreSQL's {name} is not installed (apt-get install postgresql), and "
                          f"${VARIABLE} names no server")
    return found


class Server:
    """A PostgreSQL server reached at ``admin`` (a URL of its ``postgres`` database); ``folder`` when
    started here."""

    def __init__(self, admin: str, folder: Path | None = None, user: str | None = None):
        self.admin = admin
        self.folder = folder
        self.user = user
        self._names = itertools.count()
        self._conn: Any = None

    @classmethod
    def start(cls, *, durable: bool = False) -> Server:
        """The server ``$AUTOTUNE_TEST_POSTGRES`` names, else one started here (``durable``: with
        PostgreSQL's own fsync and commit settings, as a benchmark wants, instead of none)."""
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise Unavailable("psycopg (3) is not installed: pip install -e '.[test]' (its postgres extra)") from None
        given = os.environ.get(VARIABLE, "").strip()
        if given:
            server = cls(given)
            server.execute("SELECT 1")
            return server
        initdb, pg_ctl = tool("initdb"), tool("pg_ctl")
        user = "postgres" if os.geteuid() == 0 else None
        if user is not None:
            try:
                owner = pwd.getpwnam(user)
            except KeyError:
                raise Unavailable("running as root, and there is no postgres user to run the server as "
                                  "(PostgreSQL refuses root)") from None
        folder = Path(tempfile.mkdtemp(prefix="autotune-postgres-"))
        if user is not None:
            os.chown(folder, owner.pw_uid, owner.pw_gid)
        port = _free_port()
        run = {"user": user, "capture_output": True, "text": True, "timeout": 120, "cwd": folder}
        made = subprocess.run([initdb, "-D", str(folder / "data"), "-A", "trust", "-U", "postgres", "--no-sync",
                               "-E", "UTF8"], **run)
        if made.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise Unavailable(f"initdb failed: {made.stderr.strip().splitlines()[-1:]}")
        settings = _SETTINGS[-4:] if durable else _SETTINGS
        options = " ".join((*settings, "-p", str(port), "-k", str(folder)))
        started = subprocess.run([pg_ctl, "-D", str(folder / "data"), "-o", options, "-l", str(folder / "log"),
                                  "-w", "-t", "60", "start"], **run)
        if started.returncode != 0:
            log = (folder / "log").read_text() if (folder / "log").exists() else started.stderr
            shutil.rmtree(folder, ignore_errors=True)
            raise Unavailable(f"the PostgreSQL server did not start: {log.strip().splitlines()[-1:]}")
        return cls(f"postgresql://postgres@127.0.0.1:{port}/postgres", folder, user)

    def stop(self) -> None:
        """Stop the server started here (and remove its folder); one given is left as it is."""
        if self._conn is not None:
            self._conn.close()
        if self.folder is None:
            return
        subprocess.run([tool("pg_ctl"), "-D", str(self.folder / "data"), "-m", "immediate", "-w", "stop"],
                       user=self.user, capture_output=True, timeout=60, cwd=self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)

    def execute(self, *statements: str) -> None:
        """Run statements in the server's ``postgres`` database, each in its own transaction (on one
        connection, kept: connecting costs more than making a database)."""
        import psycopg

        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(_libpq(self.admin), autocommit=True, connect_timeout=10)
            for statement in statements:
                self._conn.execute(statement)
        except psycopg.OperationalError as exc:
            raise Unavailable(f"the PostgreSQL server at {self.admin} cannot be reached: "
                              f"{str(exc).strip().splitlines()[0]}") from None

    def database(self) -> str:
        """A new, empty database's URL (``postgresql://``, as a user writes it)."""
        name = f"autotune_{os.getpid()}_{next(self._names)}"
        self.execute(f'CREATE DATABASE "{name}" TEMPLATE template0 STRATEGY FILE_COPY')
        return self.url(name)

    def url(self, name: str) -> str:
        return self.admin.rsplit("/", 1)[0] + f"/{name}"

    def drop(self, url: str) -> None:
        """Drop a database :meth:`database` made, whoever is still connected to it."""
        from autotune.store import store as module

        for opened in [s for (u, _), s in list(module._OPEN.items()) if u == url]:
            opened.close()
        self.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def _libpq(url: str) -> str:
    """A SQLAlchemy-style URL as libpq takes it."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
