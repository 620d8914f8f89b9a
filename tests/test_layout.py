"""The package's shape: stages import only what lies below them, and the planner stays pure arithmetic."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

#: Lower layers first: a module may import from its own layer and the layers below, never above.
LAYERS = [
    {"errors", "units", "options", "log", "serial", "dburl", "lazy", "compat", "version"},
    {"results"},
    {"planning"},
    {"workload"},
    {"devices"},
    {"probing"},
    {"training"},
    {"report"},
    {"store"},
    {"integrations", "api"},
    {"cli", "serve", "__main__", "__init__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _part(module: str) -> str:
    """The top-level part of ``autotune.<part>...`` a module belongs to."""
    return module.split(".")[1] if module.count(".") else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # each file parsed once for the tests that read it
def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute autotune module) of every import in ``path``, lazy ones included."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "autotune" or target.startswith("autotune."):
                for alias in node.names:  # "from . import options" imports a module
                    full = f"{target}.{alias.name}"
                    found.append((node.lineno, full if (PACKAGE.parent / (full.replace(".", "/") + ".py")).exists()
                                  or (PACKAGE.parent / full.replace(".", "/")).is_dir() else target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("autotune.")]
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and not p.name.startswith("_")}
    assert parts - set(RANK) == set(), "give these a layer in LAYERS"


def test_no_stage_imports_a_stage_above_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _part(_module_name(path))
        for line, target in _imports(path):
            there = _part(target)
            if target == "autotune":  # the package root: its version, its lazy names
                continue
            if there != here and RANK.get(there, 99) > RANK[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports {target} ({there})")
    assert wrong == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "autotune"
    (fake / "planning").mkdir(parents=True)
    (fake / "planning" / "planner.py").write_text("from ..training import runner\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    imports = _imports(fake / "planning" / "planner.py")
    assert [(t, RANK[_part(t)] > RANK["planning"]) for _, t in imports] == [("autotune.training", True)]


def _circles(package: Path, within: str = "") -> list[list[str]]:
    """The import circles among the modules of ``autotune.<within>`` (the whole package by default; lazy and
    type-checking imports count, and the package root's lazy names too): each group of modules that reach one
    another through imports (a strongly connected component of more than one module), sorted."""
    modules = {_module_name(p): p for p in (package / within).rglob("*.py")}
    graph = {m: sorted({t for _, t in _imports(p) if t in modules and t != m}) for m, p in modules.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for start in sorted(graph):
        if start not in order:
            visit(start)
    return sorted(circles)


def test_no_import_circles():
    assert _circles(PACKAGE) == []


def test_the_check_catches_an_import_circle(tmp_path, monkeypatch):
    fake = tmp_path / "autotune"
    (fake / "devices").mkdir(parents=True)
    (fake / "devices" / "base.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from .estimate import EstimateDevice\n")
    (fake / "devices" / "estimate.py").write_text("def f():\n    from .base import Session\n")
    (fake / "devices" / "cpu.py").write_text("from .base import Session\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _circles(fake, "devices") == [["autotune.devices.base", "autotune.devices.estimate"]]


def test_the_check_catches_a_circle_through_the_package_roots_lazy_names(tmp_path, monkeypatch):
    fake = tmp_path / "autotune"
    (fake / "report").mkdir(parents=True)
    (fake / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from .report import write_report\n")
    (fake / "report" / "__init__.py").write_text("from .content import build\n")
    (fake / "report" / "content.py").write_text("def build():\n    from .. import __version__\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _circles(fake) == [["autotune", "autotune.report", "autotune.report.content"]]


@pytest.mark.slow
def test_the_builtin_probes_install_inside_the_package(tmp_path):
    # Found, not imported: where the files install is the point, not torch's import.
    code = ("import importlib.util\n"
            "assert importlib.util.find_spec('autotune.probes.mlp') is not None, 'autotune.probes.mlp is missing'\n"
            "assert importlib.util.find_spec('probes') is None, 'a top-level probes module is installed'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_every_package_is_listed_for_installation():
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")} | {"autotune.probes"}
    assert found == listed


def test_every_package_says_what_it_owns_and_what_it_may_import():
    quiet = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = " ".join((ast.get_docstring(ast.parse(init.read_text())) or "").split())
        if "Owns: " not in doc or "May import: " not in doc:
            quiet.append(init.parent.name)
    assert quiet == [], "their __init__ docstrings need an 'Owns: ...' and a 'May import: ...'"


TESTS = Path(__file__).parent
#: The test modules that stay at the top of tests/: each tests the package as a whole, or a module at its root
#: (autotune/<name>.py), not one stage.
WHOLE_PACKAGE = {"test_api", "test_compat", "test_docs", "test_errors", "test_imports", "test_layout",
                 "test_random_state", "test_source_habits", "test_suite_habits", "test_units", "test_walk"}


def _misplaced(tests: Path, package: Path) -> list[str]:
    """Test modules outside the folder of a stage: a test module at the top of ``tests`` that is not in
    WHOLE_PACKAGE, one in a folder that no stage of ``package`` is named after, or one in a folder that is not a
    package (no ``__init__.py``: its module names would clash with those of another folder)."""
    stages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    wrong = []
    for path in sorted(tests.rglob("test_*.py")):
        folders = path.relative_to(tests).parts[:-1]
        if not folders:
            placed = path.stem in WHOLE_PACKAGE
        else:
            placed = len(folders) == 1 and folders[0] in stages and (path.parent / "__init__.py").exists()
        if not placed:
            wrong.append(str(path.relative_to(tests)))
    return wrong


def test_each_test_module_lives_in_the_folder_of_the_stage_it_tests():
    assert _misplaced(TESTS, PACKAGE) == [], "move them into tests/<stage>/ (git mv), or say why one tests the whole"


def test_the_check_catches_a_test_module_out_of_its_stages_folder(tmp_path):
    package, tests = tmp_path / "autotune", tmp_path / "tests"
    for folder in (package / "planning", package / "probing", tests / "planning", tests / "probing", tests / "misc"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
    (package / "planning" / "planner.py").write_text("")
    (tests / "probing" / "__init__.py").unlink()
    for name in ("test_api.py", "test_planner.py", "planning/test_ramp.py", "probing/test_probe.py",
                 "misc/test_search.py", "planning/data/test_old.py", "planning/helpers.py"):
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text("")
    assert _misplaced(tests, package) == ["misc/test_search.py", "planning/data/test_old.py",
                                          "probing/test_probe.py", "test_planner.py"]
