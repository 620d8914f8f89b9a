"""report.html: one self-contained page.

Plots are embedded as base64 ``data:`` URIs and the style sheet is inline;
there are no scripts, fonts, links or images from anywhere else, so the file
opens the same in any browser, offline, attached to an email or an issue.
The only links are in-page ``#anchors``.
"""

from __future__ import annotations

import base64
import struct
from html import escape

from .blocks import Block, Bullets, Code, Image, Report, Rows, Table, Text

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1f2328; margin: 0 auto;
       max-width: 60rem; padding: 1.5rem; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: .3rem; }
h2 { font-size: 1.25rem; border-bottom: 1px solid #d0d7de; padding-bottom: .2rem; margin-top: 2rem; }
nav { font-size: .9rem; color: #59636e; }
nav a { color: #0969da; text-decoration: none; margin-right: .8rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .9rem; }
th, td { border: 1px solid #d0d7de; padding: .25rem .6rem; text-align: left; vertical-align: top; }
thead th { background: #f6f8fa; }
table.kv th { background: #f6f8fa; font-weight: 600; white-space: nowrap; }
figure { margin: 1rem 0; }
img { max-width: 100%; height: auto; border: 1px solid #d0d7de; }
figcaption { font-size: .85rem; color: #59636e; }
pre { background: #f6f8fa; padding: .6rem .8rem; overflow-x: auto; }
.verdict { padding: .6rem .8rem; border-radius: 6px; border: 1px solid #d0d7de; }
.ok { background: #dafbe1; border-color: #4ac26b; }
.fail { background: #ffebe9; border-color: #ff8182; }
.warn { background: #fff8c5; border-color: #d4a72c; }
ul.warn { padding: .5rem 1.5rem; border: 1px solid #d4a72c; border-radius: 6px; }
p.ok, p.fail { padding: .4rem .8rem; border: 1px solid; border-radius: 6px; }
.muted { color: #59636e; }
footer { margin-top: 2.5rem; font-size: .8rem; color: #59636e; }
"""


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return struct.unpack(">II", png[16:24])


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _tone(tone: str | None) -> str:
    return f' class="{tone}"' if tone else ""


def block(b: Block) -> str:
    if isinstance(b, Text):
        return f"<p{_tone(b.tone)}>{escape(b.text)}</p>"
    if isinstance(b, Rows):
        ident = f' id="{escape(b.id)}"' if b.id else ""
        rows = "\n".join(f'<tr><th scope="row">{escape(k)}</th><td>{escape(v)}</td></tr>' for k, v in b.rows)
        return f'<table class="kv"{ident}>\n<tbody>\n{rows}\n</tbody>\n</table>'
    if isinstance(b, Table):
        table = b.frame.to_html(index=False, escape=True, border=0, classes="data")
        return table + (f"\n<p class=\"muted\">{escape(b.caption)}</p>" if b.caption else "")
    if isinstance(b, Image):
        width, height = png_size(b.png)
        caption = f"<figcaption>{escape(b.caption)}</figcaption>" if b.caption else ""
        return (f'<figure><img src="{data_uri(b.png)}" alt="{escape(b.alt)}" width="{width}" height="{height}" '
                f'data-file="{escape(b.file)}">{caption}</figure>')
    if isinstance(b, Bullets):
        items = "\n".join(f"<li>{escape(item)}</li>" for item in b.items)
        return f"<ul{_tone(b.tone)}>\n{items}\n</ul>"
    if isinstance(b, Code):
        return f"<pre><code>{escape(b.text)}</code></pre>"
    raise TypeError(f"unknown block {type(b).__name__}")


def render(report: Report) -> str:
    nav = " ".join(f'<a href="#{escape(s.id)}">{escape(s.title)}</a>' for s in report.sections)
    body = "\n".join(
        f'<section id="{escape(s.id)}">\n<h2>{escape(s.title)}</h2>\n' + "\n".join(block(b) for b in s.blocks)
        + "\n</section>" for s in report.sections)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(report.title)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>{escape(report.title)}</h1>
<p class="verdict{' ' + report.verdict.tone if report.verdict.tone else ''}">{escape(report.verdict.text)}</p>
<nav>{nav}</nav>
{body}
<footer>{escape(report.footer)}</footer>
</body>
</html>
"""
