"""The suite's own habits: a test slow enough for the ``slow`` set and not in it is named at the end of the run;
no test module imports another (what tests share lives in helper modules and fixtures); CI installs and runs the
tests as README.md says to, and again under the oldest torch pyproject.toml declares."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

from . import docs

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py").read_text()


#: A plugin for the inner run: a test marked ``takes(seconds)`` reports that long a call, as a slow test would.
FAKE_CLOCK = """
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "takes(seconds): the call reports this duration")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    takes = item.get_closest_marker("takes")
    if takes is not None and call.when == "call":
        report.duration = takes.args[0]
    return report
"""


def test_a_test_over_two_seconds_without_the_slow_marker_is_named_in_the_summary(pytester, monkeypatch):
    """The suite's own conftest, as it is, on tests that take (by a fake clock) just under, just over, and well
    over the 2 seconds past which a test belongs in the slow set."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the plugins this environment has play no part
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(fake_clock=FAKE_CLOCK, test_timing="""
        import pytest

        @pytest.mark.takes(1.9)
        def test_just_under():
            pass

        @pytest.mark.takes(2.1)
        def test_just_over_and_unmarked():
            pass

        @pytest.mark.slow
        @pytest.mark.takes(30.0)
        def test_well_over_and_marked():
            pass
    """)
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "fake_clock")
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert "tests over 2 s without the slow marker" in out
    named = [line.split() for line in out.splitlines() if " s  test_timing.py::" in line]
    assert len(named) == 1 and named[0][2] == "test_timing.py::test_just_over_and_unmarked", out
    assert 2.1 <= float(named[0][0]) < 2.2


TESTS = Path(__file__).parent
ROOT = TESTS.parent


def _imports_of_test_modules(folder: Path) -> list[str]:
    """``path:line`` of each import, in any module under ``folder``, that names a test module (``test_*``)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [*(node.module or "").split("."), *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [part for a in node.names for part in a.name.split(".")]
            else:
                continue
            if any(name.startswith("test_") for name in names):
                found.append(f"{path.relative_to(folder.parent)}:{node.lineno}")
    return found


def test_no_module_of_the_suite_imports_a_test_module():
    assert _imports_of_test_modules(TESTS) == [], \
        "move what they share into a helper module beside them (fakes.py, ...) or a conftest fixture"


def test_the_check_catches_a_test_module_imported(tmp_path):
    devices = tmp_path / "tests" / "devices"
    devices.mkdir(parents=True)
    (devices / "test_contract.py").write_text("import torch\n\nfrom .test_cuda import FakeCuda\n")
    (devices / "test_cli.py").write_text("def test_x():\n    from tests.devices import test_cuda\n")
    (devices / "worker.py").write_text("import test_noise\n")
    (devices / "test_fine.py").write_text("from .fakes import FakeCuda\nfrom ..helpers import true_max\n")
    assert _imports_of_test_modules(tmp_path / "tests") == [
        "tests/devices/test_cli.py:2", "tests/devices/test_contract.py:3", "tests/devices/worker.py:1"]


def _quick_start() -> list[str]:
    """README.md's Quick start commands, one a code block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n([^\n]+)\n```", section)


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_the_readmes_quick_start_as_written():
    install, test = _quick_start()
    assert install.startswith("python3 -m venv .venv") and "pip install -e . " in install
    assert test.endswith('pip install -e ".[test]" && python -m pytest -q')
    ci = _ci_lines()
    # each command exactly, in order, stopping CI where it fails (set -e does not stop inside an && list)
    assert ci.index(f"{install} || exit") < ci.index(f"{test} || exit")
    # CI installs no torch of its own into the newcomer's environment before the README's commands do
    assert not any("torch" in line for line in ci[:ci.index(f"{install} || exit")] if not line.startswith("#"))
    # every other run of the suite is the README's test command too: the same whole suite
    command = test.rsplit(" && ", 1)[1]
    assert {line for line in ci if line.startswith("python -m pytest")} == {command}


def _release(text: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.split("."))
    return parts + (0,) * (3 - len(parts))


