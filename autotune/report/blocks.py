"""What a report is made of: sections of plain blocks, rendered alike to HTML and Markdown.

The content is built once (``content.py``) and each renderer only lays it out,
so report.html and report.md always say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


@dataclass(frozen=True)
class Text:
    """A paragraph. ``tone`` is None, "ok", "fail", "warn" or "muted"."""

    text: str
    tone: str | None = None


@dataclass(frozen=True)
class Rows:
    """A two-column table of (label, value)."""

    rows: tuple[tuple[str, str], ...]
    id: str | None = None


@dataclass(frozen=True)
class Table:
    """A table of display strings, one column per DataFrame column."""

    frame: pd.DataFrame
    caption: str = ""


@dataclass(frozen=True)
class Image:
    """A PNG: embedded in report.html, a file beside report.md."""

    file: str
    alt: str
    png: bytes = field(repr=False)
    caption: str = ""


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]
    tone: str | None = None


@dataclass(frozen=True)
class Code:
    """A command line or other literal text."""

    text: str


Block = Text | Rows | Table | Image | Bullets | Code


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Report:
    title: str
    verdict: Text
    sections: tuple[Section, ...]
    footer: str

    @property
    def images(self) -> tuple[Image, ...]:
        return tuple(b for s in self.sections for b in s.blocks if isinstance(b, Image))
