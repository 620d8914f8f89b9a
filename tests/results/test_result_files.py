"""Result JSON read back: a file of the wrong kind, a missing field or a value of the wrong type is a
one-line ResultFileError naming the file and the field, never a KeyError or TypeError from deep inside."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from autotune import api as pipeline
from autotune.cli import main
from autotune.errors import ResultFileError
from autotune.report import result_from_dict
from autotune.results.ramp import RampConfig
from autotune.serial import dumps

WRONG = [None, "x", 2.5, -1, True, [], {}, ["a", 1], [[1, 2, 3]]]
NESTED = {"probe", "plan"}  # whole results inside results: mutated field by field
ROWS = {"trials", "checks", "batch_schedule"}  # lists of records: their first record is mutated field by field
KINDS = ["Plan", "RunResult", "ProbeResult", "RampedRun"]  # RampedRun: a RunResult with a batch ramp


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    plan = pipeline.plan(1021, workload="mlp", device="cpu", memory_budget=3_000_000)
    run = pipeline.run(plan=plan, device="cpu", steps=1)
    ramped = pipeline.run(plan=plan, device="cpu", steps=2, ramp=RampConfig(start=64))
    assert ramped.batch_schedule
    return {"Plan": plan.to_dict(), "RunResult": run.to_dict(), "ProbeResult": plan.probe.to_dict(),
            "RampedRun": ramped.to_dict()}


def _mutations(data: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, a copy of ``data`` with one field missing or holding a wrong value), for every field."""
    for key, value in data.items():
        if key in ("kind", "schema_version"):
            continue
        where = f"{path}{key}"
        missing = {k: v for k, v in data.items() if k != key}
        yield f"{where} missing", missing
        for wrong in WRONG:
            yield f"{where}={wrong!r}", {**data, key: wrong}
        if key in NESTED and isinstance(value, dict):
            for inner, changed in _mutations(value, f"{where}."):
                yield inner, {**data, key: changed}
        if isinstance(value, dict) and key not in NESTED:  # e.g. verification, device, breakdown
            for sub in value:
                if sub in ROWS and value[sub]:
                    for inner, changed in _mutations(value[sub][0], f"{where}.{sub}[0]."):
                        yield inner, {**data, key: {**value, sub: [changed, *value[sub][1:]]}}
                    continue
                yield f"{where}.{sub} missing", {**data, key: {k: v for k, v in value.items() if k != sub}}
                for wrong in (None, "x", [], {}):
                    yield f"{where}.{sub}={wrong!r}", {**data, key: {**value, sub: wrong}}
        if key in ROWS and isinstance(value, list) and value:
            for inner, changed in _mutations(value[0], f"{where}[0]."):
                yield inner, {**data, key: [changed, *value[1:]]}


def _load_and_use(data: dict[str, Any]) -> None:
    result = result_from_dict(json.loads(json.dumps(data)), source="x.json")  # as a file reads back
    result.summary()
    again = json.loads(dumps(result.to_dict()))
    result_from_dict(again, source="x.json (written again)")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_result_file_loads_whole_or_is_a_result_file_error(results, kind):
    unexpected = []
    count = 0
    for where, data in _mutations(results[kind]):
        count += 1
        try:
            _load_and_use(data)
        except ResultFileError as exc:
            message = str(exc)
            if "\n" in message or "x.json" not in message:
                unexpected.append(f"{where}: unclear message {message!r}")
        except Exception as exc:  # noqa: BLE001 - any other error is what this test exists to catch
            unexpected.append(f"{where}: {type(exc).__name__}: {exc}")
    assert count > 100
    assert unexpected == [], f"{len(unexpected)} of {count}:\n" + "\n".join(unexpected[:60])


@pytest.mark.parametrize(("given", "expected", "flag"), [
    ("RunResult", "Plan", "--plan"), ("ProbeResult", "Plan", "--plan"),
])
def test_run_plan_with_a_result_of_another_kind_names_both(results, tmp_path, capsys, given, expected, flag):
    path = tmp_path / "result.json"
    path.write_text(dumps(results[given]))
    code = main(["run", flag, str(path), "--quiet"])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert f"holds a {given}, not a {expected}" in lines[0] and "autotune plan --output" in lines[0]


def test_notes_must_be_a_list_of_strings(results):
    with pytest.raises(ResultFileError, match=r"notes is the string 'tuned by hand', expected a list of strings"):
        result_from_dict({**results["Plan"], "notes": "tuned by hand"}, source="plan.json")


