"""Plan requests answered from the store in the server's own process, with no worker and no torch.

A worker that answers a plan request takes the probe's fingerprint (tracing the workload on shape-only
tensors, torch's work), and the service keeps which fingerprint answered the request's settings
(:func:`request_key`) in the store, for every replica to see. The next request with those settings is
answered here: the stored entry, as a probe limited to the request's per-rank target gives it
(:func:`autotune.store.answer.for_estimate`), planned (:func:`autotune.planning.probed.plan_probed`),
its plan and hit kept as a worker keeps them, without a write per answer (:class:`FromStore`).

The key covers what the fingerprint depends on and the server can see without torch: the probe's
name, function and code (the ``*.py`` files of its folder), the request's device, budget, world size,
parallel strategy, margin and precision, autotune's and every installed package's version, and the
environment variables torch and autotune read (``PYTORCH_*``, ``TORCH_*``, ``CUDA_*``, ``CUBLAS_*``,
``AUTOTUNE_*``). A request whose entry cannot answer it (none yet, damaged, invalidated, limited below
its target) goes to a worker, which probes; so does one with a device or budget per rank (its plan needs
every rank's entry and the ranks' speeds, which a worker reads from the store and estimates).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ..errors import BadInput, first_line
from ..results.plan import Plan
from ..store.schema import Entry
from ..store.store import Store
from .bodies import PlanRequest
from .models import named
from .probes import Probe

#: The environment variables a worker's fingerprint may depend on, by prefix.
ENVIRONMENT = ("PYTORCH_", "TORCH_", "CUDA_", "CUBLAS_", "AUTOTUNE_")
#: The request's fields that its probe depends on (the rest are the planner's).
PROBED = ("device", "memory_budget", "world_size", "parallel", "margin", "precision")

_log = logging.getLogger("autotune.serve")


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


def model_key(spec: str, body: PlanRequest) -> str:
    """:func:`request_key` of a request for a model by name: its spec (``hf:NAME?...``) for the probe's code,
    and an operator's model folder's config.json as it is now."""
    from ..results.model import ModelSpec

    fields = body.model_dump()
    name = Path(ModelSpec.parse(spec).name)
    config = (name / "config.json" if name.is_dir() else name).read_bytes() if name.is_absolute() else b""
    text = json.dumps({"model": spec, "config": hashlib.sha256(config).hexdigest(),
                       "settings": {k: fields[k] for k in PROBED}, "environment": environment()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class FromStore:
    """Answers plan requests from the store in this process (see the module). The entry a request's
    settings found is read again once it is :data:`READ_S` old; an answer made from it is kept here, as
    the bytes sent, until that entry changes (:data:`ANSWERS` of them, the oldest dropped first). What
    an answer keeps in the store (its hit; its plan, when it was made) waits for no answer: a thread of
    this object's writes it once a second (:data:`FLUSH_S`), in one transaction, and :meth:`flush` does
    before this service lists the store and when it stops."""

    #: How often the hits served and the plans made are written to the store.
    FLUSH_S = 1.0
    #: How many answers are kept, made.
    ANSWERS = 4096
    #: For how long an entry read for a request answers the same request again without a read (another
    #: replica's change to it, or its removal, is seen this much later at most).
    READ_S = 1.0

    def __init__(self, store: Store):
        self.store = store
        self._hits: collections.Counter[str] = collections.Counter()
        self._plans: list[tuple[str, Plan]] = []
        self._answers: collections.OrderedDict[tuple[Any, ...], bytes] = collections.OrderedDict()
        self._read: dict[str, tuple[float, Entry]] = {}  # request key -> (when read, the entry)
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flushing, name="autotune-hits", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.flush()

    def _flushing(self) -> None:
        while not self._stop.wait(self.FLUSH_S):
            try:
                self.flush()
            except (SQLAlchemyError, BadInput) as exc:  # the store is away for now: written the next time
                _log.warning("autotune serve: hits and plans not written to the store yet (%s)", first_line(exc))

    def flush(self) -> None:
        """Write the hits served and the plans made since the last time to the store (kept for the next
        time when it fails, and raised)."""
        with self._writing:
            with self._lock:
                hits, self._hits = self._hits, collections.Counter()
                plans, self._plans = self._plans, []
            try:
                self.store.served(hits, plans)
            except BaseException:  # whatever stopped the write (even an interrupt), nothing served is lost
                with self._lock:
                    self._hits.update(hits)
                    self._plans[:0] = plans
                raise

    def answer(self, key: str, body: PlanRequest) -> dict[str, Any] | None:
        """The answer to ``body`` from the entry that answered ``key`` before (``cached``, ``fingerprint``,
        and ``body``, the bytes to send); None when a worker must answer (no such entry, or it does not
        answer this request's per-rank target; a device or budget per rank). Raises PlanError or BadInput
        for a target that cannot be planned, as a worker would."""
        if body.listed():  # ranks that may differ: a worker plans them from the store's entries
            return None
        per_rank = math.ceil(body.target_batch / body.world_size)
        entry = self._entry(key)
        if entry is None or not entry.estimated or not entry.answers(per_rank):
            return None
        made_for = (key, body.probe, body.target_batch, body.multiple_of, body.uniform, entry.fingerprint,
                    entry.created_at)
        with self._lock:
            sent = self._answers.get(made_for)
            if sent is not None:
                self._answers.move_to_end(made_for)
        if sent is None:
            sent = self._make(entry, per_rank, body)
            with self._lock:
                self._answers[made_for] = sent
                while len(self._answers) > self.ANSWERS:
                    self._answers.popitem(last=False)
        with self._lock:
            self._hits[entry.fingerprint] += 1
        return {"cached": True, "fingerprint": entry.fingerprint, "body": sent}

    def _entry(self, key: str) -> Entry | None:
        """The entry that answered ``key`` before, read from the store at most :data:`READ_S` ago."""
        now = time.monotonic()
        with self._lock:
            read = self._read.get(key)
        if read is not None and now - read[0] < self.READ_S:
            return read[1]
        entry = self.store.get(request=key)
        with self._lock:
            if entry is None:
                self._read.pop(key, None)
            else:
                if len(self._read) >= self.ANSWERS:
                    self._read.clear()
                self._read[key] = (now, entry)
        return entry

    def _make(self, entry: Entry, per_rank: int, body: PlanRequest) -> bytes:
        """The answer from ``entry``, as a worker gives it; its plan to be kept in the store."""
        from ..planning.planner import check_plan
        from ..planning.probed import plan_probed
        from ..store.answer import for_estimate

        check_plan(body.target_batch, body.target_batch, world_size=body.world_size, multiple_of=body.multiple_of)
        result = for_estimate(entry, per_rank)
        planned = plan_probed(body.target_batch, result, world_size=body.world_size, world_size_source="flag",
                              multiple_of=body.multiple_of, uniform=body.uniform)
        with self._lock:
            self._plans.append((entry.fingerprint, planned))
        plan = planned.to_dict()
        plan["probe"]["source"] = named(body)  # the name asked for, as a worker says it
        return render({"plan": plan, "cached": True, "fingerprint": entry.fingerprint})


def render(answer: dict[str, Any]) -> bytes:
    """A plan request's answer as the bytes sent (JSON, as FastAPI's JSONResponse writes it)."""
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

