"""autotune.units: sizes people type in, sizes people read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autotune.errors import BadInput
from autotune.units import format_bytes, format_margin, parse_size

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GiB", 12 * GiB),
        ("512MB", 512 * 1000**2),
        ("1.5G", 1_500_000_000),
        ("100", 100),
        (100, 100),
        (" 2 kib ", 2 * KiB),
        ("1.5GiB", 3 * GiB // 2),
        ("80GB", 80 * 1000**3),
        ("24 GiB", 24 * GiB),
        ("1T", 1000**4),
        ("2TiB", 2 * TiB),
        ("7b", 7),
        (".5KiB", 512),
        ("5.KiB", 5 * KiB),
        ("1.001KB", 1001),  # exact decimal: float arithmetic gave 1000
        ("2.01MB", 2_010_000),  # float arithmetic gave 2_009_999
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("12XB", r"'12XB' is not a size: use a number with one of the units B, KiB"),
        ("-5GiB", r"'-5GiB' is negative"),
        ("0", r"'0' must be more than 0 bytes"),
        ("0.4", r"must be more than 0 bytes"),  # rounds down to 0 bytes
        ("", r"'' is not a size"),
        (True, r"True is not a size"),
        (0, r"must be more than 0 bytes"),
        (-3, r"must be more than 0 bytes"),
        ("1e3", r"is not a size"),
        ("1.5.GiB", r"is not a size"),
        ("GiB", r"is not a size"),
        ("nan", r"is not a size"),
    ],
)
def test_parse_size_rejects(text, match):
    with pytest.raises(BadInput, match=match):
        parse_size(text)


def test_parse_size_names_what_was_parsed():
    with pytest.raises(BadInput, match=r"^--memory-budget '12XB' is not a size"):
        parse_size("12XB", what="--memory-budget")


@given(st.integers(min_value=1, max_value=10**15))
def test_plain_byte_counts_round_trip(n):
    assert parse_size(str(n)) == n
    assert parse_size(n) == n


@given(st.integers(min_value=1, max_value=999_999), st.sampled_from([("KB", 1000), ("MB", 1000**2), ("GB", 1000**3)]))
def test_decimal_fractions_are_exact(milli, unit):
    # "12.345MB" is exactly 12_345_000 bytes: no float rounding on the way.
    suffix, scale = unit
    text = f"{milli // 1000}.{milli % 1000:03d}{suffix}"
    assert parse_size(text) == milli * scale // 1000


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (None, "n/a"),
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (MiB, "1.0 MiB"),
        (int(2.25 * MiB), "2.2 MiB"),  # .1f rounds half to even: 2.25 -> 2.2
        (12 * GiB, "12.0 GiB"),
        (1023 * GiB, "1023.0 GiB"),
        (TiB, "1.00 TiB"),
        (1536 * TiB, "1536.00 TiB"),
        (-2048, "-2.0 KiB"),
        (-5, "-5 B"),
        (1.5 * KiB, "1.5 KiB"),
    ],
)
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.parametrize("margin, shown", [
    (0.1, "10%"), (0.125, "12.5%"), (0.0, "0%"), (1 / 3, "33.3333%"), (0.99999, "99.999%"), (0.9999999, "99.99999%"),
])
def test_a_margin_is_shown_with_its_digits_and_never_as_100_percent(margin, shown):
    """SV10: a margin of 0.99999 is 99.999%, not 100% (a margin is below 1, so it never shows as 100%)."""
    assert format_margin(margin) == shown
