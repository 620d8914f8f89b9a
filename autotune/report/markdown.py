"""report.md: the same content as report.html, for a pull request or an issue.

Plots are the PNG files beside it, linked by relative name; tables are
GitHub-flavoured Markdown tables made from the same pandas DataFrames.
"""

from __future__ import annotations

import re

import pandas as pd

from .blocks import Block, Bullets, Code, Image, Report, Rows, Table, Text

_SPECIAL = re.compile(r"([\\`*_\[\]<|#])")
_TONE = {"ok": "**OK:** ", "fail": "**FAILED:** ", "warn": "**Warning:** ", "muted": "", None: ""}


def escape(text: str) -> str:
    """Text shown literally: Markdown's special characters backslash-escaped, newlines as spaces."""
    return _SPECIAL.sub(r"\\\1", str(text)).replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A table of literal text; cells must be escaped already."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def slug(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def frame_table(frame: pd.DataFrame) -> str:
    return table([escape(c) for c in frame.columns],
                 [[escape(v) for v in row] for row in frame.itertuples(index=False)])


def block(b: Block) -> str:
    if isinstance(b, Text):
        return _TONE.get(b.tone, "") + escape(b.text)
    if isinstance(b, Rows):
        return table(["", ""], [[f"**{escape(k)}**", escape(v)] for k, v in b.rows])
    if isinstance(b, Table):
        return frame_table(b.frame) + (f"\n\n_{escape(b.caption)}_" if b.caption else "")
    if isinstance(b, Image):
        return f"![{escape(b.alt)}]({b.file})" + (f"\n\n_{escape(b.caption)}_" if b.caption else "")
    if isinstance(b, Bullets):
        prefix = _TONE.get(b.tone, "")
        return "\n".join(f"- {prefix}{escape(item)}" for item in b.items)
    if isinstance(b, Code):
        return f"```text\n{b.text}\n```"
    raise TypeError(f"unknown block {type(b).__name__}")


def render(report: Report) -> str:
    parts = [f"# {escape(report.title)}", block(report.verdict),
             " · ".join(f"[{escape(s.title)}](#{slug(s.title)})" for s in report.sections)]
    for section in report.sections:
        parts.append(f"## {escape(section.title)}")
        parts += [block(b) for b in section.blocks]
    parts.append(f"---\n\n_{escape(report.footer)}_")
    return "\n\n".join(parts) + "\n"