def test_a_schedule_above_the_probes_max_is_refused_unless_planned_so(results):
    from autotune.planning import make_plan
    from autotune.results import Plan
    from autotune.results.probe import ProbeResult

    probe = ProbeResult.from_dict(results["ProbeResult"])
    m = probe.max_micro_batch
    on_purpose = make_plan(4 * (m + 40), m + 40, probe=probe)  # the API allows it, and says so in a note
    assert on_purpose.micro_batch > m and any("above the probed" in n for n in on_purpose.notes)
    assert Plan.from_dict(json.loads(dumps(on_purpose.to_dict()))) == on_purpose
    edited = on_purpose.to_dict()
    edited["notes"] = [n for n in edited["notes"] if "above the probed" not in n]
    with pytest.raises(ResultFileError, match=rf"plan.json: micro-batch {on_purpose.micro_batch} in the schedule is "
                                              rf"above the {m} its probe found to fit"):
        Plan.from_dict(edited, source="plan.json")


def test_a_nan_loss_written_as_null_reads_back_as_nan(results):
    data = copy.deepcopy(results["RunResult"])
    data["losses"] = [None] * len(data["losses"])
    run = result_from_dict(json.loads(dumps(data)), source="result.json")
    assert all(math.isnan(loss) for loss in run.losses)


@pytest.mark.parametrize("kind,command", [("Plan", "autotune plan --output"), ("RunResult", "autotune run --output"),
                                          ("ProbeResult", "autotune probe --output")])
def test_a_file_of_an_older_schema_is_refused_in_one_line_that_says_how_to_write_it_again(results, kind, command):
    data = copy.deepcopy(results[kind])
    data["schema_version"] = 1
    with pytest.raises(ResultFileError) as info:
        result_from_dict(data, source="old.json")
    assert str(info.value) == (f"old.json has schema_version 1, older than the 2 this autotune reads: write it again "
                               f"with {command}")


def _not_plain(value: Any, where: str = "") -> Iterator[str]:
    """Where ``value`` holds anything but the builtin types JSON writes (a subclass of str counts: unpickling
    it imports the module that defines it, torch for torch's version string)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if type(key) is not str:
                yield f"{where}{key!r} (key of type {type(key).__name__})"
            yield from _not_plain(inner, f"{where}{key}.")
    elif type(value) is list:  # a tuple is not: a file reads back a list, and the readers take lists only
        for i, inner in enumerate(value):
            yield from _not_plain(inner, f"{where}{i}.")
    elif type(value) not in (str, int, float, bool, type(None)):
        yield f"{where[:-1]} ({type(value).__module__}.{type(value).__name__})"


@pytest.mark.parametrize("kind", KINDS)
def test_a_results_dict_is_plain_data(results, kind):
    assert list(_not_plain(results[kind])) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_result_reads_back_from_its_own_dict(results, kind):
    assert result_from_dict(results[kind], source="x.json").to_dict() == results[kind]


def test_a_trial_holds_its_measurement_in_memory_only_and_a_result_keeps_none():
    """A trial holds the device's measurement of it while the probe searches; the probe's result keeps its trials
    without one (no allocation trace is carried along), the JSON written has none, and the result read back is
    equal to the one in memory."""
    from autotune.devices import get_device
    from autotune.probing.trials import TrialRunner
    from autotune.workload import load_workload

    trial = TrialRunner(get_device("cpu", memory_budget=3_000_000), load_workload("mlp"), 2_700_000, "real", [],
                        False)(4)
    assert trial.measurement is not None and trial.measurement.peak_bytes == trial.peak_bytes
    assert "measurement=" not in repr(trial)
    probed = pipeline.probe("mlp", device="cpu", memory_budget=3_000_000, max_batch=64)
    assert {t.source for t in probed.trials} == {"estimate", "real"}
    assert all(t.measurement is None for t in probed.trials)
    text = dumps(probed.to_dict())
    assert "measurement" not in text
    read = result_from_dict(json.loads(text), source="x.json")
    assert read == probed and read.trials == probed.trials and hash(read.trials) == hash(probed.trials)
    assert dumps(read.to_dict()) == text


def test_the_plain_data_check_sees_a_tuple():
    assert list(_not_plain({"history": ({"step": 0},)})) == ["history (builtins.tuple)"]


def test_the_plain_data_check_sees_a_subclass_of_str():
    import torch

    seen = list(_not_plain({"device": {"torch": torch.__version__}}))
    assert seen == ["device.torch (torch.torch_version.TorchVersion)"]
