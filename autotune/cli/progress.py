"""Progress on stderr: the ``autotune`` logger's records, one line each, status lines in place.

On a terminal a transient record (a micro-step counter) overwrites the line it
is on and the next ordinary line replaces it; piped, transient records become
plain lines, at most one every few seconds, so a log stays short.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator

from ..log import TRANSIENT, logger

PIPED_EVERY_S = 2.0


class StderrProgress(logging.Handler):
    """Writes ``  message`` lines to stderr (looked up at each record, so captures work)."""

    def __init__(self, level: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(level)
        self._clock = clock
        self._status = False  # a transient line is on screen
        self._last_line = clock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                text = f"{record.levelname.lower()}: {text}"
            tty = stream.isatty()
            if getattr(record, TRANSIENT, False):
                if tty:
                    width = max(20, shutil.get_terminal_size((100, 20)).columns - 3)
                    stream.write(f"\r\x1b[2K  {text[:width]}")
                    self._status = True
                elif self._clock() - self._last_line >= PIPED_EVERY_S:
                    stream.write(f"  {text}\n")
                    self._last_line = self._clock()
            else:
                if self._status:
                    stream.write("\r\x1b[2K")
                    self._status = False
                stream.write(f"  {text}\n")
                self._last_line = self._clock()
            stream.flush()
        except Exception:  # never let progress break the work
            self.handleError(record)

    def close(self) -> None:
        if self._status:
            with contextlib.suppress(OSError, ValueError):  # stderr gone or closed: nothing left to clear
                sys.stderr.write("\r\x1b[2K")
                sys.stderr.flush()
            self._status = False
        super().close()


@contextlib.contextmanager
def progress_on_stderr(*, quiet: bool = False, verbose: bool = False) -> Iterator[None]:
    """Show the ``autotune`` logger on stderr for the block: INFO, warnings only when
    ``quiet``, DEBUG too when ``verbose``."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    handler = StderrProgress(level)
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
        handler.close()
