"""torch's own log lines that estimate runs provoke, kept off the user's terminal while autotune estimates.

When a kernel fails on fake tensors (a shape error in the user's model, say),
FakeTensorMode logs it at ERROR level with a traceback before raising; autotune
then reports the same error itself, in one line. Only those loggers, only while
an estimate runs (the estimate session silences them): they are restored
afterwards, and never touched elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ..compat import FAKE_TENSOR_LOGGER

#: Loggers that report the very error an estimate run raises.
ESTIMATE_LOGGERS = (FAKE_TENSOR_LOGGER,)


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """``ESTIMATE_LOGGERS`` disabled while inside (and as they were afterwards)."""
    loggers = [logging.getLogger(name) for name in ESTIMATE_LOGGERS]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, before):
            logger.disabled = disabled
