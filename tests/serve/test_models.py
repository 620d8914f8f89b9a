"""``autotune serve`` plans a Hugging Face model by name (a hub id, read from the hub cache here, offline),
as ``autotune plan --model`` does; a path of the service's machine is never a model."""

from __future__ import annotations

import json

import pytest
import transformers

from .server import Server

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, architectures=["LlamaForCausalLM"])


@pytest.mark.slow
def test_a_hub_model_is_planned_by_a_worker_then_from_the_store_and_a_path_is_refused(tmp_path, monkeypatch):
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(
        transformers.LlamaConfig(**TINY).to_dict()))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (tmp_path / "secret").mkdir()  # a folder holding a config.json on the service's machine
    (tmp_path / "secret" / "config.json").write_text(json.dumps(transformers.LlamaConfig(**TINY).to_dict()))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = Server(tmp_path)
    body = {"target_batch": 8, "model": {"name": "tiny-org/tiny-llama", "seq_len": 16}, "device": "estimate",
            "memory_budget": "1GiB"}
    try:
        with server.client() as http:
            first = http.post("/v1/plan", json=body)
            second = http.post("/v1/plan", json=body)
            path = http.post("/v1/plan", json={**body, "model": {"name": str(tmp_path / "secret")}})
            both = http.post("/v1/plan", json={**body, "probe": "mlp"})
            missing = http.post("/v1/plan", json={**body, "model": {"name": "tiny-org/not-fetched"}})
    finally:
        server.stop()
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
def test_an_operators_model_folder_is_named_by_its_name_alone(tmp_path):
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text(json.dumps(transformers.LlamaConfig(**TINY).to_dict()))
    server = Server(tmp_path, extra=("--models", str(models)))
    body = {"target_batch": 8, "model": {"name": "tiny", "seq_len": 16}, "device": "estimate", "memory_budget": "1GiB"}
    try:
        with server.client() as http:
            first = http.post("/v1/plan", json=body)
            second = http.post("/v1/plan", json=body)
    finally:
        server.stop()
    assert first.status_code == 200, first.text
    probe = first.json()["plan"]["probe"]
    assert probe["source"] == "hf:tiny?seq_len=16" and probe["model"]["name"] == "tiny"
    assert str(tmp_path) not in first.text and second.json()["cached"]
