"""Looking into a plan store behind its back, on either database: its rows, read with SQL; and a probe that holds
its store claim until the test lets it go."""

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


#: A probe whose estimate, past the fingerprint's micro-batches, waits until the file $AUTOTUNE_TEST_GATE exists:
#: the process probing it holds its claim until the test lets it go (or 300 s pass: longer than any test waits
#: for the others to queue behind it, so that on a loaded machine a late process still finds the claim held).
GATED = (
    "import os, time\nimport torch\nfrom torch import nn\nfrom autotune import Workload\n\n"
    "def loss(model, batch):\n    if batch.shape[0] > 3:\n        deadline = time.time() + 300\n"
    "        while not os.path.exists(os.environ['AUTOTUNE_TEST_GATE']) and time.time() < deadline:\n"
    "            time.sleep(0.05)\n    return model(batch).pow(2).mean()\n\n"
    "def build():\n    return Workload(name='gated', model=lambda: nn.Linear(4, 1),\n"
    "                    batch=lambda n, g: torch.randn(n, 4, generator=g), loss=loss)\n")
