"""Database URLs (optuna's tuning storage, the plan store): checked before any work, shown without passwords.

No torch here: the command line checks a URL before torch loads, and the service reads its store without it.
"""

from __future__ import annotations

from pathlib import Path

from .errors import BadInput


def check_storage(url: str | None, name: str = "storage", *, store: bool = False) -> None:
    """BadInput (one line, naming ``name``) unless ``url`` is a database URL SQLAlchemy can use here:
    a dialect SQLAlchemy knows, its driver installed, an SQLite file's folder present. Connects to nothing.
    ``store``: the URL of a plan store, which connects to PostgreSQL with psycopg (3) (:func:`store_url`)."""
    if url is None:
        return
    if not isinstance(url, str) or not url.strip():
        raise BadInput("must be a database URL such as sqlite:///tune.db", field=name, value=url)
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise BadInput("is not a database URL", field=name, value=url, fix=f"use e.g. sqlite:///{url}") from None
    shown = shown_url(url)
    if store:
        parsed = make_url(store_url(url))
    try:
        create_engine(parsed).dispose()
    except NoSuchModuleError:
        raise BadInput(f"names no database driver SQLAlchemy knows ({parsed.drivername})", field=name, value=shown,
                       fix="use e.g. sqlite:///tune.db, postgresql://HOST/DB or mysql://HOST/DB") from None
    except ImportError as exc:
        fix = "pip install 'autotune[postgres]'" if store and parsed.drivername in (
            "postgresql", "postgres", "postgresql+psycopg") else "install it"
        raise BadInput(f"needs the Python driver {exc.name or exc}, which is not installed", field=name, value=shown,
                       fix=f"{fix}, or use sqlite:///FILE") from None
    except (SQLAlchemyError, ValueError, TypeError) as exc:  # any other refusal of the URL
        raise BadInput(f"cannot be used: {type(exc).__name__}: {exc}".splitlines()[0], field=name,
                       value=shown) from None
    database = parsed.database or ""
    if parsed.get_backend_name() == "sqlite" and database not in ("", ":memory:") and not database.startswith("file:"):
        path = Path(database)
        if not path.parent.is_dir():
            raise BadInput(f": folder {path.parent} does not exist; create it or choose another path", field=name,
                           value=shown)
        if path.is_dir():
            raise BadInput(f": {path} is a folder, not a database file; name a file in it", field=name, value=shown)


def store_url(url: str) -> str:
    """The URL a plan store connects with: ``postgresql://`` without a driver means psycopg (3), the
    ``postgres`` extra's driver, when it is installed (SQLAlchemy 2.0's own default is psycopg2)."""
    from importlib.util import find_spec

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url  # check_storage says why
    if parsed.drivername in ("postgresql", "postgres") and find_spec("psycopg") is not None:
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return url


def shown_url(url: str | None) -> str | None:
    """``url`` as it may be printed and saved: any password replaced by ***."""
    if url is None:
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return url