def test_ci_tests_the_oldest_torch_pyproject_declares_and_readme_names_it():
    floor = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    oldest = re.search(r"^OLDEST_TORCH=([0-9.]+)", (ROOT / ".ci" / "run").read_text(), re.M)
    assert floor is not None and oldest is not None
    assert _release(floor.group(1)) == _release(oldest.group(1))
    assert 'python -m pip install -q -e ".[test]" "torch==$OLDEST_TORCH"' in _ci_lines()
    readme = (ROOT / "README.md").read_text()
    assert f"torch {floor.group(1)} or newer" in readme and f"torch {oldest.group(1)} and the newest" in readme


# ---- README.md and docs/: a newcomer's page, links that resolve, every example run ----------------------------------


def test_readme_is_a_newcomers_page_and_the_rest_is_under_docs():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines: move the detail to a page under docs/ and link it"
    nav = set(re.findall(r":\s+(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {p.name for p in docs.DOCS.glob("*.md")}, "mkdocs.yml's nav lists every page under docs/"


def slug(heading: str) -> str:
    """A heading's anchor as GitHub (and MkDocs' toc) makes it."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """Each relative link (or image) of a Markdown page whose file, or heading on that file, is not there."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        where = (page.parent / file).resolve() if file else page
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in {
                slug(h) for h in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", where.read_text(), flags=re.S),
                                           re.M)}:
            broken.append(target)
    return broken


def test_every_relative_link_of_readme_and_docs_resolves():
    found = {page: broken_links(docs.path(page)) for page in docs.pages()}
    assert {page: links for page, links in found.items() if links} == {}


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path):
    assert slug('What "fits" means') == "what-fits-means" and slug("Ranks that differ") == "ranks-that-differ"
    (tmp_path / "a.md").write_text("# A\n\n## Two words\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#two-words) [gone](c.md) [no](a.md#not-a-heading) [here](#b) [web](https://x.org/y)\n"
                    "# B\n")
    assert broken_links(page) == ["c.md", "a.md#not-a-heading"]


def test_every_python_example_of_readme_and_docs_is_run_by_the_test_named_for_it():
    found = {(page, heading, i) for page in docs.pages() for heading, blocks in docs.sections(page)
             for i, _ in enumerate(b for b in blocks if b[0] == "python")}
    assert found - set(docs.RUN_BY) == set(), "name the test that runs each new block in tests/docs.py's RUN_BY"
    assert set(docs.RUN_BY) - found == set(), "RUN_BY names blocks that are no longer there"
    for (page, heading, _), test in docs.RUN_BY.items():
        file, name = test.split("::")
        source = (ROOT / file).read_text()
        # the test exists, and its module reads that page's heading
        assert f"\ndef {name}(" in source and f'"{heading}"' in source and f'"{page}"' in source, test


def shell_commands(page: str) -> list[list[str]]:
    """Each ``autotune`` command in the page's bash and console blocks, as its arguments after ``autotune``."""
    commands = []
    for _, blocks in docs.sections(page):
        for lang, code in blocks:
            if lang not in ("bash", "console"):
                continue
            text = code.replace("\\\n", " ")
            for line in text.splitlines():
                if lang == "console" and not line.startswith("$ "):
                    continue  # what the command printed
                line = line.removeprefix("$ ").split(" # ", 1)[0]
                if line.startswith("#"):
                    continue
                for part in line.split(" && "):
                    words = shlex.split(part)
                    if words[:1] == ["autotune"]:
                        commands.append(words[1:])
                    elif "-m" in words and words[words.index("-m") + 1] == "autotune":  # torchrun, python
                        commands.append(words[words.index("-m") + 2:])
    return commands


def test_every_autotune_command_of_readme_and_docs_parses():
    from autotune.cli import build_parser

    parser = build_parser()
    bad = []
    for page in docs.pages():
        commands = shell_commands(page)
        assert page != "README.md" or len(commands) >= 3
        for argv in commands:
            try:
                parser.parse_args(argv)
            except SystemExit:
                bad.append(f"{page}: autotune {' '.join(argv)}")
    assert bad == []
