"""A job of the service: what a worker runs for a plan request, and how its failure is said.

Runs in the worker process (torch is imported there); the server process reads only
:class:`Job`, :class:`JobFailed` and the answers, which are plain data.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    NOTHING,
    AutotuneError,
    BadInput,
    DoesNotFit,
    EstimateUnavailable,
    ProbeFileError,
    Terms,
    WorkloadError,
    first_line,
)
from ..store.claims import LEASE_S
from ..store.store import Store

#: Told whose store claim a job waits for (a claim's owner), and None once the job holds the claim.
Waiting = Callable[[str | None], None]


class JobFailed(Exception):
    """A job that did not give a plan: the HTTP status to answer with and one line saying why; ``store``:
    the plan store failed it (it could not be reached, read or written); ``detail``: for a bad input, the
    items of a 422's ``detail`` list (:func:`refused`), naming the field."""

    def __init__(self, status: int, message: str, *, store: bool = False, detail: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.store = store
        self.detail = detail


def _json(value: Any) -> str:
    return json.dumps(value, default=repr)


#: A request's terms: its JSON's fields and values (``"uniform": true``).
REQUEST = Terms(name=str, given=lambda name, value: f'"{name}": {_json(value)}', shown=_json)


def refused(exc: BadInput, loc: tuple[Any, ...] = ("body",), given: Any = NOTHING) -> dict[str, Any]:
    """A bad input as one item of a 422's ``detail`` list, the shape FastAPI gives its own: ``loc`` ending with
    the field, ``msg`` in the request's terms, ``input`` (what was given), ``ctx`` (the limit or choices and the
    fix)."""
    loc, given = tuple(loc), exc.value if given is NOTHING else given
    if exc.field is not None and (not loc or loc[-1] != exc.field):
        loc += (exc.field,)  # a check of the whole body (a model validator's): the field it names
        given = given.get(exc.field) if isinstance(given, dict) else given
    item = {"type": "value_error", "loc": list(loc), "msg": exc.say(REQUEST),
            "input": json.loads(_json(given)) if given is not NOTHING else None}
    facts = exc.facts(REQUEST)
    return item | ({"ctx": json.loads(_json(facts))} if facts else {})


def cleaned(item: dict[str, Any], clean: Callable[[str], str]) -> dict[str, Any]:
    """A 422's item with ``clean`` applied to its words (``msg`` and the fix), e.g. to take out paths."""
    ctx = item.get("ctx") or {}
    return item | {"msg": clean(item["msg"])} | ({"ctx": ctx | {"fix": clean(ctx["fix"])}} if "fix" in ctx else {})


def failed(exc: AutotuneError, sent: dict[str, Any] | None = None) -> JobFailed:
    """An error of a request's settings or its job, as the request's answer: a bad input names its field, and
    what ``sent`` (the body) gave it when the error holds no value of its own."""
    message = one_line(exc.say(REQUEST))
    if not isinstance(exc, BadInput):
        return JobFailed(status_of(exc), message)
    given = (sent or {}).get(exc.field or "", NOTHING) if exc.value is NOTHING else NOTHING
    return JobFailed(status_of(exc), message, detail=[refused(exc, given=given)])


def status_of(exc: BaseException) -> int:
    """The HTTP status for an error of a job: 422 for what the request asked (a budget, a probe
    function, a plan that cannot exist, a workload that does not fit or cannot be estimated, a
    probe whose own code fails), 500 for a failure of the work."""
    if isinstance(exc, (BadInput, DoesNotFit, EstimateUnavailable, WorkloadError)):
        return 422
    return 500


@dataclass(eq=False)
class Job:
    """A request's job: what a worker runs (``body``), and ``key``, what its probes depend on, one item per
    probe (a job whose ranks differ probes each distinct device; jobs whose keys meet share those probes
    through the store). ``gone`` is set once its client has hung up."""

    body: dict[str, Any]
    key: frozenset[Hashable]
    gone: threading.Event = field(default_factory=threading.Event)


def run_job(job: dict[str, Any], store_url: str, waiting: Waiting = lambda holder: None) -> dict[str, Any]:
    """One job, in a worker: the plan its request asks for, through the API and the store."""
    from .. import api
    from ..results.request import PlanRequest

    if job["kind"] != "plan":
        raise BadInput(f"unknown job {job['kind']!r}")
    request = PlanRequest.from_dict(job["request"], source="the job")
    store = _told(store_url, waiting)
    workload = load(job["spec"], job["probe"], api.importing_device(request))
    plan = api.plan_for(request, store=store, given=api.GivenObjects(workload))
    probe = plan.probe
    assert probe is not None
    return {"plan": plan.to_dict(), "cached": probe.from_store, "fingerprint": probe.fingerprint}


class Told(Store):
    """A store that tells ``tell`` whose claim a take found held, each time that changes (None: taken)."""

    holder: str | None = None
    tell: Waiting = staticmethod(lambda holder: None)

    def take(self, fingerprint: str, owner: str, lease_s: float = LEASE_S) -> str | None:
        holder = super().take(fingerprint, owner, lease_s)
        if holder != self.holder:
            self.holder = holder
            self.tell(holder)
        return holder


_STORES: dict[str, Told] = {}


def _told(store_url: str, waiting: Waiting) -> Told:
    """The store at ``store_url`` (one per worker process, as :func:`autotune.store.open_store` keeps one),
    telling ``waiting`` whose claim its takes find held."""
    if store_url not in _STORES:
        _STORES[store_url] = Told(store_url, name="--store")
    store = _STORES[store_url]
    store.holder, store.tell = None, waiting
    return store


def load(spec: str, name: str, device: Any) -> Any:
    """The workload ``spec`` builds, imported as on ``device`` (see :func:`autotune.api.load_for`); BadInput
    saying what failed, where in the probe, and no path of this machine, when it cannot be loaded (``name``: the
    probe as the request named it)."""
    from ..api import load_for

    try:
        return load_for(spec, device)
    except ProbeFileError as exc:
        cause = exc.__cause__
        if cause is None:
            raise BadInput(f"probe {name!r} failed to load: {scrub(str(exc), spec)}", field="probe") from None
        raise BadInput(f"probe {name!r} failed to load: {failure(cause, spec)}", field="probe") from None


def failure(exc: BaseException, spec: str) -> str:
    """An exception raised by a probe file as it loads, in words: ``SyntaxError at line 3``, ``KeyError at
    line 7``; its message is left out (it may name paths, or what the file read, of this machine)."""
    path = spec.rpartition(":")[0] if spec.count(":") and not Path(spec).exists() else spec
    if isinstance(exc, SyntaxError):
        line = exc.lineno
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        line = frames[-1].lineno if frames else None
    return f"{type(exc).__name__}" + (f" at line {line}" if line else "")


def scrub(text: str, spec: str) -> str:
    """``text`` without the probe file's path (its name instead) or its folder."""
    path = Path(spec.rpartition(":")[0] if ":" in spec and not Path(spec).exists() else spec)
    if not path.is_absolute():
        return text
    return text.replace(str(path), path.name).replace(str(path.parent) + "/", "")


def answer(job: dict[str, Any], store_url: str, waiting: Waiting = lambda holder: None) -> dict[str, Any]:
    """``job``'s answer as the worker sends it back: the plan, or the HTTP status and one line saying why not
    (``waiting``: told whose store claim the job waits for)."""
    from sqlalchemy.exc import SQLAlchemyError

    from ..store.store import StoreUnavailable

    try:
        return {"ok": True, **run_job(job, store_url, waiting)}
    except AutotuneError as exc:
        said = failed(exc, job.get("body"))  # the body as sent: what a field at fault was given
        detail = [cleaned(item, lambda text: bare(scrub(text, job["spec"]))) for item in said.detail or ()]
        return {"ok": False, "status": said.status, "error": bare(scrub(said.message, job["spec"])),
                "detail": detail or None, "store_error": isinstance(exc, StoreUnavailable)}
    except SQLAlchemyError as exc:  # what the driver says names the database's host, port and user: logged
        logging.getLogger("autotune.serve").warning("autotune serve: the store cannot be used now: %s",
                                                    first_line(exc))
        return {"ok": False, "status": 503, "store_error": True,
                "error": f"the store cannot be used now ({type(exc).__name__}); the service is fine: try again once "
                         "the database answers"}
    except Exception as exc:  # the probe's own code, or a bug: the request gets it, the worker lives
        return {"ok": False, "status": 500, "error": bare(scrub(one_line(f"{type(exc).__name__}: {exc}"), job["spec"]))}
    except (SystemExit, KeyboardInterrupt) as exc:  # the probe's own code: the request gets it, the worker lives
        did = f"called exit({exc.code})" if isinstance(exc, SystemExit) else "raised KeyboardInterrupt"
        return {"ok": False, "status": 422, "error": f"probe {job['probe']!r} {did} while it was planned: a probe's "
                                                     "code returns a workload or raises an error, and never exits"}


#: The folders of an absolute path in a text (``/srv/data/`` of ``'/srv/data/train.bin'``), not a URL's.
_FOLDERS = re.compile(r"(?<![\w.~:/-])/(?:[^\s'\"/:]+/)+(?=[^\s'\"/:])")


def bare(text: str) -> str:
    """``text`` (a job's error, which may quote what a probe's code said) with absolute paths given by their last
    part only: a client is not told this machine's folders."""
    return _FOLDERS.sub("", text)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else text
