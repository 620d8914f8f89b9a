"""``python -m autotune`` (and ``torchrun ... -m autotune``) is the ``autotune`` command."""

from .cli import main

raise SystemExit(main())
