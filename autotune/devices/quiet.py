"""torch's own log lines that estimate runs provoke, kept off the user's terminal while autotune estimates.

When a kernel fails on fake tensors (a shape error in the user's model, say),
FakeTensorMode logs it at ERROR level with a traceback before raising; autotune
then reports the same error itself, in one line. Only those loggers, only while
an estimate runs: they are restored afterwards, and never touched elsewhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

#: Loggers that report the very error an estimate run raises.
ESTIMATE_LOGGERS = ("torch._subclasses.fake_tensor",)


def quiet_torch_logs(fn: F) -> F:
    """``fn`` with ``ESTIMATE_LOGGERS`` disabled while it runs (and as they were afterwards)."""

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        loggers = [logging.getLogger(name) for name in ESTIMATE_LOGGERS]
        before = [logger.disabled for logger in loggers]
        for logger in loggers:
            logger.disabled = True
        try:
            return fn(*args, **kwargs)
        finally:
            for logger, disabled in zip(loggers, before):
                logger.disabled = disabled

    return quiet  # type: ignore[return-value]
