"""The results every stage hands to the next: typed, frozen, validated, JSON with a ``kind`` and a
``schema_version`` (see :mod:`autotune.serial` for the envelope).

Owns: ProbeResult and its Trials, Plan, RunResult, the batch ramp's RampConfig and BatchPhase, and
:class:`~autotune.results.record.Record`, the base every request and result type derives from: a frozen,
keyword-only dataclass whose fields are declared once, with their JSON type and their rule (a check of
:mod:`autotune.options`), from which the checks, ``to_dict`` and ``from_dict`` follow; beside the requests,
:mod:`~autotune.results.settings` declares each setting of a probe and a plan once, for the command line's
flags, the API's keywords and the service's body. May import: errors,
units, serial, options (no torch, no numpy, no pandas: the planner and the reports read results without them).

Why a validator of our own and not pydantic (``python bench/result_io.py``; CPU time, 2-core Xeon, median
of 9 fresh interpreters):

- Import: ``autotune.results`` takes 41 ms in all; ``from pydantic import BaseModel`` 44 ms and building a
  ``TypeAdapter`` over RunResult's types 41 ms more, about three times the cost on every path that reads a
  result (the planner, ``autotune report``, ``autotune store``); ``--help`` and ``devices`` import neither.
  pydantic is a dependency of the service only (``autotune[serve]``); the library would gain one.
- Speed: a 5 MB RunResult (10,000 trials, 10,000 steps) reads in 0.16 s and writes in 0.20 s, pydantic's
  ``validate_json`` 0.05 s; a plan of 1,000,000 micro-batches 0.08 s and 0.31 s, pydantic 0.06 s. Most of
  the writing is ``json.dumps``'s indented layout, which pydantic's writer does not reproduce (``1e-05``
  becomes ``0.00001``, non-ASCII is left unescaped): written files would change.
- Format: to pydantic "3" and 3.0 are whole numbers, null is not NaN, its errors are lists in its own
  words; this format's rules (strict JSON types, null as the NaN it stands for, one line naming the field)
  would each need a custom type and a translation of errors, as much code as the reader it replaces.

pydantic builds a ``TypeAdapter`` over these dataclasses as they are, should the service want one.
"""

from __future__ import annotations

from .device import DeviceInfo
from .plan import Plan
from .probe import TRIAL_COLUMNS, ProbeResult, Trial
from .ramp import BatchPhase, RampConfig
from .run import Check, RunResult, Verification
from .tuning import Candidate, HeadToHead, Tuning

__all__ = ["TRIAL_COLUMNS", "BatchPhase", "Candidate", "Check", "DeviceInfo", "HeadToHead", "Plan", "ProbeResult",
           "RampConfig", "RunResult", "Trial", "Tuning", "Verification"]
