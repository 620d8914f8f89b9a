"""The one request a probe and a plan are asked with: checked once when made, the same from the command line,
the API and the service's body, and carried whole to every stage."""

from __future__ import annotations

import pytest

import autotune
from autotune import api
from autotune.cli import main
from autotune.errors import AutotuneError, BadInput, ResultFileError
from autotune.planning.requests import plan_request, probe_request, world_of
from autotune.results.request import FitRule, PlanRequest, ProbeRequest, Snapshot

MLP = ["--probe", "mlp", "--device", "cpu", "--memory-budget", "3MB"]


@pytest.mark.parametrize("fields,words", [
    (dict(world_size=2, rank=2), "rank 2 must be below world_size 2"),
    (dict(parallel="fsdp", world_size=2, buckets=True), "buckets are DDP's"),
    (dict(parallel="zero3"), "parallel 'zero3' must be one of ddp, fsdp"),
    (dict(world_size=0), "world_size 0 must be at least 1"),
    (dict(rank=-1), "rank -1 must be at least 0"),
])
def test_a_fit_rule_that_cannot_be_is_refused_naming_the_field(fields, words):
    with pytest.raises((ValueError, AutotuneError), match=words):
        FitRule(**fields)


@pytest.mark.parametrize("fields,words", [
    (dict(margin=1.0), "margin 1.0 must be a fraction in"),
    (dict(max_batch=0), "max_batch 0 must be at least 1"),
    (dict(memory_budget="lots"), "memory_budget"),
    (dict(precision="fp64"), "precision 'fp64' must be one of"),
    (dict(device=""), "device '' must be a non-empty name"),
])
def test_a_probe_request_checks_each_field_when_made(fields, words):
    with pytest.raises((ValueError, AutotuneError), match=words):
        ProbeRequest(**fields)


def test_a_request_reads_back_from_its_own_json_and_refuses_a_damaged_one():
    request = plan_request(1021, probe="mlp", device="estimate:A100-80GB,estimate:T4-16GB", multiple_of=1,
                           uniform="force", env={})
    again = PlanRequest.from_dict(request.to_dict())
    assert again == request and again.ranks[1].device == "estimate:T4-16GB" and again.uniform == "force"
    damaged = request.to_dict()
    damaged["probe"]["rule"]["rank"] = 5
    with pytest.raises(ResultFileError, match="rank 5 must be below world_size 2"):
        PlanRequest.from_dict(damaged)


@pytest.mark.parametrize("flag,env,group,expected", [
    (None, {}, None, (1, "default")),
    (None, {"WORLD_SIZE": "4"}, None, (4, "WORLD_SIZE")),
    (2, {"WORLD_SIZE": "4"}, None, (2, "flag")),
    (None, {"WORLD_SIZE": "4"}, (4, 1), (4, "process group")),
])
def test_the_world_size_comes_from_the_group_the_flag_the_environment_in_that_order(flag, env, group, expected):
    assert world_of(flag, env, group) == expected


def test_settings_that_exclude_each_other_are_refused_before_any_probe():
    cases = [
        (dict(storage="sqlite:///t.db"), "storage needs tune=True"),
        (dict(tune=True, parallel="fsdp"), "tuning times one process and cannot shard it"),
        (dict(tune=True, memory_snapshot="m.pickle"), "drop tune or the snapshot"),
        (dict(at=3), "at is where a memory snapshot is taken"),
        (dict(device="cpu,cpu", world_size=3), "world_size 3 but the device or memory_budget list names 2"),
        (dict(uniform="sometimes"), "uniform 'sometimes' must be"),
    ]
    for kwargs, words in cases:
        with pytest.raises(BadInput, match=words):
            plan_request(64, probe="mlp", env={}, **kwargs)


def test_under_a_process_group_each_rank_asks_for_its_own_device_and_shard():
    mine = probe_request("mlp", device="cpu", memory_budget="8MiB,3MiB", parallel="fsdp", group=(2, 1))
    assert mine.memory_budget == 3 * 2**20 and mine.rule == FitRule(parallel="fsdp", world_size=2, rank=1)
    with pytest.raises(BadInput, match="a device or memory_budget per rank"):
        probe_request("mlp", device="cpu", memory_budget="8MiB,3MiB")


