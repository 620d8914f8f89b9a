"""Memory sizes: parse what people type, print what people read."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .errors import BadInput

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
#: The largest size taken (1 EiB): far beyond any device's memory, and within every integer type a size meets.
MAX_SIZE = 2**60
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, what: str = "memory size") -> int:
    """Parse ``"12GiB"``, ``"512MB"``, ``"1.5G"`` or a plain byte count into bytes.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
    GB, TB, or K/M/G/T) powers of 1000. Raises BadInput for anything else.
    """
    if isinstance(text, bool):
        raise BadInput("is not a size", field=what, value=text,
                       fix="give bytes or a number with a unit such as 512MiB or 12GiB")
    if isinstance(text, float) and math.isfinite(text) and abs(text) > MAX_SIZE:
        value = int(text)
    elif isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            if str(text).strip().startswith("-"):
                raise BadInput("is negative", field=what, value=text, limit=1,
                               fix="give a positive size such as 512MiB or 12GiB")
            raise BadInput("is not a size", field=what, value=text, choices=("B", "KiB", "MiB", "GiB", "TiB", "KB",
                                                                               "MB", "GB", "TB"),
                           fix="use a number with one of the units B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB), e.g. "
                               "512MiB or 12GiB")
        # Exact decimal arithmetic: float("1.001") * 1000 would give 1000.
        value = int(Fraction(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise BadInput("must be more than 0 bytes", field=what, value=text, limit=1,
                       fix="give a size such as 512MiB or 12GiB")
    if value > MAX_SIZE:
        raise BadInput(f"is too large: at most {MAX_SIZE:,} bytes (1 EiB)", field=what, value=text, limit=MAX_SIZE,
                       fix="e.g. 512MiB or 12GiB")
    return value


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 step``, ``2 steps``: a count with its noun; ``many`` where adding "s" is wrong (process, processes)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def format_margin(margin: float) -> str:
    """A margin as a percentage to 6 significant digits, more where those would round a margin below 1 up to
    100%: ``0.1 -> '10%'``, ``0.125 -> '12.5%'``, ``0.99999 -> '99.999%'``, ``0.9999999 -> '99.99999%'``. The one
    way results and messages print a margin."""
    digits = 6
    while f"{margin * 100:.{digits}g}" == "100" and margin < 1 and digits < 17:
        digits += 1
    return f"{margin * 100:.{digits}g}%"


def format_bytes(n: float | int | None) -> str:
    """``1536 -> '1.5 KiB'``; sizes a person reads, in binary units."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"
