"""The plan store: probe results kept by fingerprint, shared by every job that can reach the database.

A cache around the probe: :func:`.cached.probe_through_store` is the probe, answered from the store when it holds the
answer, and the store is used there by three calls only (get by key, claim, put a result with its
measurements), so that ``plan = planner(probe(request))`` reads the same with or without a store.

- :mod:`.cached`: the cache around the probe (confirm runs on a real device), and recording what runs measured.
- :mod:`.fingerprint`: what a probe's answer depends on, traced on shape-only tensors.
- :mod:`.answer`: what a stored entry answers, with nothing run; no torch.
- :mod:`.store`: :func:`open_store` and :class:`Store` (get, claim, put; listing and pruning); no torch.
- :mod:`.claims`: who probes a fingerprint now, leases and their renewal; no torch.
- :mod:`.rows`: the rows written for results and plans, which answer is kept, accuracy; no torch.
- :mod:`.schema`: the tables and their typed rows (Entry, Observation); no torch.
- :mod:`.migrations`: the layout's version, and bringing an older store up to date; no torch.
- :mod:`.database`: URLs, engines (SQLite, PostgreSQL; read-only or not), locks; no torch.

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
