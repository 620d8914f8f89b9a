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
from autotune.errors import BadInput
from autotune.results import settings
from autotune.results.request import PlanRequest, ProbeRequest
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


def typed_names(function: Callable[..., Any]) -> set[str]:
    """The keywords an API function types by hand that are settings (less its front end's own and former names)."""
    params = inspect.signature(function).parameters
    old = {n for s in settings.SETTINGS for n in s.old_names}
    return {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD} - FRONT_END_ONLY["api"] - old


def api_names(function: Callable[..., Any]) -> set[str]:
    """The settings an API function takes: those it types by hand and, where it catches other keywords (plan,
    probe), every other setting its verb shows on the API (checked there against the declarations)."""
    caught = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(function).parameters.values())
    return typed_names(function) | (declared(function.__name__, "api") if caught else set())


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
def test_the_keywords_typed_by_hand_are_declared_settings_with_their_declared_defaults(verb: str) -> None:
    """The typed part of the API cannot drift from the declarations: each keyword typed by hand is a setting the
    verb shows on the API, its default the declared one; every other declared setting is caught by ``settings``."""
    params = inspect.signature(VERBS[verb]).parameters
    typed = typed_names(VERBS[verb])
    assert typed <= declared(verb, "api"), typed - declared(verb, "api")
    assert [p.name for p in params.values() if p.kind is p.VAR_KEYWORD] == ["settings"]
    for s in settings_of(verb, "api"):
        if s.name in typed and "api" not in s.by_hand and not s.required:
            assert params[s.name].default == s.default, s.name
    assert {"probe", "device", "memory_budget", "margin", "world_size", "parallel"} <= typed  # people use them


@pytest.mark.parametrize(("call", "unknown", "closest"), [
    (lambda: autotune.plan(8, probe="mlp", memory_budgt="8MiB"), "memory_budgt", "memory_budget"),
    (lambda: autotune.probe("mlp", max_bach=4), "max_bach", "max_batch"),
    (lambda: autotune.plan(8, max_batch=4), "max_batch", None),  # a probe's setting, not a plan's
])
def test_a_keyword_that_is_no_declared_setting_is_a_type_error_naming_the_closest(
        call: Callable[[], Any], unknown: str, closest: str | None) -> None:
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{unknown}'") as raised:
        call()
    if closest is not None:
        assert str(raised.value).endswith(f"did you mean '{closest}'?")


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
    """One more plan setting, declared once: here, and nowhere else."""
    knob = Setting(name="my_knob", type=int, default=3, least=1, most=9, check=options.whole, metavar="K",
                   verbs=settings.PLAN, help="a knob of the plan")
    monkeypatch.setattr(settings, "SETTINGS", (*settings.SETTINGS, knob))
    return knob


def asked_of(plan: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, **keywords: Any) -> dict[str, Any]:
    """The keywords ``plan`` hands on to the plan request it builds (:func:`autotune.planning.requests.plan_request`,
    where a setting's logic takes it), the request's work left out."""
    asked: dict[str, Any] = {}
    monkeypatch.setattr(api, "plan_request", lambda target_batch, **given: asked.update(given))
    monkeypatch.setattr(api, "plan_for", lambda request, **_: request)
    plan(8, **keywords)
    return asked


def on_every_surface(knob: Setting, value: Any, monkeypatch: pytest.MonkeyPatch,
                     plan: Callable[..., Any] = autotune.plan) -> None:
    """``knob`` is a flag of ``autotune plan``, a field of the service's body and a keyword of ``plan`` (the API),
    each taking ``value`` and defaulting as declared."""
    flags = subparser("plan")
    assert flags.parse_args(["--target-batch", "8", flag_of(knob.name), str(value)]).my_knob == value
    assert flags.parse_args(["--target-batch", "8"]).my_knob == knob.default
    body = bodies.plan_body()
    assert body(target_batch=8, **{knob.name: value}).model_dump()[knob.name] == value
    assert body(target_batch=8).model_dump()[knob.name] == knob.default
    try:
        asked = asked_of(plan, monkeypatch, **{knob.name: value})
    except TypeError as exc:
        raise AssertionError(f"{knob.name} does not reach autotune.plan: {exc}") from None
    assert asked.get(knob.name) == value, f"{knob.name} does not reach autotune.plan's request: {asked}"


def test_a_setting_declared_once_shows_on_every_surface(a_new_setting: Setting,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    on_every_surface(a_new_setting, 5, monkeypatch)
    assert {"my_knob"} <= cli_names("plan") & declared("plan", "api") & service_names(bodies.plan_body())

    field = bodies.plan_body().model_json_schema()["properties"]["my_knob"]
    assert (field["default"], field["minimum"], field["maximum"]) == (3, 1, 9)
    assert field["description"] == "a knob of the plan"
    with pytest.raises(ValueError, match="my_knob"):
        bodies.plan_body()(target_batch=8, my_knob=10)

    # The API checks it as declared: its check, its bounds; a near miss names it.
    for bad, limit in ((10, 9), (0, 1)):
        with pytest.raises(BadInput) as refused:
            asked_of(autotune.plan, monkeypatch, my_knob=bad)
        assert (refused.value.field, refused.value.value, refused.value.limit) == ("my_knob", bad, limit)
    with pytest.raises(TypeError, match="'my_knb'; did you mean 'my_knob'"):
        asked_of(autotune.plan, monkeypatch, my_knb=5)
    with pytest.raises(BadInput, match="PlanRequest and also my_knob"):
        autotune.plan(PlanRequest(target_batch=8, probe=ProbeRequest(workload="mlp")), my_knob=5)


def plan_typed_by_hand(target_batch: int, *, probe: str | None = None) -> Any:
    """``autotune.plan`` as its keywords were: each typed by hand, a new setting among them only once someone adds
    it there."""
    return api.plan(target_batch, probe=probe)


def plan_that_drops_it(target_batch: int, **settings: Any) -> Any:
    """``autotune.plan`` catching every keyword and handing none of them on."""
    return api.plan(target_batch)


@pytest.mark.parametrize("planted", [plan_typed_by_hand, plan_that_drops_it])
def test_a_setting_that_does_not_reach_the_api_is_caught(planted: Callable[..., Any], a_new_setting: Setting,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError, match="my_knob does not reach autotune.plan"):
        on_every_surface(a_new_setting, 5, monkeypatch, plan=planted)


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
