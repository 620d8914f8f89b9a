"""Looking into a plan store behind its back, on either database: its rows, read with SQL."""

from __future__ import annotations

from typing import Any


def rows(url: str, table: str, *columns: str) -> list[tuple[Any, ...]]:
    """Every row of ``table`` (its ``columns``, or all) in the store at ``url``."""
    from sqlalchemy import create_engine, text

    from autotune.dburl import store_url

    engine = create_engine(store_url(url))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(f"SELECT {', '.join(columns) or '*'} FROM {table}"))]
    finally:
        engine.dispose()


def execute(url: str, statement: str, **values: Any) -> None:
    """Change the store at ``url`` with one SQL statement (planting a fault)."""
    from sqlalchemy import create_engine, text

    from autotune.dburl import store_url

    engine = create_engine(store_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text(statement), values)
    finally:
        engine.dispose()
