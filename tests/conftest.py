"""Shared fixtures. Tests run on the CPU; real-GPU tests carry the ``gpu`` marker.

torch is imported where tests run, never at this module's import: under xdist the
controlling process loads this file too, and runs no test.
"""

from __future__ import annotations

import gc
import os

import pytest


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent under -p no:xdist
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core and one more. Part of the suite waits on other processes (a service, its
    workers, torchrun ranks, PostgreSQL) or on a timeout it checks; the extra worker runs tests meanwhile, so the
    cores stay busy (on 2 cores, 3 workers finish the suite ~5% sooner than 2)."""
    return len(os.sched_getaffinity(0)) + 1


def _has_gpu() -> bool:
    import torch

    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds folder names too
            item.add_marker(skip)


def _longest_files_first(items: list) -> None:
    """Test files in the order of their count of ``slow`` tests, most first (ties: more tests first), each file's
    tests in their own order. xdist hands the files (``--dist loadfile --no-loadscope-reorder``) to the workers in
    this order, so the long files start early and the run ends on short ones, not on one worker alone."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    slow = {path: sum(item.get_closest_marker("slow") is not None for item in tests) for path, tests in files.items()}
    order = sorted(files, key=lambda path: (-slow[path], -len(files[path])))
    items[:] = [item for path in order for item in files[path]]


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for this test process (tests/postgres.py), or the tests that need one skipped
    with the reason."""
    from .postgres import Server, Unavailable

    try:
        server = Server.start()
    except Unavailable as exc:
        pytest.skip(f"needs a PostgreSQL server: {exc}")
    yield server
    server.stop()


#: The databases every store and service test runs on.
DATABASES = ("sqlite", "postgresql")


@pytest.fixture(params=DATABASES)
def store_url(request, tmp_path):
    """A new plan store's URL, on each database: an SQLite file in the test's folder, and a fresh
    PostgreSQL database (dropped after the test)."""
    yield from _new_store(request, tmp_path)


@pytest.fixture(scope="module", params=DATABASES)
def module_store_url(request, tmp_path_factory):
    """:func:`store_url` for a whole test file (a server the file's tests share)."""
    yield from _new_store(request, tmp_path_factory.mktemp("store"))


def _new_store(request, folder):
    if request.param == "sqlite":
        yield f"sqlite:///{folder / 'plans.db'}"
        return
    only = request.node.get_closest_marker("sqlite_only")
    if only is not None:
        pytest.skip(f"SQLite only: {only.args[0]}")
    server = request.getfixturevalue("postgres")
    url = server.database()
    yield url
    server.drop(url)


@pytest.fixture
def mlp():
    from autotune.workload import load_workload

    return load_workload("mlp")


@pytest.fixture
def gpt():
    from autotune.workload import load_workload

    return load_workload("gpt")


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    # The suite runs many tiny training steps: one intra-op thread avoids OpenMP
    # oversubscription (and its spin-waits) on small or shared machines.
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    # What collection imports (torch, transformers, lightning, ...) lives as long as the run: made with the
    # cyclic garbage collector paused, then kept out of it (as autotune's commands do), so that a full
    # collection (autotune's cleanup after a run, the tests' own) walks only what the tests made.
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()
        _freeze_survivors()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # The same after each test file, once its module fixtures are gone: what its tests imported (pandas,
    # matplotlib, the probes, ...) and what survives them. A test's own objects are never frozen before it
    # ends, so the tests that watch them be freed (weak references, ``gc.get_objects()``) see them as the
    # collector does.
    result = yield
    if nextitem is None or nextitem.path != item.path:
        _freeze_survivors()
    return result


def _freeze_survivors() -> None:
    gc.collect()
    gc.freeze()


#: A test that takes longer than this (setup, call and teardown together) belongs in the ``slow`` set.
SLOW_SECONDS = 2.0
_durations: dict[str, float] = {}
_unmarked: set[str] = set()


def pytest_runtest_logreport(report):
    # Under xdist the controller sees every worker's reports, so the summary covers the whole run.
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if "slow" not in report.keywords:
        _unmarked.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    over = sorted(((s, n) for n, s in _durations.items() if n in _unmarked and s > SLOW_SECONDS), reverse=True)
    if over:
        terminalreporter.section(f"tests over {SLOW_SECONDS:g} s without the slow marker")
        for seconds, nodeid in over:
            terminalreporter.line(f"{seconds:6.2f} s  {nodeid}")
        terminalreporter.line("mark them @pytest.mark.slow (or make them faster): `-m \"not slow\"` is the inner loop")