def test_the_command_line_asks_what_the_api_asks(monkeypatch, capsys, tmp_path):
    """``autotune plan`` builds its request once, before torch's work, and hands it to the same verb the API
    calls: the request equals the one the API's arguments make."""
    asked = []
    real = api.plan_for
    monkeypatch.setattr(api, "plan_for", lambda request, **kw: asked.append(request) or real(request, **kw))
    assert main(["plan", "--target-batch", "1021", *MLP, "--multiple-of", "1", "--quiet"]) == 0
    autotune.plan(1021, probe="mlp", device="cpu", memory_budget="3MB")
    capsys.readouterr()
    assert len(asked) == 2 and asked[0] == asked[1]
    assert asked[0].probe == ProbeRequest(workload="mlp", device="cpu", memory_budget=3_000_000, max_batch=1021)


def test_a_snapshot_request_checks_its_file_and_size_when_made(tmp_path):
    assert Snapshot.of(None) is None and Snapshot.of(True) == Snapshot()
    assert Snapshot.of(str(tmp_path / "m.pickle"), 8) == Snapshot(path=str(tmp_path / "m.pickle"), at=8)
    with pytest.raises(BadInput, match="at 0 must be at least 1"):
        Snapshot.of(True, 0)
    with pytest.raises(BadInput, match="memory_snapshot"):
        Snapshot.of(str(tmp_path / "no" / "such" / "m.pickle"))


E = dict(probe="mlp", device="estimate:T4-16GB")


@pytest.mark.parametrize("kwargs,words", [
    (dict(target_batch="64"), r"^target_batch '64' is a string, not a whole number: give the number itself, 64$"),
    (dict(target_batch=64, multiple_of="8"), r"^multiple_of '8' is a string"),
    (dict(target_batch=64, margin="0.1"), r"^margin '0\.1' is a string, not a number: give the fraction itself"),
    (dict(target_batch=64, uniform=1), r"^uniform 1 must be True, False, None or 'force'$"),
    (dict(target_batch=1024, device="estimate:T4-16GB,estimate:A100-80GB", uniform_ranks="false"),
     r"^uniform_ranks 'false' must be True or False \(a bool, not str\)$"),
    (dict(target_batch=1024, device="estimate:T4-16GB,estimate:A100-80GB", uniform_ranks=1), r"^uniform_ranks 1 "),
    (dict(target_batch=64, tune="no"), r"^tune 'no' must be True or False"),
    (dict(target_batch=64, memory_budget=1e30), r"^memory_budget 1e\+30 is too large: at most "
                                                 r"1,152,921,504,606,846,976 bytes \(1 EiB\)"),
    (dict(target_batch=64, memory_budget=10**30), r"^memory_budget 10{30} is too large"),
])
def test_plan_refuses_a_value_of_the_wrong_type_when_the_request_is_made(kwargs, words):
    """A2, A5, A7, M31: strings for numbers and anything but a bool for a yes-or-no option are refused when the
    request is made, as BadInput naming the value, never coerced ('false' is not True)."""
    with pytest.raises(BadInput, match=words):
        plan_request(**{**E, **kwargs}, env={})


