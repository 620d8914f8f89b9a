"""The service's HTTP contract, in this process (FastAPI's TestClient on the real application, its store on
SQLite and on a real PostgreSQL server): what /openapi.json says, what a request without the token is told,
and the fields of every JSON answer, in order. Planning itself (worker processes) is tested in test_serve.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..stores import execute

#: The file's first test on each database starts its service (and, in a test process, the PostgreSQL server).
pytestmark = pytest.mark.slow

TOKEN = "s3cret-token-for-the-api-tests-0123456789"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
FP = "ab" * 32
REFUSED = "missing or wrong bearer token: send Authorization: Bearer <the token in the service's --token-file>"

#: The routes behind the token.
PROTECTED = [("/v1/plan", "post"), ("/v1/plans", "get"), ("/v1/plans/{fingerprint}", "get"),
             ("/v1/plans/{fingerprint}/report", "get"), ("/v1/measurements", "post"), ("/v1/probes", "get"),
             ("/metrics", "get")]
#: The model each JSON answer is described by.
ANSWERS = {("/v1/plan", "post", "200"): "PlanAnswer", ("/v1/plans", "get", "200"): "Entries",
           ("/v1/plans/{fingerprint}", "get", "200"): "EntryAnswer", ("/v1/measurements", "post", "201"): "Recorded",
           ("/v1/probes", "get", "200"): "Probes"}

ENTRY = ["fingerprint", "workload", "device", "device_kind", "estimated", "max_micro_batch", "max_batch", "limited_by",
         "created_at", "measured", "hits", "last_hit_at", "valid", "invalidated_at", "invalid_reason", "damaged",
         "autotune_version", "components"]
MEASUREMENT = ["fingerprint", "source", "device", "device_kind", "batch", "peak_reserved_bytes",
               "peak_allocated_bytes", "estimated_peak_bytes", "oom", "runs_before", "throughput", "seconds", "note",
               "recorded_at", "id", "error"]
ACCURACY = ["device", "kind", "measurements", "ooms", "compared", "mean_error", "mean_abs_error", "worst_error",
            "allocated_mean_error", "ooms_estimated_to_fit"]
HEALTH = ["status", "problem", "version", "store", "store_reopened", "workers", "busy", "waiting", "jobs",
          "cancelled"]


def probe_result(*, max_micro_batch: int = 48):
    """A probe of a 1000-byte GPU, as a worker stores one."""
    from autotune.results.device import DeviceInfo
    from autotune.results.probe import ProbeResult, Trial

    device = DeviceInfo(name="cuda:0", kind="cuda", estimated=False, capacity_bytes=1000, capacity_source="test",
                        measured_by="test", summary="cuda:0 (Test GPU)", torch="2", model="Test GPU")
    return ProbeResult(workload="mlp", device=device, estimated=False, max_micro_batch=max_micro_batch, max_batch=1024,
                       capacity_bytes=1000, usable_bytes=900, margin=0.1, peak_bytes=900, predicted_peak_bytes=900,
                       breakdown={"activations": 900}, limited_by="memory", curve_lines=((100.0, 16.0),),
                       trials=(Trial(batch=max_micro_batch, source="real", peak_bytes=900, fits=True, seconds=0.1),),
                       fingerprint=FP)


@pytest.fixture(scope="module")
def api(module_store_url) -> Iterator:
    """A service with a token on the module's store, which holds one entry (with a plan); its pool's workers are
    never started (nothing here plans)."""
    from fastapi.testclient import TestClient

    from autotune.planning.planner import make_plan
    from autotune.serve.app import Settings, create_app
    from autotune.store import open_store

    store = open_store(module_store_url)
    store.put(FP, parts={"margin": 0.1}, result=probe_result())
    store.put(FP, plan=make_plan(96, 48))
    client = TestClient(create_app(Settings(store=module_store_url, token=TOKEN)))  # no lifespan: no workers start
    yield client
    client.close()


def _model(schema: dict) -> set[str]:
    """The names of the models a response's JSON schema refers to."""
    refs = [schema.get("$ref", "")] + [s.get("$ref", "") for s in schema.get("anyOf", [])]
    return {r.rsplit("/", 1)[1] for r in refs if r}


def test_the_api_description_names_the_bearer_scheme_on_every_route_but_healthz(api):
    described = api.get("/openapi.json", headers=GOOD).json()
    schemes = described["components"].get("securitySchemes", {})
    bearer = [name for name, s in schemes.items() if (s["type"], s.get("scheme")) == ("http", "bearer")]
    assert len(bearer) == 1, schemes
    for path, method in PROTECTED:
        assert described["paths"][path][method]["security"] == [{bearer[0]: []}], path
    assert "security" not in described["paths"]["/healthz"]["get"]


