"""The suite's own habits: a test slow enough for the ``slow`` set and not in it is named at the end of the run;
CI runs the tests as README.md says to."""

from __future__ import annotations

import re
from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py").read_text()


def test_an_unmarked_slow_test_is_named_in_the_summary(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the plugins this environment has play no part
    assert "SLOW_SECONDS = 2.0" in CONFTEST
    pytester.makeconftest(CONFTEST.replace("SLOW_SECONDS = 2.0", "SLOW_SECONDS = 0.1"))
    pytester.makepyfile(test_timing="""
        import time
        import pytest

        def test_quick():
            pass

        def test_unmarked_and_slow():
            time.sleep(0.15)

        @pytest.mark.slow
        def test_marked_and_slow():
            time.sleep(0.15)
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert "tests over 0.1 s without the slow marker" in out
    named = [line for line in out.splitlines() if " s  test_timing.py::" in line]
    assert len(named) == 1 and named[0].endswith("test_timing.py::test_unmarked_and_slow")


def test_ci_runs_exactly_the_readmes_test_command():
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    quick_start = re.search(r'pip install -e "\.\[test\]" && (python -m pytest[^\n]*)\n', readme)
    assert quick_start is not None
    ci = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("python -m pytest")]
    assert ci == [quick_start.group(1)]