@pytest.mark.parametrize("call,words", [
    (lambda: probe_request("mlp", device="cpu", max_batch="64"), r"^max_batch '64' is a string"),
    (lambda: probe_request("mlp", device="cpu", data_parallel="yes"), r"^data_parallel 'yes' must be True, False "
                                                                      r"or None \(a bool, not str\)$"),
    (lambda: ProbeRequest(workload=3), r"^workload 3 must be"),
    (lambda: ProbeRequest(margin="0.1"), r"^margin '0\.1' is a string"),
    (lambda: FitRule(buckets=1), r"^buckets 1 must be True or False"),
    (lambda: PlanRequest(target_batch=64, probe=ProbeRequest(), uniform_ranks="false"), r"^uniform_ranks 'false' "),
    (lambda: PlanRequest(target_batch=64, probe="mlp"), r"^probe must be a ProbeRequest, got str: give "
                                                        r"probe=ProbeRequest\(\.\.\.\)$"),
    (lambda: PlanRequest(target_batch=64, probe=None), r"^probe must be a ProbeRequest, got NoneType"),
    (lambda: Snapshot.of(True, "8"), r"^at '8' is a string"),
])
def test_a_request_made_by_hand_checks_types_as_badinput(call, words):
    """A5, A14: a request's fields are checked for their type when it is made, and every refusal is BadInput."""
    with pytest.raises(BadInput, match=words):
        call()


def test_the_verbs_take_the_keywords_of_their_requests():
    """A20: every field of ProbeRequest is a keyword of probe() (its fit rule as parallel, world_size and
    data_parallel), and a precision a probe cannot measure is refused in words, not with a TypeError."""
    import dataclasses
    import inspect

    keywords = set(inspect.signature(autotune.probe).parameters)
    rule = {"parallel", "world_size", "data_parallel"}
    assert {f.name for f in dataclasses.fields(ProbeRequest)} - {"rule"} <= keywords and rule <= keywords
    assert probe_request("mlp", device="cpu", precision="fp32").precision == "fp32"
    with pytest.raises(BadInput, match=r"^precision bf16: a probe measures the fit rule in fp32"):
        autotune.probe(probe="mlp", device="cpu", precision="bf16")
    with pytest.raises(BadInput, match=r"^precision bf16: a probe measures"):
        autotune.probe(ProbeRequest(workload="mlp", precision="bf16"))


def test_a_margin_just_below_one_is_shown_as_it_is_in_the_error():
    """SV10: usable memory at margin 0.99999 says "margin 99.999%", not "margin 100%"."""
    with pytest.raises(AutotuneError, match=r"\(8\.0 MiB capacity, margin 99\.999%\)"):
        autotune.probe("mlp", device="cpu", memory_budget="8MiB", margin=0.99999)
@pytest.mark.parametrize("call", [
    lambda: autotune.memory_snapshot("", "mlp", device="estimate:T4-16GB"),
    lambda: autotune.memory_snapshot(True, "mlp", device="estimate:T4-16GB"),
    lambda: autotune.probe("mlp", device="estimate:T4-16GB", memory_snapshot=""),
    lambda: autotune.plan(64, probe="mlp", device="estimate:T4-16GB", memory_snapshot=""),
])
def test_an_empty_or_true_snapshot_path_is_refused_as_the_command_line_refuses_it(call, monkeypatch):
    """``--memory-snapshot ''`` exits 2; the API's calls refuse it too, before any probe, instead of writing no
    file (memory_snapshot(path): True is no path; probe and plan take True as "no file", never '')."""
    from autotune.probing import finder

    monkeypatch.setattr(finder, "find_max_micro_batch", lambda *a, **k: pytest.fail("probed before the refusal"))
    with pytest.raises(BadInput, match=r"^(path|memory_snapshot) (''|True) is not a file path: give one such as "
                                       r"'memory.pickle'"):
        call()


@pytest.mark.parametrize("call", [
    lambda path: autotune.memory_snapshot(path, "mlp", device="estimate:T4-16GB,estimate:A100-80GB"),
    lambda path: autotune.probe("mlp", device="estimate:T4-16GB", memory_budget="8GiB,4GiB", memory_snapshot=path),
    lambda path: autotune.plan(64, probe="mlp", device="estimate:T4-16GB,estimate:A100-80GB",
                               memory_snapshot=path),
])
def test_a_snapshot_of_several_devices_is_refused_as_one_device_only(call, tmp_path):
    with pytest.raises(BadInput, match=r"^memory_snapshot is for (one device|a plan of one device)"):
        call(str(tmp_path / "m.pickle"))
    assert not (tmp_path / "m.pickle").exists()
