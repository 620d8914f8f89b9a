"""The library's own habits, held over every module: short functions, and broad excepts that are few and say why."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
MAX_FUNCTION_LINES = 60
MAX_BROAD_EXCEPTS = 10
BROAD = {"Exception", "BaseException"}


def long_functions(source: str, where: str) -> list[str]:
    """``where:name (N lines)`` for each function or method of ``source`` over :data:`MAX_FUNCTION_LINES`."""
    return [f"{where}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def broad_excepts(source: str, where: str) -> list[tuple[str, bool]]:
    """``(where:line, says why)`` for each bare ``except:`` or ``except Exception``/``BaseException`` (alone or
    in a tuple) of ``source``; it says why when a comment ends its line."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler):
            continue
        caught = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        if node.type is None or any(isinstance(c, ast.Name) and c.id in BROAD for c in caught):
            found.append((f"{where}:{node.lineno}", "#" in lines[node.lineno - 1]))
    return found


def _modules() -> list[tuple[str, str]]:
    return [(path.read_text(), str(path.relative_to(PACKAGE.parent))) for path in sorted(PACKAGE.rglob("*.py"))]


def test_no_function_is_over_60_lines():
    assert [f for source, where in _modules() for f in long_functions(source, where)] == []


def test_only_the_public_api_defines_a_function_named_probe():
    """``autotune.probe`` is the verb; the store's cache around the search and the search have names of their own
    (``probe_through_store``, ``find_max_micro_batch``), so a reader of the main path knows which one runs."""
    defined = [where for source, where in _modules() for node in ast.parse(source).body
               if isinstance(node, ast.FunctionDef) and node.name == "probe"]
    assert defined == ["autotune/api.py"]


def test_at_most_ten_broad_excepts_and_each_says_why():
    found = [e for source, where in _modules() for e in broad_excepts(source, where)]
    assert len(found) <= MAX_BROAD_EXCEPTS, found
    assert [where for where, says_why in found if not says_why] == []


def test_the_checks_see_a_long_function_and_a_broad_except_without_a_reason():
    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    source = function("long", MAX_FUNCTION_LINES + 1) + function("short", MAX_FUNCTION_LINES)
    assert long_functions(source, "m.py") == [f"m.py:long ({MAX_FUNCTION_LINES + 1} lines)"]
    source = textwrap.dedent("""\
        try:
            pass
        except BaseException:
            raise
        try:
            pass
        except (OSError, Exception):  # the user's code: anything
            pass
        try:
            pass
        except:
            pass
        try:
            pass
        except OSError:
            pass
        """)
    assert broad_excepts(source, "m.py") == [("m.py:3", False), ("m.py:7", True), ("m.py:11", False)]
