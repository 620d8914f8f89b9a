"""The error hierarchy: every message says what failed, the numbers, and the fix.

``exit_code`` is what the CLI returns for the error: 2 for bad input (the user
can fix the command line or the probe file), 1 for a failure of the work itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class AutotuneError(Exception):
    """Base class of every error autotune raises on purpose."""

    exit_code = 1


class BadInput(AutotuneError, ValueError):
    """A flag, a size, a file or an argument that cannot be used as given."""

    exit_code = 2


class ProbeFileError(BadInput):
    """A probe file that cannot be loaded or does not build a Workload."""


class DeviceError(BadInput):
    """A device that does not exist here or cannot be used as asked."""


class PlanError(BadInput):
    """A target effective batch that cannot be planned under the constraints given."""


class NoUniformPlan(PlanError):
    """No plan of equal micro-batches within the steps allowed; the numbers let a caller say it in its own terms."""

    def __init__(self, message: str, *, target: int, max_micro_batch: int, world_size: int, multiple_of: int):
        super().__init__(message)
        self.target, self.max_micro_batch = target, max_micro_batch
        self.world_size, self.multiple_of = world_size, multiple_of


class RanksDiffer(PlanError):
    """Equal micro-batches asked for (``uniform``, a framework's one per-device batch size) on ranks that differ;
    ``maxima`` (each rank's max micro-batch) let a caller say it in its own terms."""

    def __init__(self, message: str, *, maxima: tuple[int, ...]):
        super().__init__(message)
        self.maxima = maxima


class ResultFileError(BadInput):
    """A JSON file that is not an autotune result this version can read."""


class DoesNotFit(AutotuneError):
    """Even a micro-batch of one does not fit the usable memory. ``facts``: what the message says before its fixes
    (the bytes needed and usable), for a caller that names the rank or device and gives fixes of its own."""

    def __init__(self, message: str, *, facts: str | None = None):
        super().__init__(message)
        self.facts = facts if facts is not None else message


class WorkloadError(AutotuneError):
    """The workload's own code raised an error that is not out-of-memory."""

    def __init__(self, message: str, *, batch: int | None = None, workload: str | None = None):
        super().__init__(message)
        self.batch = batch
        self.workload = workload


class EstimateUnavailable(AutotuneError):
    """The estimate cannot run a workload (or cannot be trusted for it) and no real device can search."""


def first_line(exc: BaseException) -> str:
    """An error in one line: ``TypeName: the first line of its message`` (the type alone when it says nothing)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def undo_on_failure(undo: Callable[[], object]) -> Iterator[None]:
    """Run the block; if anything stops it (an error, an interrupt, a generator closed), run ``undo`` and let
    that go on as it was. A block left normally, by ``return``, ``break`` or ``continue``, is not undone."""
    done = False
    try:
        yield
        done = True
    finally:
        if not done:
            undo()


@contextlib.contextmanager
def user_code(error: Callable[[Exception], Exception]) -> Iterator[None]:
    """Run the block, the user's own code (a workload's factory, a probe file, a collator): whatever it raises
    comes out as ``error(exc)``, chained to it. ``KeyboardInterrupt`` and ``SystemExit`` pass as they are."""
    try:
        yield
    except Exception as exc:  # the user's code may raise anything: each kind is theirs to report, not ours
        raise error(exc) from exc
