"""The plan store: probe results kept by fingerprint, shared by every job that can reach the database.

- :mod:`.schema`: the tables and their typed rows (Entry, Observation); no torch.
- :mod:`.store`: :func:`open_store` and :class:`Store` (entries, plans, measurements, claims); no torch.
- :mod:`.fingerprint`: what a probe's answer depends on, traced on shape-only tensors.
- :mod:`.cached`: probing through the store, and recording what real runs measured.

Layer: above the stages it keeps results of (results, workload, devices, probing,
training), below the API, the command line and the service.
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
