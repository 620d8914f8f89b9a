"""The service's plan body asks for a settings search as the API does: a worker's job runs it."""

from __future__ import annotations

import pytest

from autotune.errors import BadInput
from autotune.serve.bodies import PlanRequest
from autotune.serve.jobs import run_job

BODY = {"target_batch": 64, "probe": "mlp", "device": "estimate:A10G-24GB", "search_settings": True}


@pytest.mark.slow  # a settings search in a worker
def test_a_body_with_search_settings_is_a_request_for_one(tmp_path) -> None:
    asked = PlanRequest.model_validate({**BODY, "allow": "bf16-mixed"}).asked()
    assert asked.search is not None and asked.search.allow == ("bf16-mixed",)
    answer = run_job({"kind": "plan", "spec": "mlp", "probe": "mlp", "request": asked.to_dict()},
                     f"sqlite:///{tmp_path / 'plans.db'}")
    settings = answer["plan"]["settings"]
    assert answer["plan"]["setting"] == settings[0]["setting"]
    assert {tuple(r["setting"]["changes"]) for r in settings} == {(), ("bf16-mixed",)}
    assert any(r["setting"]["allocator"] for r in settings)  # a GPU by estimate: the allocator tried too


def test_allow_without_search_is_refused() -> None:
    with pytest.raises(BadInput, match="names settings for the settings search"):
        PlanRequest.model_validate({**BODY, "search_settings": False, "allow": "lora"}).asked()
