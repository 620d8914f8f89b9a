"""Progress and notes through :mod:`logging`: the ``autotune`` logger, never ``print``.

Long work reports what it is doing as INFO records on the ``autotune`` logger.
A record made with ``transient=True`` is a status line that a terminal may
overwrite in place (a micro-step counter inside a long run); the next
ordinary line replaces it. The command line shows INFO records on stderr
(``-q`` warnings only, ``-v`` debug detail too). A program using the library
sees nothing unless it configures logging, e.g.
``logging.basicConfig(level=logging.INFO)``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("autotune")
logger.addHandler(logging.NullHandler())

TRANSIENT = "autotune_transient"


def progress(message: str, *, transient: bool = False) -> None:
    """Say what the work is doing now (INFO); ``transient`` lines may be overwritten."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(message, extra={TRANSIENT: transient})


def detail(message: str) -> None:
    """Detail for ``-v`` (DEBUG)."""
    logger.debug(message)
