"""``autotune serve`` plans a Hugging Face model by name (a hub id, read from the hub cache here, offline),
as ``autotune plan --model`` does; a path of the service's machine is never a model."""

from __future__ import annotations

import json

import pytest
import transformers

from .server import Server

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One service for both tests: a hub cache holding tiny-org/tiny-llama (offline), an operator's --models folder
    holding ``tiny``, and a folder on its machine holding a config.json (never a model)."""
    folder = tmp_path_factory.mktemp("models")
    config = json.dumps(transformers.LlamaConfig(**TINY).to_dict())
    repo = folder / "hf" / "hub" / "models--tiny-org--tiny-llama"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(config)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name in ("secret", "models/tiny"):
        (folder / name).mkdir(parents=True)
        (folder / name / "config.json").write_text(config)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(folder / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        server = Server(folder, extra=("--models", str(folder / "models")))
    yield server, folder
    server.stop()


@pytest.mark.slow
def test_a_hub_model_is_planned_by_a_worker_then_from_the_store_and_a_path_is_refused(served):
    server, folder = served
    body = {"target_batch": 8, "model": {"name": "tiny-org/tiny-llama", "seq_len": 16}, "device": "estimate",
            "memory_budget": "1GiB"}
    with server.client() as http:
        first = http.post("/v1/plan", json=body)
        second = http.post("/v1/plan", json=body)
        path = http.post("/v1/plan", json={**body, "model": {"name": str(folder / "secret")}})
        both = http.post("/v1/plan", json={**body, "probe": "mlp"})
        missing = http.post("/v1/plan", json={**body, "model": {"name": "tiny-org/not-fetched"}})
    assert first.status_code == 200, first.text
    plan = first.json()["plan"]
    assert plan["probe"]["model"]["total_parameters"] == transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**TINY)).num_parameters()
    assert plan["probe"]["source"] == "hf:tiny-org/tiny-llama?seq_len=16" and not first.json()["cached"]
    assert second.status_code == 200 and second.json()["cached"]
    assert second.json()["plan"]["micro_batch"] == plan["micro_batch"]
    assert second.json()["plan"]["probe"]["source"] == plan["probe"]["source"]
    assert path.status_code == 422 and "model.name" in path.text
    assert both.status_code == 422 and "give one of them" in both.text
    assert missing.status_code == 422 and "not in the Hugging Face cache" in missing.text


@pytest.mark.slow
def test_an_operators_model_folder_is_named_by_its_name_alone(served):
    server, folder = served
    body = {"target_batch": 8, "model": {"name": "tiny", "seq_len": 16}, "device": "estimate", "memory_budget": "1GiB"}
    with server.client() as http:
        first = http.post("/v1/plan", json=body)
        second = http.post("/v1/plan", json=body)
    assert first.status_code == 200, first.text
    probe = first.json()["plan"]["probe"]
    assert probe["source"] == "hf:tiny?seq_len=16" and probe["model"]["name"] == "tiny"
    assert str(folder) not in first.text and second.json()["cached"]
