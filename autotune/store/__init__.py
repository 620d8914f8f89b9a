"""The plan store: probe results kept by fingerprint, shared by every job that can reach the database.

- :mod:`.schema`: the tables and their typed rows (Entry, Observation); no torch.
- :mod:`.store`: :func:`open_store` and :class:`Store` (entries, plans, measurements, claims); no torch.
- :mod:`.database`: URLs, engines (read-only or not) and which file an SQLite store is; no torch.
- :mod:`.fingerprint`: what a probe's answer depends on, traced on shape-only tensors.
- :mod:`.cached`: probing through the store, and recording what real runs measured.

Owns: the store's tables, fingerprints, and probing through it. May import: the stages it keeps
results of (the foundation, results, workload, devices, probing, training), never the API, the
command line or the service above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

if TYPE_CHECKING:
    from .schema import Entry, Observation
    from .store import Store, open_store

__all__ = ["Entry", "Observation", "Store", "open_store"]

_LAZY = {"Entry": "schema", "Observation": "schema", "Store": "store", "open_store": "store"}


__getattr__ = exports(__name__, _LAZY, globals())
