"""The path the workload takes from ``autotune.plan`` to the plan stays short: at most 20 stays and 3 climbs
back up, with and without a plan store (bench/walk.py's tracer and figures, run here in-process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import autotune
from autotune import api
from autotune.results.request import ProbeRequest
from autotune.store import cached

BENCH = Path(__file__).resolve().parents[1] / "bench" / "walk.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_walk", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


walk = _load()


@pytest.fixture(scope="module")
def rank():
    """The layers; and one plan untraced first, so that imports are done (the first test to ask pays that)."""
    autotune.plan(walk.TARGET, probe=walk.PROBE, device="estimate", memory_budget=walk.BUDGETS["estimate"],
                  store=False)
    return walk.layers()


def _walks(rank, folder):
    """(label, figures) of the estimate's three scenarios: no store, a cold store, a warm one."""
    return [(label, walk.figures(walk.walk(run)[0], rank)) for label, run in walk.scenarios("estimate", folder)]


def test_the_layers_come_from_the_imports(rank, tmp_path, monkeypatch):
    assert rank["results"] < rank["planning"] < rank["probing"] < rank["store"] < rank["api"] < rank["cli"] \
        < rank["__init__"]
    assert rank["workload"] < rank["devices"] < rank["probing"] < rank["training"] < rank["store"]
    fake = tmp_path / "autotune"
    for part, text in (("store", "from ..api import plan\n"), ("api", "from ..store import Store\n")):
        (fake / part).mkdir(parents=True)
        (fake / part / "__init__.py").write_text(text)
    (fake / "__init__.py").write_text("")
    monkeypatch.setattr(walk, "PACKAGE", fake)
    with pytest.raises(ValueError, match="import each other"):
        walk.layers()


def test_the_workload_walks_a_short_path_with_and_without_a_store(rank, tmp_path):
    walks = _walks(rank, tmp_path)
    for label, got in walks:
        assert got.stays <= walk.MAX_STAYS and got.climbs <= walk.MAX_CLIMBS, \
            f"{label}: {got.stays} stays, {got.climbs} climbs: {walk.shown(got.path)}"
    # the walk is the store's: the probe entered once, through the store's get, claim and put
    cold = dict(walks)["estimate, cold store"]
    stored = {f for file, functions, _ in cold.path if file == "store/store.py" for f in functions}
    assert {"get", "claim", "put"} <= stored, walk.shown(cold.path)
    assert [file for file, _, _ in cold.path].count("probing/finder.py") == 1, walk.shown(cold.path)


@pytest.mark.slow
def test_a_needless_round_trip_is_caught(rank, tmp_path, monkeypatch):
    """Planted: each look in the store climbs back to the API to resolve the workload again, then reads the
    store once more (three times): more stays and climbs than the acceptance allows."""
    real = cached._answer

    def detour(store, digest, workload, device, **kwargs):
        for _ in range(3):
            api.resolve(ProbeRequest(), api.GivenObjects(workload, device))  # store -> api: a climb back up
            store.get(digest)
        return real(store, digest, workload, device, **kwargs)

    monkeypatch.setattr(cached, "_answer", detour)
    walks = dict(_walks(rank, tmp_path))
    assert walks["estimate, no store"].ok  # no store, no detour
    cold, warm = walks["estimate, cold store"], walks["estimate, warm store"]
    assert cold.stays > walk.MAX_STAYS and cold.climbs > walk.MAX_CLIMBS, walk.shown(cold.path)
    assert not warm.ok and warm.climbs == 4, walk.shown(warm.path)


def test_the_figures_of_a_walk():
    rank = {"api": 3, "store": 2, "probing": 1, "results": 0}
    Call = walk.Call
    calls = [Call("api.py", "plan", None), Call("api.py", "probe", "api.py"),
             Call("store/cached.py", "probe_through_store", "api.py"),
             Call("probing/finder.py", "find_max_micro_batch", "store/cached.py"),
             Call("store/cached.py", "kept", "probing/finder.py"),  # a callback: probing -> store, a climb
             Call("api.py", "explain", "api.py"), Call("results/plan.py", "of", "api.py")]
    got = walk.figures(calls, rank)
    assert (got.calls, got.stays, got.files, got.climbs, got.returns, got.ups) == (7, 6, 4, 1, 2, 2)
    assert walk.shown(got.path) == ("api.py(plan, probe) > store/cached.py(probe_through_store) > "
                                    "probing/finder.py(find_max_micro_batch) > "
                                    "^store/cached.py*(kept) > api.py*(explain) > results/plan.py(of)")


@pytest.mark.slow
def test_the_walk_through_a_confirm_run_on_a_real_device_is_as_short(rank, tmp_path):
    """On the cpu a stored answer is confirmed by one real run first (and the run is recorded)."""
    for label, run in walk.scenarios("cpu", tmp_path):
        got = walk.figures(walk.walk(run)[0], rank)
        assert got.ok, f"{label}: {got.stays} stays, {got.climbs} climbs: {walk.shown(got.path)}"
    assert "_confirm_run" in walk.shown(got.path)
