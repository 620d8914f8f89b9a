"""The error hierarchy: every message says what failed, the numbers, and the fix.

``exit_code`` is what the CLI returns for the error: 2 for bad input (the user
can fix the command line or the probe file), 1 for a failure of the work itself.

A bad input is data (:class:`BadInput`: the field, the value, the limit or choices,
the fix) that each front end says its own way. The words of a message may mention
a setting as ``{name}``, or as ``{name=VALUE}`` with VALUE a Python literal
(``{uniform=True}``, ``{parallel='fsdp'}``); :class:`Terms` says how a front end
writes those (the library: ``uniform=True``; the command line: ``--uniform``; the
service's JSON: ``"uniform": true``), so no front end rewrites another's text.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Terms:
    """How a front end names settings: ``name`` a setting, ``given`` a setting set to a value in a message's
    words, ``shown`` a value the user gave."""

    name: Callable[[str], str]
    given: Callable[[str, Any], str]
    shown: Callable[[Any], str]


#: The library's terms: its parameters' names, Python's values (``uniform=True``, ``memory_budget '12XB'``).
LIBRARY = Terms(name=str, given=lambda name, value: f"{name}={value!r}", shown=repr)


def words(text: str, terms: Terms = LIBRARY) -> str:
    """``text`` with each mention of a setting (``{name}``, ``{name=VALUE}``) in ``terms``; braces around
    anything else are left as they are."""
    said, rest = [], text
    while (start := rest.find("{")) >= 0 and (end := rest.find("}", start)) >= 0:
        name, is_given, literal = rest[start + 1:end].partition("=")
        mention = None
        if name.isidentifier() and not is_given:
            mention = terms.name(name)
        elif name.isidentifier():
            with contextlib.suppress(ValueError, SyntaxError):
                mention = terms.given(name, ast.literal_eval(literal))
        said.append(rest[:start] + (rest[start:end + 1] if mention is None else mention))
        rest = rest[end + 1:]
    return "".join(said) + rest


def mention(name: str, *value: Any) -> str:
    """A setting as a message's words mention it: ``{name}``, or ``{name=VALUE}`` with ``value`` given; a name
    already in a front end's terms (``--memory-snapshot``) as it is."""
    if not name.isidentifier():
        return name
    return "{" + name + (f"={value[0]!r}" if value else "") + "}"


class AutotuneError(Exception):
    """Base class of every error autotune raises on purpose. Its message's words may mention settings
    (see :func:`words`): ``str(exc)`` says them in the library's terms, :meth:`say` in a front end's."""

    exit_code = 1

    def say(self, terms: Terms = LIBRARY) -> str:
        """The message in ``terms``."""
        return words(str(self.args[0]) if self.args else "", terms)

    def __str__(self) -> str:
        return self.say(LIBRARY)


#: ``BadInput(value=...)`` not given: the error is about no one value.
NOTHING: Any = type("Nothing", (), {"__repr__": lambda self: "NOTHING"})()


class BadInput(AutotuneError, ValueError):
    """A flag, a size, a file or an argument that cannot be used as given.

    As data: ``field`` (the setting at fault, by its library name, when one is), ``value`` (what was given;
    :data:`NOTHING` when the error is about no one value), ``limit`` or ``choices`` (what it may be),
    ``problem`` (what is wrong) and ``fix`` (what to do), in words that may mention settings. With a value,
    the message reads ``FIELD VALUE PROBLEM: FIX``; without, ``PROBLEM: FIX`` (``, e.g. ...`` for a fix that is an
    example).
    """

    exit_code = 2

    def __init__(self, problem: str = "", *, field: str | None = None, value: Any = NOTHING, limit: Any = None,
                 choices: Sequence[Any] | None = None, fix: str = ""):
        super().__init__(problem)
        self.problem, self.field, self.value, self.fix = problem, field, value, fix
        self.limit, self.choices = limit, tuple(choices) if choices is not None else None

    def say(self, terms: Terms = LIBRARY) -> str:
        text = words(self.problem, terms)
        if self.field is not None and self.value is not NOTHING:
            text = f"{terms.name(self.field)} {terms.shown(self.value)}{'' if text[:1] in ':,' else ' '}{text}"
        if not self.fix:
            return text
        return f"{text}{', ' if self.fix.startswith('e.g.') else ': '}{words(self.fix, terms)}"

    def facts(self, terms: Terms = LIBRARY) -> dict[str, Any]:
        """What is known besides the words: ``limit``, ``choices`` and ``fix`` (in ``terms``) where given."""
        known = {"limit": self.limit, "choices": list(self.choices) if self.choices is not None else None,
                 "fix": words(self.fix, terms) or None}
        return {k: v for k, v in known.items() if v is not None}


class ProbeFileError(BadInput):
    """A probe file that cannot be loaded or does not build a Workload."""


class DeviceError(BadInput):
    """A device that does not exist here or cannot be used as asked."""


class PlanError(BadInput):
    """A target effective batch that cannot be planned under the constraints given."""


class NoUniformPlan(PlanError):
    """No plan of equal micro-batches within the steps allowed; the numbers let a caller say it in its own terms."""

    def __init__(self, message: str, *, target: int, max_micro_batch: int, world_size: int, multiple_of: int):
        super().__init__(message, field="uniform")
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
    (the bytes needed and usable), for a caller that names the rank or device and gives fixes of its own;
    ``needed``: the bytes micro-batch 1 needs (None where unknown, e.g. it ran out of memory). ``fixes``, given
    instead of a whole ``message``: what may make it fit, worked out when the message is first read (the
    message is then ``facts: fixes``), so a caller that reads the facts alone never works them out."""

    def __init__(self, message: str = "", *, facts: str | None = None, needed: int | None = None,
                 fixes: Callable[[], str] | None = None):
        super().__init__(message)
        self.facts = facts if facts is not None else message
        self.needed = needed
        self._fixes = fixes

    def fixes(self) -> str:
        """What the message says after its facts (may make it fit)."""
        if self._fixes is not None:
            said, self._fixes = self._fixes(), None
            self.args = (f"{self.facts}: {said}",)
        message = str(self.args[0]) if self.args else ""
        return message[len(self.facts):].removeprefix(": ") if message.startswith(self.facts) else ""

    def say(self, terms: Terms = LIBRARY) -> str:
        self.fixes()
        return super().say(terms)

    def __reduce__(self) -> Any:  # to another process with its message whole
        self.fixes()
        return type(self), self.args, {"facts": self.facts, "needed": self.needed, "_fixes": None}


class WorkloadError(AutotuneError):
    """The workload's own code raised an error that is not out-of-memory."""

    def __init__(self, message: str, *, batch: int | None = None, workload: str | None = None):
        super().__init__(message)
        self.batch = batch
        self.workload = workload

    def say(self, terms: Terms = LIBRARY) -> str:
        """The message as written: it quotes the user's code, whose braces mention no setting."""
        return str(self.args[0]) if self.args else ""


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
