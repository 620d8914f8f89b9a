"""``python -m autotune`` (and ``torchrun ... -m autotune``) is the ``autotune`` command."""

from .cli import main

if __name__ == "__main__":  # not when a worker process of ``autotune serve`` starts (it imports this as __mp_main__)
    raise SystemExit(main())