def test_a_service_without_a_token_describes_no_scheme(module_store_url):
    from fastapi.testclient import TestClient

    from autotune.serve.app import Settings, create_app

    client = TestClient(create_app(Settings(store=module_store_url)))
    described = client.get("/openapi.json").json()
    assert client.get("/v1/plans").status_code == 200
    assert "securitySchemes" not in described.get("components", {})
    assert not any("security" in op for ops in described["paths"].values() for op in ops.values())


def test_the_api_description_names_every_answer_and_error(api):
    described = api.get("/openapi.json", headers=GOOD).json()
    paths = described["paths"]
    for (path, method, status), model in ANSWERS.items():
        answers = paths[path][method]["responses"]
        assert _model(answers[status]["content"]["application/json"]["schema"]) == {model}, (path, answers)
        for error in ("401", "422") if path != "/v1/probes" else ("401",):  # /v1/probes takes nothing to check
            assert _model(answers[error]["content"]["application/json"]["schema"]) == {"Error"}, (path, error)
    assert _model(paths["/healthz"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]) == \
        {"Health", "Liveness"}
    assert _model(paths["/v1/plans/{fingerprint}"]["get"]["responses"]["404"]["content"]["application/json"]
                  ["schema"]) == {"Error"}
    for path, media in (("/v1/plans/{fingerprint}/report", "text/html"), ("/metrics", "text/plain")):
        answers = paths[path]["get"]["responses"]
        assert list(answers["200"]["content"]) == [media]
        assert [list(a["content"]) for status, a in answers.items() if status != "200"] == \
            [["application/json"]] * (len(answers) - 1) and "401" in answers  # its errors are JSON all the same
    assert "HTTPValidationError" not in described["components"]["schemas"]  # every 422 is one line: an Error
    assert described["components"]["schemas"]["Entries"]["properties"]["plans"]["items"]["$ref"].endswith("/Entry")


