"""Record: a type declares its fields once (types and rules); checks, JSON writing and reading follow from that."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import pytest

from autotune.errors import BadInput, PlanError, ResultFileError
from autotune.options import whole
from autotune.report import load_result
from autotune.results.record import Margin, Record, Rule, Whole, derived, memory_only, one_of, written_fields
from autotune.serial import dumps

SCHEMA2 = Path(__file__).parent / "data" / "schema2"


@dataclass(frozen=True, kw_only=True)
class Part(Record):
    size: Whole
    label: str = ""


@dataclass(frozen=True, kw_only=True)
class Order(Record):
    """A type of the tests' own: declared the way every request and result type is."""

    count: Whole
    share: Margin
    kind: Annotated[str, one_of(("a", "b"))] = "a"
    parts: tuple[Part, ...] = ()
    weights: tuple[float, ...] = ()
    main: Part | None = None
    note: str | None = None
    limit: Annotated[int | None, Rule(whole, least=0, text=False)] = None

    @property
    @derived(after="count")
    def double(self) -> int:
        return 2 * self.count

    def validate(self) -> None:
        if len(self.weights) > self.count:
            raise ValueError(f"{len(self.weights)} weights for a count of {self.count}")


ORDER = Order(count=3, share=0.25, parts=[Part(size=2, label="x")], weights=[0.5, 1], main=Part(size=1))


def test_a_record_is_written_in_the_order_declared_with_derived_values_in_place():
    assert ORDER.to_dict() == {"count": 3, "double": 6, "share": 0.25, "kind": "a",
                               "parts": [{"size": 2, "label": "x"}], "weights": [0.5, 1.0],
                               "main": {"size": 1, "label": ""}, "note": None, "limit": None}
    assert list(ORDER.to_dict())[:4] == ["count", "double", "share", "kind"]
    assert ORDER.parts == (Part(size=2, label="x"),) and ORDER.weights == (0.5, 1)  # lists became tuples


def test_a_record_reads_back_what_it_wrote():
    assert Order.from_dict(json.loads(dumps(ORDER.to_dict())), source="x.json") == ORDER


@dataclass(frozen=True, kw_only=True)
class Held(Record):
    size: Whole
    scratch: object = memory_only()


def test_a_memory_only_field_is_never_written_read_compared_or_shown():
    held = Held(size=2, scratch=[1, 2])
    assert held.to_dict() == {"size": 2} and "scratch" not in repr(held)
    assert [f.name for f in written_fields(Held)] == ["size"]
    back = Held.from_dict(json.loads(dumps(held.to_dict())))
    assert back.scratch is None and back == held and hash(back) == hash(held)
    with pytest.raises(ResultFileError, match="unknown field scratch"):
        Held.from_dict({"size": 2, "scratch": [1, 2]})


@pytest.mark.parametrize(("change", "words"), [
    ({"count": 0}, "count 0 must be at least 1"),
    ({"count": True}, "count True is not a whole number"),
    ({"count": "3"}, "count '3' is a string, not a whole number: give the number itself, 3"),
    ({"share": 1.0}, "share 1.0 must be a fraction in [0, 1)"),
    ({"kind": "c"}, "kind 'c' must be one of a, b"),
    ({"parts": [{"size": 1}]}, "parts must be Part objects"),
    ({"main": {"size": 1}}, "main must be a Part, got dict"),
    ({"weights": [1.0] * 4}, "4 weights for a count of 3"),
    ({"limit": -1}, "limit -1 must be at least 0"),
])
def test_each_rule_holds_when_a_record_is_made(change, words):
    with pytest.raises(ValueError) as info:
        replace(ORDER, **change)
    assert words in str(info.value)


def test_a_rule_normalises_what_it_accepts_and_none_passes_where_the_type_allows_it():
    assert replace(ORDER, count=_Index(5)).count == 5 and type(replace(ORDER, count=_Index(5)).count) is int
    assert replace(ORDER, limit=None).limit is None and replace(ORDER, limit=_Index(0)).limit == 0


class _Index:
    """An integer type other than int (as numpy's are)."""

    def __init__(self, n: int):
        self.n = n

    def __index__(self) -> int:
        return self.n


