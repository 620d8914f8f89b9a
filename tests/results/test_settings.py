"""Each setting is declared once (autotune/results/settings.py): the command line's flags, the API's keywords and
the service's body show the same settings under the same names, and a setting declared once appears on all."""

from __future__ import annotations

import argparse
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import autotune
from autotune import api, options
from autotune.cli import build_parser
from autotune.results import settings
from autotune.results.settings import FRONT_END_ONLY, MODEL_SETTINGS, SURFACES, Setting, flag_of, settings_of
from autotune.serve import bodies

VERBS = {"plan": autotune.plan, "probe": autotune.probe}


def subparser(verb: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[verb]


def cli_names(verb: str) -> set[str]:
    """The settings a subcommand's flags hold: every flag's name, less the front end's own and a model's settings
    (nested under ``model`` on the API and the service)."""
    names = {a.dest for a in subparser(verb)._actions}
    return names - FRONT_END_ONLY["cli"] - (set(MODEL_SETTINGS) - declared(verb, "cli"))


def api_names(function: Callable[..., Any]) -> set[str]:
    params = inspect.signature(function).parameters
    old = {n for s in settings.SETTINGS for n in s.old_names}
    return set(params) - FRONT_END_ONLY["api"] - old


def service_names(body: type[Any] = bodies.PlanRequest) -> set[str]:
    return set(body.model_json_schema()["properties"]) - FRONT_END_ONLY["service"]


def declared(verb: str, surface: str) -> set[str]:
    return {s.name for s in settings_of(verb, surface)}


def test_the_plan_surfaces_hold_the_declared_settings_under_the_same_names() -> None:
    cli, api_, service = cli_names("plan"), api_names(autotune.plan), service_names()
    assert cli == declared("plan", "cli")
    assert api_ == declared("plan", "api")
    assert service == declared("plan", "service")
    everywhere = {s.name for s in settings_of("plan", "cli") if s.surfaces == set(SURFACES)}
    assert everywhere <= cli & api_ & service
    assert "probe" in everywhere and "uniform" in everywhere and "uniform_ranks" in everywhere
    assert "workload" not in cli | api_ | service and "split" not in cli | api_ | service


def test_the_probe_surfaces_hold_the_declared_settings() -> None:
    assert cli_names("probe") == declared("probe", "cli")
    assert api_names(autotune.probe) == declared("probe", "api")


def test_the_request_checks_take_the_keywords_the_api_takes() -> None:
    from autotune.planning.requests import plan_request, probe_request

    environment = {"env", "group"}  # where the world size is read: not settings
    before = {"target_tokens", "lengths", "cut_samples", "model"}  # autotune.plan turns them into a target and a probe
    assert set(inspect.signature(plan_request).parameters) - environment == declared("plan", "api") - before
    assert set(inspect.signature(probe_request).parameters) - environment == \
        declared("probe", "api") - {"memory_snapshot", "at", "model"}


def test_memory_snapshot_and_run_say_each_setting_as_plan_and_probe_do() -> None:
    assert api_names(autotune.memory_snapshot) - {"path"} <= declared("probe", "api")
    trains = {"plan", "steps", "verify", "max_norm", "ramp"}  # run's own: how it trains
    assert api_names(autotune.run) - trains <= declared("plan", "api")
    assert {"probe", "device", "uniform", "uniform_ranks", "precision"} <= api_names(autotune.run)


def test_a_model_s_settings_are_declared_once_for_its_flags_body_and_spec() -> None:
    import dataclasses

    from autotune.results.model import ModelSpec
    from autotune.serve.models import ModelBody

    flags = {a.dest: a for a in subparser("plan")._actions}
    for s in settings.MODEL:
        assert flags[s.name].option_strings == [flag_of(s.name)] and flags[s.name].help == s.help
    assert set(ModelBody.model_fields) == {"name"} | {s.name for s in settings_of("model", "service", settings.MODEL)}
    assert {"lengths", "padding"}.isdisjoint(ModelBody.model_fields)  # declared off the service, with the reason
    assert set(MODEL_SETTINGS) <= {f.name for f in dataclasses.fields(ModelSpec)}
    seq_len = ModelBody.model_json_schema()["properties"]["seq_len"]
    assert seq_len["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 1 << 20}


def test_a_surface_that_does_not_show_a_setting_says_why() -> None:
    for s in settings.SETTINGS:
        assert all(why.strip() for why in s.not_on.values()), s.name
        assert s.surfaces, s.name
    assert "service" in settings.setting("memory_snapshot").not_on
    assert "cli" in settings.setting("precision").not_on


@pytest.mark.parametrize("verb", ["plan", "probe"])
def test_every_flag_is_made_from_its_declaration(verb: str) -> None:
    actions = {a.dest: a for a in subparser(verb)._actions}
    for s in settings_of(verb, "cli"):
        if "cli" in s.by_hand:
            continue
        action = actions[s.name]
        assert action.option_strings == [flag_of(s.name)]
        assert action.help == s.flag.get("help", s.help)
        assert action.default == s.flag.get("default", s.default), s.name
        if s.choices and "action" not in s.flag:
            assert tuple(action.choices or ()) == s.choices


@pytest.mark.parametrize("verb", ["plan", "probe"])
def test_the_api_defaults_are_the_declared_ones(verb: str) -> None:
    params = inspect.signature(VERBS[verb]).parameters
    for s in settings_of(verb, "api"):
        if "api" in s.by_hand or s.required:
            continue
        assert params[s.name].default == s.default, s.name


def test_the_service_body_takes_its_bounds_and_defaults_from_the_declarations() -> None:
    schema = bodies.PlanRequest.model_json_schema()
    props = schema["properties"]
    assert schema["required"] == ["target_batch"]
    assert props["target_batch"]["maximum"] == options.MAX_TARGET_BATCH
    assert props["margin"]["default"] == options.MARGIN and props["margin"]["exclusiveMaximum"] == 1
    assert props["parallel"]["enum"] == list(options.PARALLEL)
    assert props["uniform_ranks"]["default"] is False
    assert props["probe"]["default"] == options.DEFAULT_PROBE  # the service's own default, declared
    body = bodies.PlanRequest(target_batch=96, device="estimate:A100-80GB,estimate:T4-16GB", uniform_ranks=True)
    assert body.asked().uniform_ranks is True


def test_the_flag_of_a_field() -> None:
    assert flag_of("memory_budget") == "--memory-budget"
    assert flag_of("target_batch") == "--target-batch"


@pytest.fixture
def a_new_setting(monkeypatch: pytest.MonkeyPatch) -> Setting:
    """One more plan setting, declared once."""
    knob = Setting(name="my_knob", type=int, default=3, least=1, most=9, check=options.whole, metavar="K",
                   verbs=settings.PLAN, help="a knob of the plan")
    monkeypatch.setattr(settings, "SETTINGS", (*settings.SETTINGS, knob))
    return knob


def test_a_setting_declared_once_shows_on_every_surface(a_new_setting: Setting) -> None:
    flags = subparser("plan")
    assert flags.parse_args(["--target-batch", "8", "--my-knob", "5"]).my_knob == 5
    assert flags.parse_args(["--target-batch", "8"]).my_knob == 3
    assert "my_knob" in cli_names("plan")

    body = bodies.plan_body()
    field = body.model_json_schema()["properties"]["my_knob"]
    assert (field["default"], field["minimum"], field["maximum"]) == (3, 1, 9)
    assert field["description"] == "a knob of the plan"
    assert body(target_batch=8, my_knob=4).my_knob == 4  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="my_knob"):
        body(target_batch=8, my_knob=10)

    # The API's keywords are typed by hand: the declaration names the keyword autotune.plan must now take.
    assert declared("plan", "api") - api_names(autotune.plan) == {"my_knob"}


def test_workload_is_the_api_s_former_name_for_probe() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert api.renamed(None, "mlp", "plan") == "mlp"
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "plan(probe=...)" in str(caught[0].message)
    with pytest.raises(ValueError, match="probe and workload"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api.renamed("gpt", "mlp", "plan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.renamed("gpt", None, "plan") == "gpt"


@pytest.mark.parametrize(("verb", "stage"), [("plan", "plan_for"), ("probe", "probe_for")])
def test_workload_asks_what_probe_asks(verb: str, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, stage, lambda request, **_: request)  # the request each makes, not its work
    first = (16,) if verb == "plan" else ()
    asked = {"device": "cpu", "memory_budget": "64MiB"}
    with pytest.warns(DeprecationWarning, match="workload= is accepted until the next release"):
        old = VERBS[verb](*first, workload="mlp", **asked)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = VERBS[verb](*first, probe="mlp", **asked)
    assert old == new and "mlp" in str(new)
