"""Plan requests answered from the store in the server's own process, with no worker and no torch.

A worker that answers a plan request takes the probe's fingerprint (tracing the workload on shape-only
tensors, torch's work), and the service keeps which fingerprint answered the request's settings
(:func:`request_key`) in the store, for every replica to see. The next request with those settings is
answered here: the stored entry, as a probe limited to the request's per-rank target gives it
(:func:`autotune.store.answer.for_estimate`), planned (:func:`autotune.planning.probed.plan_probed`), the
hit and the plan kept, as a worker would have. The key covers what the fingerprint depends on and the
server can see without torch: the probe's name, function and code (the ``*.py`` files of its folder),
the request's device, budget, world size, parallel strategy, margin and precision, autotune's and
every installed package's version, and the environment variables torch and autotune read
(``PYTORCH_*``, ``TORCH_*``, ``CUDA_*``, ``CUBLAS_*``, ``AUTOTUNE_*``). A request whose entry cannot
answer it (none yet, damaged, invalidated, limited below its target) goes to a worker, which probes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from dataclasses import replace
from typing import Any

from ..store.store import Store
from .bodies import PlanRequest
from .probes import Probe

#: The environment variables a worker's fingerprint may depend on, by prefix.
ENVIRONMENT = ("PYTORCH_", "TORCH_", "CUDA_", "CUBLAS_", "AUTOTUNE_")
#: The request's fields that its probe depends on (the rest are the planner's).
PROBED = ("device", "memory_budget", "world_size", "parallel", "margin", "precision")


@functools.cache
def environment() -> str:
    """A digest of what this process's workers take a fingerprint under, beyond the request: autotune's
    and every installed package's version, and the variables in :data:`ENVIRONMENT`."""
    from importlib.metadata import distributions

    from .. import __version__

    packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions())
    variables = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENVIRONMENT))
    text = json.dumps({"autotune": __version__, "packages": packages, "variables": variables})
    return hashlib.sha256(text.encode()).hexdigest()


def request_key(probe: Probe, function: str, body: PlanRequest) -> str:
    """The digest of what a plan request's probe depends on, as the server sees it (see the module)."""
    fields = body.model_dump()
    text = json.dumps({"probe": probe.name, "function": function, "builtin": probe.builtin, "code": probe.source(),
                       "settings": {k: fields[k] for k in PROBED}, "environment": environment()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def answer(store: Store, key: str, body: PlanRequest) -> dict[str, Any] | None:
    """The answer to ``body`` from the entry that answered ``key`` before, its hit and plan kept; None
    when a worker must answer (no such entry, or it does not answer this request's per-rank target).
    Raises PlanError or BadInput for a target that cannot be planned, as a worker would."""
    from ..planning.planner import check_plan
    from ..planning.probed import plan_probed
    from ..store.answer import for_estimate

    per_rank = math.ceil(body.target_batch / body.world_size)
    entry = store.get(request=key)
    if entry is None or not entry.estimated or not entry.answers(per_rank):
        return None
    check_plan(body.target_batch, body.target_batch, world_size=body.world_size, multiple_of=body.multiple_of)
    result = for_estimate(entry, per_rank)
    made = plan_probed(body.target_batch, result, world_size=body.world_size, world_size_source="flag",
                       multiple_of=body.multiple_of, uniform=body.uniform)
    store.put(entry.fingerprint, result=result, plan=made)
    assert made.probe is not None
    made = replace(made, probe=replace(made.probe, source=body.probe))  # the name asked for, as a worker says
    return {"plan": made.to_dict(), "cached": True, "fingerprint": entry.fingerprint}