@pytest.mark.parametrize(("change", "why"), [
    ({"count": 0}, "count 0 must be at least 1"),
    ({"count": "3"}, "count is the string '3', expected a whole number"),
    ({"count": None}, "count is null, expected a whole number"),
    ({"share": 2}, "share 2.0 must be a fraction in [0, 1): the share of memory kept free, e.g. 0.1"),
    ({"parts": [{"size": 1}, {"size": 0}]}, "parts[1]: size 0 must be at least 1"),
    ({"parts": [{"size": 1.5}]}, "parts[0].size is 1.5, expected a whole number"),
    ({"parts": [7]}, "parts[0] is 7, expected an object"),
    ({"parts": [{"size": 1, "colour": "red"}]}, "unknown field parts[0].colour"),
    ({"parts": [{"label": "x"}]}, "the field parts[0].size is missing"),
    ({"main": []}, "main is a list of 0 items, expected an object"),
    ({"note": 5}, "note is 5, expected a string or null"),
    ({"weights": "0.5"}, "weights is the string '0.5', expected a list of numbers"),
    ({"extra": 1}, "unknown field extra"),
])
def test_a_damaged_record_is_one_line_naming_the_field(change, why):
    data = {**ORDER.to_dict(), **change}
    with pytest.raises(ResultFileError) as info:
        Order.from_dict(data, source="x.json")
    assert str(info.value) == f"x.json: not a valid Order ({why}); write it again with autotune"


def test_a_missing_field_and_a_derived_one_read_as_the_type_says():
    data = ORDER.to_dict()
    del data["count"]
    with pytest.raises(ResultFileError, match=r"\(the field count is missing\)"):
        Order.from_dict(data, source="x.json")
    read = Order.from_dict({"count": 3, "double": 99, "share": 0, "weights": [None, 1]}, source="x.json")
    assert read.double == 6 and read.parts == () and math.isnan(read.weights[0])  # null: NaN as dumps wrote it


@pytest.mark.parametrize("name", sorted(p.name for p in SCHEMA2.glob("*.json")))
def test_result_files_are_written_byte_for_byte_as_they_were(name):
    """tests/results/data/schema2/ holds files of every kind of record that autotune wrote before its results declared
    their fields once (a run with a ramp, a tuned plan, a plan for mixed ranks, a probe with a memory timeline);
    read back and written again, each is the same text."""
    path = SCHEMA2 / name
    written = load_result(path).to_dict()
    if name == "plan_mixed.json":  # M19: a mixed plan now writes null where no one figure holds for every rank
        old = json.loads(path.read_text())
        assert [written[k] for k in ("micro_batch", "accumulation_steps", "predicted_peak_bytes", "headroom_bytes")] \
            == [None] * 4 and old["micro_batch"] == 785 and old["predicted_peak_bytes"] == 28322448
        ranks = written["mixed"]["ranks"]
        assert [r.pop("headroom_bytes") for r in ranks] == [r["usable_bytes"] - r["peak_bytes"] for r in ranks]
        written = {**written, **{k: old[k] for k in ("micro_batch", "accumulation_steps", "predicted_peak_bytes",
                                                     "headroom_bytes")}}
    assert dumps(_without_added(written)) == path.read_text()


#: Fields that records gained after these files were written, and that they write as null where the old ones held
#: nothing: FSDP's gradient sync (a probe that is not FSDP's has none), a plan's tokens (a plan of a target batch
#: has none), a settings search's choice and rows (an empty list: a plan made without one).
ADDED = frozenset({"fsdp_sync", "target_tokens", "tokens", "setting", "settings"})


def _without_added(value):
    """``value`` (a written record) without the :data:`ADDED` fields that are null (or empty), wherever they are."""
    if isinstance(value, dict):
        return {k: _without_added(v) for k, v in value.items() if not (k in ADDED and (v is None or v == []))}
    if isinstance(value, list):
        return [_without_added(v) for v in value]
    return value


@pytest.mark.parametrize(("value", "kwargs", "error", "words"), [
    ("12", {}, BadInput, None),
    ("12", {"text": False}, BadInput, "size '12' is a string, not a whole number: give the number itself, 12"),
    ("x", {"text": False, "example": "8"}, BadInput, "size 'x' is a string, not a whole number: give the number "
                                                      "itself, e.g. 8"),
    (0, {"fix": "use 1 or more"}, BadInput, "size 0 must be at least 1: use 1 or more"),
    (1, {"least": 2, "example": "8"}, BadInput, "size 1 must be at least 2, e.g. 8"),
    (2.0, {"error": PlanError}, PlanError, "size 2.0 is not a whole number"),
    (False, {"least": 0}, BadInput, "size False is not a whole number"),
])
def test_whole_numbers_are_checked_in_one_place(value, kwargs, error, words):
    if words is None:
        assert whole(value, "size", **kwargs) == 12
        return
    with pytest.raises(error) as info:
        whole(value, "size", **kwargs)
    assert str(info.value) == words
