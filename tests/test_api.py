"""The public API: every exported name resolves, and submodules never shadow it."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import autotune
from autotune.errors import BadInput


def test_each_public_name_is_the_object_its_stage_documents():
    """``autotune.plan`` is the API's verb, ``autotune.Plan`` the result type, ``autotune.Accumulator`` the training
    loop's: each public name gives the object its stage defines (not a same-named helper of another stage, not a
    copy), the same one on every access."""
    from autotune import api, report, results, training, workload
    from autotune.results import ramp, request

    documented = {
        "probe": api.probe, "plan": api.plan, "run": api.run, "load_plan": api.load_plan,
        "memory_snapshot": api.memory_snapshot, "write_report": report.write_report, "load_result": report.load_result,
        "ProbeRequest": request.ProbeRequest, "PlanRequest": request.PlanRequest, "ProbeResult": results.ProbeResult,
        "Plan": results.Plan, "RunResult": results.RunResult, "Workload": workload.Workload,
        "Accumulator": training.Accumulator, "PlanSampler": training.PlanSampler, "RampConfig": ramp.RampConfig,
    }
    assert sorted(autotune.__all__) == sorted([*documented, "__version__"])
    for name, obj in documented.items():
        assert getattr(autotune, name) is obj and getattr(autotune, name) is obj, name


def test_the_public_surface_is_a_handful_of_verbs_and_types():
    names = [n for n in autotune.__all__ if n != "__version__"]
    assert len(names) <= 16, names
    assert not any(n.endswith("Error") or n == "BadInput" for n in names), "errors live in autotune.errors"


def test_submodules_do_not_shadow_exported_functions():
    for info in pkgutil.walk_packages(autotune.__path__, "autotune."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    for name in ("probe", "plan", "run", "load_plan", "memory_snapshot", "write_report", "load_result"):
        assert callable(getattr(autotune, name)) and not isinstance(getattr(autotune, name), type(autotune)), name


def test_the_api_takes_what_the_command_line_takes():
    plan = autotune.plan(1000, probe="mlp", device="cpu", memory_budget="8MiB")
    assert plan.target_batch == 1000 and plan.probe is not None
    assert plan.probe.capacity_bytes == 8 * 2**20
    result = autotune.probe("mlp", device="cpu", memory_budget="4MB", max_batch=512)
    assert isinstance(result, autotune.ProbeResult) and result.capacity_bytes == 4_000_000


@pytest.mark.parametrize("call,name", [
    (lambda: autotune.plan(1024, probe="mlp", device="cpu", memory_budget="12XB"), "memory_budget"),
    (lambda: autotune.plan(1024, probe="mlp", device="cpu", margin=2), "margin"),
    (lambda: autotune.plan(0, probe="mlp", device="cpu"), "target_batch"),
    (lambda: autotune.plan(1024, probe="mlp", device="cpu", world_size=0), "world_size"),
    (lambda: autotune.plan(1024, probe="mlp", device="cpu", multiple_of="x"), "multiple_of"),
    (lambda: autotune.probe("mlp", device="cpu", max_batch=0), "max_batch"),
    (lambda: autotune.probe(42, device="cpu"), "workload"),
    (lambda: autotune.probe("mlp", device=3.5), "device"),
    (lambda: autotune.run(target_batch=64, probe="mlp", device="cpu", steps=0), "steps"),
    (lambda: autotune.run(target_batch=64, probe="mlp", device="cpu", precision="fp8"), "precision"),
    (lambda: autotune.run(target_batch=64, probe="mlp", device="cpu", max_norm=-1.0), "max_norm"),
    (lambda: autotune.run(probe="mlp", device="cpu"), "target_batch"),
])
def test_bad_arguments_raise_autotunes_error_naming_the_parameter(call, name):
    with pytest.raises(BadInput, match=name):
        call()


def test_a_star_import_gives_exactly_the_public_names():
    namespace: dict = {}
    exec("from autotune import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(autotune.__all__)


@pytest.mark.parametrize("package,table", [("autotune", "_EXPORTS"), ("autotune.devices", "_LAZY"),
                                           ("autotune.store", "_LAZY")])
def test_what_type_checkers_see_is_what_the_lazy_exports_give(package, table):
    """The ``if TYPE_CHECKING:`` imports name each lazy export from the module it is loaded from at run time."""
    import ast
    import importlib
    from pathlib import Path

    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == getattr(module, table)


def test_the_verbs_take_a_request_built_by_hand_as_the_keywords_build_it():
    """docs/your-model.md, "Your own model": a PlanRequest (or ProbeRequest) passed to plan (or probe) plans as the
    keywords that say the same do; an argument the request already holds, given beside it, is refused."""
    from dataclasses import replace

    from autotune import PlanRequest, ProbeRequest

    request = PlanRequest(target_batch=1000, probe=ProbeRequest(workload="mlp", device="cpu", memory_budget=2**23))
    by_request = autotune.plan(request)
    by_keywords = autotune.plan(1000, probe="mlp", device="cpu", memory_budget=2**23)
    assert by_request.schedule == by_keywords.schedule and by_request.micro_batch == by_keywords.micro_batch
    probed = autotune.probe(replace(request.probe, margin=0.5))
    assert probed.margin == 0.5 and probed.max_micro_batch < by_keywords.probe.max_micro_batch
    with pytest.raises(BadInput, match=r"^plan\(\) was given a PlanRequest and also device, margin: a PlanRequest "
                                       r"holds them"):
        autotune.plan(request, device="cpu", margin=0.2)
    snapped = autotune.plan(request, memory_snapshot=True, at=64)
    assert snapped.probe.memory is not None and snapped.probe.memory.batch == 64
    with pytest.raises(BadInput, match=r"^probe\(\) was given a ProbeRequest and also max_batch"):
        autotune.probe(request.probe, max_batch=8)
    with pytest.raises(BadInput, match=r"^plan\(\) takes a PlanRequest, and was given a ProbeRequest: wrap it"):
        autotune.plan(request.probe)
    with pytest.raises(BadInput, match=r"^probe\(\) takes a ProbeRequest, and was given a PlanRequest"):
        autotune.probe(request)