@pytest.mark.parametrize("method,path,extra", [
    ("post", "/v1/plan", {"json": {"target_batch": 0}}),
    ("post", "/v1/plan", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
    ("post", "/v1/plan", {"content": b"target_batch=512",
                          "headers": {"content-type": "application/x-www-form-urlencoded"}}),
    ("get", "/v1/plan", {}),  # a method the route does not take
    ("get", "/v1/plans", {"params": {"limit": 0}}),
    ("get", "/v1/plans/zz", {}),
    ("get", f"/v1/plans/{FP}", {}),
    ("get", f"/v1/plans/{FP}/report", {}),
    ("post", "/v1/measurements", {"json": {}}),
    ("get", "/v1/probes", {}),
    ("get", "/metrics", {}),
    ("get", "/nowhere", {}),  # no route at all
    ("get", "/openapi.json", {}),
    ("get", "/docs", {}),
    ("get", "/redoc", {}),
])
@pytest.mark.parametrize("authorization", [None, f"Bearer {TOKEN}x", f"Basic {TOKEN}"])
def test_without_the_token_every_request_but_healthz_is_told_401_alone(api, method, path, extra, authorization):
    headers = {**extra.get("headers", {}), **({"Authorization": authorization} if authorization else {})}
    answer = api.request(method, path, **{**extra, "headers": headers})
    assert answer.status_code == 401, answer.text
    assert answer.headers["www-authenticate"] == "Bearer" and answer.json() == {"detail": REFUSED}


def test_a_token_beyond_ascii_is_compared_as_the_bytes_sent(module_store_url):
    from fastapi.testclient import TestClient

    from autotune.serve.app import Settings, create_app

    token = "s3cret-t\u00f6k\u00e9n-0123456789"  # the token file is UTF-8; a header is bytes
    client = TestClient(create_app(Settings(store=module_store_url, token=token)))
    sent = {"Authorization": b"Bearer " + token.encode()}
    assert client.get("/v1/plans", headers=sent).status_code == 200
    assert client.get("/healthz", headers=sent).json()["store"]  # in full
    assert client.get("/v1/plans", headers={"Authorization": b"Bearer " + token[:-1].encode()}).status_code == 401


def test_with_the_token_the_same_requests_get_their_own_answers(api):
    assert api.get("/healthz").json() == {"status": "ok"}  # open, the status alone
    asked = {
        ("get", "/nowhere"): 404, ("get", "/v1/plan"): 405, ("get", "/docs"): 200, ("get", "/redoc"): 200,
        ("get", "/openapi.json"): 200, ("get", "/metrics"): 200, ("get", "/v1/plans/zz"): 422,
        ("get", f"/v1/plans/{'0' * 64}"): 404, ("get", f"/v1/plans/{FP}/report"): 200,
    }
    got = {key: api.request(*key, headers=GOOD).status_code for key in asked}
    assert got == asked
    broken = api.post("/v1/plan", content=b"{not json", headers={**GOOD, "content-type": "application/json"})
    assert broken.status_code == 400 and "not JSON" in broken.json()["detail"]
    assert api.post("/healthz").status_code == 405  # the open path: no token asked for


def test_the_answers_keep_their_fields(api):
    listed = api.get("/v1/plans", headers=GOOD).json()
    assert list(listed) == ["plans"] and [list(e) for e in listed["plans"]] == [ENTRY]
    measured = {"fingerprint": FP, "device": "NVIDIA A100", "batch": 48, "peak_reserved_bytes": 950,
                "peak_allocated_bytes": 900, "throughput": 10.0}
    recorded = api.post("/v1/measurements", json=measured, headers=GOOD)
    assert recorded.status_code == 201 and list(recorded.json()) == ["id", "estimated_peak_bytes", "error"]
    one = api.get(f"/v1/plans/{FP[:8]}", headers=GOOD).json()
    assert list(one) == ["entry", "plans", "measurements", "accuracy"]
    assert list(one["entry"]) == [*ENTRY, "probe"] and one["entry"]["probe"]["kind"] == "autotune.ProbeResult"
    assert one["plans"][0]["kind"] == "autotune.Plan" and one["plans"][0]["target_batch"] == 96
    assert [list(m) for m in one["measurements"]][-1] == MEASUREMENT
    assert [list(a) for a in one["accuracy"]] == [ACCURACY]
    last = one["measurements"][-1]
    assert last["error"] == pytest.approx(950 / last["estimated_peak_bytes"] - 1) and last["source"] == "reported"
    probes = api.get("/v1/probes", headers=GOOD).json()
    assert list(probes) == ["probes"] and list(probes["probes"][0]) == ["name", "builtin", "functions", "error"]
    assert list(api.get("/healthz", headers=GOOD).json()) == HEALTH
    missing = api.get(f"/v1/plans/{'0' * 64}", headers=GOOD).json()
    assert list(missing) == ["detail"] and missing["detail"].startswith(f"no entry with fingerprint {'0' * 64} in ")


def test_an_entry_whose_columns_hold_what_they_should_not_is_listed_as_damaged(api, module_store_url):
    if not module_store_url.startswith("sqlite"):
        pytest.skip("SQLite only: PostgreSQL enforces column types (an integer column cannot hold 'abc')")
    execute(module_store_url, "update autotune_entries set max_micro_batch = 'abc' where fingerprint = :fp", fp=FP)
    try:
        listed = api.get("/v1/plans", headers=GOOD)
        one = api.get(f"/v1/plans/{FP}", headers=GOOD)
    finally:
        execute(module_store_url, "update autotune_entries set max_micro_batch = 48 where fingerprint = :fp", fp=FP)
    assert listed.status_code == 200 and one.status_code == 200, (listed.text, one.text)
    (entry,) = listed.json()["plans"]
    assert entry["max_micro_batch"] == "abc" and "max_micro_batch column holds 'abc'" in entry["damaged"]
    assert one.json()["entry"]["probe"] is None and one.json()["entry"]["max_micro_batch"] == "abc"


def test_head_healthz_is_answered_as_get(api):
    assert api.head("/healthz").status_code == 200


@pytest.mark.parametrize("content", [b'{"target_batch": "\xff\xfe"}', b"[" * 8000 + b"]" * 8000, b"\xff\xfe"])
def test_a_body_that_is_not_utf8_or_nests_too_deep_is_not_json(api, content):
    answer = api.post("/v1/plan", content=content, headers={**GOOD, "content-type": "application/json"})
    assert answer.status_code == 400 and answer.json() == {
        "detail": "the body is not JSON: send a JSON object with content-type: application/json"}, answer.text


def test_a_precision_but_fp32_is_told_the_service_plans_fp32_only(api):
    answer = api.post("/v1/plan", json={"target_batch": 64, "precision": "bf16"}, headers=GOOD)
    assert answer.status_code == 422 and answer.json()["detail"] == [{
        "type": "value_error", "loc": ["body", "precision"], "input": "bf16",
        "msg": 'precision "bf16" is not planned here: the service plans fp32 only (the precision its fit rule '
               'measures): send "precision": "fp32" or leave precision out',
        "ctx": {"choices": ["fp32"], "fix": 'send "precision": "fp32" or leave precision out'}}]


#: A bad value for every setting of the plan body; a setting added to the body needs one here.
BAD_SETTINGS = {"target_batch": 0, "probe": "x" * 200, "model": 5, "device": "tpu", "memory_budget": "12XB",
                "world_size": 0, "parallel": "zero", "fsdp_sync": "sometimes", "margin": 1.5, "precision": "bf16",
                "multiple_of": 0, "uniform": "always", "uniform_ranks": "yes", "search_settings": "yes",
                "allow": "x" * 100}
#: Settings each fine alone that the library refuses together, and the field its error names.
REFUSED_TOGETHER = [({"fsdp_sync": "every"}, "fsdp_sync"), ({"target_batch": 1021, "multiple_of": 4}, "target_batch"),
                    ({"device": "estimate:A100-80GB,estimate:T4-16GB", "world_size": 3}, "world_size"),
                    ({"device": "estimate*2", "memory_budget": "1GiB,1GiB,1GiB"}, "memory_budget"),
                    ({"device": "estimate*2000"}, "device"), ({"probe": "mlp", "model": {"name": "gpt2"}}, "model"),
                    ({"margin": 0.99999}, "margin"), ({"memory_budget": [80]}, "memory_budget"),
                    ({"uniform": True, "target_batch": 1021, "multiple_of": 2}, "target_batch")]


def test_every_setting_of_the_plan_body_has_a_bad_value_in_the_tests():
    from autotune.serve.bodies import PlanRequest

    assert set(BAD_SETTINGS) == set(PlanRequest.model_fields)


@pytest.mark.parametrize("field", sorted(BAD_SETTINGS))
def test_a_bad_value_of_every_plan_setting_is_a_422_naming_the_field(api, field):
    """FastAPI's 422 shape: ``loc`` ends with the field, ``msg`` names it in the request's own terms."""
    _refused_naming(api, {field: BAD_SETTINGS[field]}, field)


@pytest.mark.parametrize("body, field", REFUSED_TOGETHER)
def test_settings_the_library_refuses_are_a_422_naming_the_field(api, body, field):
    item = _refused_naming(api, body, field)
    assert item["type"] == "value_error" and item["ctx"], item  # the library's data: its limit or choices, its fix


def _refused_naming(api, body: dict, field: str) -> dict:
    answer = api.post("/v1/plan", json={"target_batch": 64, "memory_budget": "1GiB", **body}, headers=GOOD)
    assert answer.status_code == 422, answer.text
    [item] = answer.json()["detail"]
    assert item["loc"] == ["body", field] and item["input"] == body.get(field, 64), item
    assert item["msg"].startswith(field) or f" {field} " in item["msg"] or f'"{field}"' in item["msg"], item
    assert "\n" not in item["msg"] and "=True" not in item["msg"] and "='" not in item["msg"], item  # JSON, not Python
    assert set(item) <= {"type", "loc", "msg", "input", "ctx"}, item
    return item


def test_the_probes_listed_are_the_functions_that_build_a_workload(api):
    listed = {p["name"]: p["functions"] for p in api.get("/v1/probes", headers=GOOD).json()["probes"]}
    assert listed == {"convnet": ["build"], "gpt": ["build", "build_100m", "build_1b"], "mlp": ["build"]}
    answer = api.post("/v1/plan", json={"target_batch": 64, "probe": "mlp:model"}, headers=GOOD)
    assert answer.status_code == 404 and "has no function 'model' that builds a workload" in answer.json()["detail"]


def test_answers_never_say_where_the_store_is(api, module_store_url):
    from sqlalchemy.engine import make_url

    from autotune.dburl import store_url

    url = make_url(store_url(module_store_url))
    hidden = [module_store_url, url.database] + ([url.host, f":{url.port}", f"{url.username}@"] if url.host else [])
    missing = api.get(f"/v1/plans/{'0' * 64}", headers=GOOD)
    health = api.get("/healthz", headers=GOOD)
    assert missing.status_code == 404 and missing.json()["detail"].startswith(f"no entry with fingerprint "
                                                                              f"{'0' * 64} in the store")
    assert health.json()["store"] == url.get_backend_name()
    for answer in (missing, health):
        assert not [h for h in hidden if h and str(h) in answer.text], answer.text
