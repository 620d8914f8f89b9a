"""How the torchrun test workers end: as autotune's command line ends a torchrun rank."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def run_then_exit(main: Callable[[], None]) -> None:
    """``main()``, then no interpreter finalization while gloo's threads may still hold what they release with
    the GIL (it can abort a rank at exit on a loaded machine). An exception from ``main`` propagates."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
