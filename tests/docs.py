"""README.md and the pages under docs/: their sections and code blocks, for the tests that run the examples.

A page is ``"README.md"`` or a file name under ``docs/`` (``"integrations.md"``). A section is the text under
one heading (any level) up to the next heading; headings inside code blocks are code, not headings.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Every python block of README.md and docs/*.md, as (page, heading, index under the heading), and the test that
#: runs it as written (a block of README that repeats a page's is run by the page's test, which checks they match).
RUN_BY = {
    ("README.md", "Your own training loop", 0): "tests/test_docs.py::test_your_own_training_loop",
    ("README.md", "Where you already train", 0): "tests/integrations/test_readme.py::test_hugging_face",
    ("your-model.md", "Your own model", 0): "tests/test_docs.py::test_a_probe_file_and_a_request",
    ("your-model.md", "Your own model", 1): "tests/test_docs.py::test_a_probe_file_and_a_request",
    ("your-model.md", "Your own training loop", 0): "tests/test_docs.py::test_your_own_training_loop",
    ("your-model.md", "The Accumulator's parts", 0): "tests/test_docs.py::test_the_accumulators_parts",
    ("noise-scale-and-ramp.md", "In your own loop", 0): "tests/integrations/test_readme_ramp.py::test_your_own_loop",
    ("noise-scale-and-ramp.md", "Lightning", 0): "tests/integrations/test_readme_ramp.py::test_lightning",
    ("integrations.md", "Hugging Face Trainer", 0): "tests/integrations/test_readme.py::test_hugging_face",
    ("integrations.md", "Lightning", 0): "tests/integrations/test_readme.py::test_lightning",
    ("integrations.md", "Lightning", 1): "tests/integrations/test_readme.py::test_lightning",
    ("integrations.md", "Accelerate", 0): "tests/integrations/test_readme.py::test_accelerate",
    ("integrations.md", "A model you already have", 0):
        "tests/integrations/test_readme.py::test_a_model_you_already_have",
}


def path(page: str) -> Path:
    return ROOT / page if page == "README.md" else DOCS / page


def pages() -> list[str]:
    """README.md and every page under docs/."""
    return ["README.md"] + sorted(p.name for p in DOCS.glob("*.md"))


def sections(page: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """Each heading of the page (without its #s) with the code blocks right under it, as (language, code)."""
    out: list[tuple[str, list[tuple[str, str]]]] = [("", [])]
    fence: str | None = None
    code: list[str] = []
    for line in path(page).read_text().splitlines():
        if fence is None and line.startswith("```"):
            fence, code = line[3:].strip(), []
        elif fence is not None and line == "```":
            out[-1][1].append((fence, "".join(c + "\n" for c in code)))
            fence = None
        elif fence is not None:
            code.append(line)
        elif re.match(r"#{1,6} ", line):
            out.append((line.lstrip("#").strip(), []))
    return out


def blocks(page: str, heading: str, lang: str = "python") -> list[str]:
    """The code blocks in ``lang`` right under ``heading`` on the page (the heading must be there, once)."""
    found = [b for h, b in sections(page) if h == heading]
    assert len(found) == 1, f"{page}: {len(found)} headings {heading!r}"
    return [code for language, code in found[0] if language == lang]


def run(code: str, namespace: dict, page: str) -> dict:
    """Runs one block as written in ``namespace``; its tracebacks name the page. A keyword of autotune's that is
    deprecated fails the block: the pages show what the release takes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", r"Accumulator\(.*\) is deprecated", DeprecationWarning)
        exec(compile(code, str(path(page)), "exec"), namespace)
    return namespace
