"""A Hugging Face model by name (``--model``): configs written here, the hub's cache read offline, the
model built by transformers, counted as transformers and peft count, planned as its hand-written probe."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

import autotune
from autotune.cli import main
from autotune.errors import BadInput
from autotune.results.model import ModelSpec
from autotune.workload import load_workload

from .hf_configs import AUTO, CONFIGS, TINY, config_of, write_config


def reference(kind: str) -> torch.nn.Module:
    """The model transformers itself builds from the config (random weights)."""
    return getattr(transformers, AUTO[CONFIGS[kind][3]]).from_config(config_of(kind))


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_config_builds_the_model_transformers_builds_and_trains_on_its_batches(tmp_path, kind):
    spec = ModelSpec(name=str(write_config(tmp_path / kind, kind)), seq_len=16 if kind != "vit" else None).spec()
    workload = load_workload(spec)
    model = workload.make_model()
    expected = reference(kind)
    facts = workload.facts()
    assert type(model) is type(expected) and facts.task == CONFIGS[kind][3]
    assert facts.total_parameters == expected.num_parameters() == facts.trainable_parameters
    batch = workload.make_batch(3, torch.Generator().manual_seed(0))
    loss = workload.loss(model, batch)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss) and all(p.grad is not None for p in model.parameters()
                                                             if p.requires_grad and kind != "bert")


def test_labels_are_what_the_collators_make(tmp_path):
    gen = torch.Generator().manual_seed(0)
    causal = load_workload(ModelSpec(name=str(write_config(tmp_path / "l", "llama")), seq_len=12).spec())
    batch = causal.make_batch(2, gen)
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["input_ids"].shape == (2, 12)
    assert causal.count_items(batch) == 2 * 11  # the shifted tokens the loss averages over
    t5 = load_workload(ModelSpec(name=str(write_config(tmp_path / "t", "t5")), seq_len=12, target_len=5).spec())
    assert t5.make_batch(2, gen)["labels"].shape == (2, 5)
    cls = load_workload(ModelSpec(name=str(write_config(tmp_path / "c", "bert-cls")), seq_len=8, num_labels=7).spec())
    labels = cls.make_batch(4, gen)["labels"]
    assert labels.shape == (4,) and cls.make_model().num_labels == 7
    vit = load_workload(ModelSpec(name=str(write_config(tmp_path / "v", "vit"))).spec())
    assert vit.make_batch(2, gen)["pixel_values"].shape == (2, 3, 32, 32)


def test_default_sequence_length_is_the_configs_maximum_up_to_2048(tmp_path):
    facts = load_workload(ModelSpec(name=str(write_config(tmp_path / "l", "llama"))).spec()).facts()
    assert facts.seq_len == 64
    with pytest.raises(BadInput, match="past the 64 positions"):
        load_workload(ModelSpec(name=str(tmp_path / "l"), seq_len=65).spec())


def test_lora_counts_are_peft_s(tmp_path):
    import peft

    folder = write_config(tmp_path / "l", "llama")
    workload = load_workload(ModelSpec(name=str(folder), seq_len=8, lora="r=4,alpha=8,targets=q_proj+v_proj").spec())
    expected = peft.get_peft_model(reference("llama"), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                                                       target_modules=["q_proj", "v_proj"],
                                                                       task_type="CAUSAL_LM"))
    trainable, total = expected.get_nb_trainable_parameters()
    facts = workload.facts()
    assert (facts.total_parameters, facts.trainable_parameters) == (total, trainable) and trainable < total
    model = workload.make_model()
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable


@pytest.mark.slow
def test_a_hub_id_reads_config_json_through_huggingface_hub_from_its_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    write_config(repo / "snapshots" / ("0" * 40), "llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = autotune.probe(model="tiny-org/tiny-llama", device="estimate", memory_budget="1GiB", max_batch=4,
                            store=False)
    assert result.model is not None and result.model.name == "tiny-org/tiny-llama"
    assert result.model.total_parameters == reference("llama").num_parameters()
    assert result.source == "hf:tiny-org/tiny-llama" and result.max_micro_batch == 4
    assert result.model.config_source == "the Hugging Face hub, tiny-org/tiny-llama at revision 000000000000 " \
                                         "(huggingface_hub's cache)"
    with pytest.raises(BadInput, match="not in the Hugging Face cache"):
        autotune.probe(model="tiny-org/not-fetched", device="estimate", memory_budget="1GiB", store=False)


PROBE_FILE = '''
import torch, transformers
from autotune import Workload

def build():
    config = transformers.LlamaConfig(**{tiny!r}, architectures=["LlamaForCausalLM"])

    def batch(n, generator):
        ids = torch.randint(128, (n, 32), generator=generator)
        return {{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}}

    return Workload(name="llama", model=lambda: transformers.AutoModelForCausalLM.from_config(config), batch=batch,
                    loss=lambda model, batch: model(**batch).loss,
                    items=lambda batch: int((batch["labels"][:, 1:] != -100).sum()),
                    optimizer=lambda params: torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0))
'''


@pytest.mark.slow
def test_a_model_plan_equals_the_plan_of_its_hand_written_probe_file(tmp_path):
    folder = write_config(tmp_path / "llama", "llama")
    probe_file = tmp_path / "llama_probe.py"
    probe_file.write_text(PROBE_FILE.format(tiny=TINY))
    asked = dict(device="estimate", memory_budget="720MiB", store=False)
    by_name = autotune.plan(256, model=ModelSpec(name=str(folder), seq_len=32), **asked)
    by_hand = autotune.plan(256, probe=str(probe_file), **asked)
    assert by_name.probe is not None and by_hand.probe is not None
    assert 1 < by_name.probe.max_micro_batch < 256
    for key in ("max_micro_batch", "peak_bytes", "predicted_peak_bytes", "allocated_peak_bytes", "curve"):
        assert getattr(by_name.probe, key) == getattr(by_hand.probe, key), key
    assert (by_name.micro_batch, by_name.accumulation_steps) == (by_hand.micro_batch, by_hand.accumulation_steps)
    assert same_but_names(by_name.to_dict()) == same_but_names(by_hand.to_dict())


def same_but_names(plan: dict) -> dict:
    """A plan's JSON without what names its workload or says how long it took."""
    probe = {k: v for k, v in plan["probe"].items() if k not in ("workload", "source", "model", "seconds")}
    probe["trials"] = [{k: v for k, v in t.items() if k != "seconds"} for t in probe["trials"]]
    return {**{k: v for k, v in plan.items() if k not in ("probe", "created_at")}, "probe": probe}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_a_real_cpu_run_confirms_the_estimate_of_a_tiny_config(tmp_path, dtype):
    """One real run and no out-of-memory error, in fp32 and under the CPU's autocast (bf16-mixed)."""
    folder = write_config(tmp_path / "llama", "llama")
    result = autotune.probe(model=ModelSpec(name=str(folder), seq_len=32, dtype=dtype), device="cpu",
                            memory_budget="12MiB", store=False)
    real = [t for t in result.trials if t.source == "real"]
    assert len(real) == 1 and real[0].fits and real[0].batch == result.max_micro_batch > 1
    assert result.real_ooms == 0
    estimated = {t.batch: t.peak_bytes for t in result.trials if t.source == "estimate"}
    assert result.model is not None and abs(real[0].peak_bytes / estimated[real[0].batch] - 1) < 0.02


def test_a_mixed_precision_model_on_the_cpu_is_estimated_under_the_cpus_autocast(tmp_path):
    """bf16-mixed on the CPU: the estimate runs the loss under the CPU's autocast, as the real run does (under
    FakeTensorMode, where autocast applies), and transformers' code as the real run takes it (no causal mask
    built for a FakeTensor taken for tracing): exact; run in float32 it was 24% over, with the mask 6%."""
    from autotune.devices import get_device
    from autotune.probing.fitrule import run_trial

    folder = write_config(tmp_path / "llama", "llama")
    workload = load_workload(ModelSpec(name=str(folder), seq_len=32, dtype="bf16-mixed").spec())
    cpu = get_device("cpu", memory_budget=1 << 30)
    estimator = cpu.estimator()
    estimate = run_trial(estimator, workload, 16, 1 << 30, source="estimate", capacity_guard=False)
    real = run_trial(cpu, workload, 16, 1 << 30, source="real")
    assert estimate.peak_bytes == real.peak_bytes
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.utils import import_utils

    with FakeTensorMode() as mode:
        assert import_utils.is_fake_tensor(mode.from_tensor(torch.ones(1)))  # transformers' own again
    assert estimator.engine == "fake" and "autocast on the CPU" in estimator.fallback


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_autotune_run_model_trains_and_verifies(tmp_path, capsys):
    folder = write_config(tmp_path / "llama", "llama")
    code, out, err = run_cli(capsys, "run", "--model", str(folder), "--seq-len", "16", "--target-batch", "8",
                             "--device", "cpu", "--memory-budget", "6MiB", "--steps", "2", "--json", "--quiet")
    data = json.loads(out)
    assert code == 0 and data["passed"], err
    code, out, err = run_cli(capsys, "run", "--model", str(folder), "--seq-len", "16", "--target-batch", "8",
                             "--device", "cpu", "--memory-budget", "6MiB", "--steps", "2", "--json", "--quiet",
                             "--dtype", "bf16-mixed")
    data = json.loads(out)
    assert code == 0 and data["passed"] and data["precision"] == "bf16", err


@pytest.mark.slow
def test_plan_json_says_the_model_and_the_formula(tmp_path, capsys):
    folder = write_config(tmp_path / "llama", "llama")
    code, out, err = run_cli(capsys, "plan", "--model", str(folder), "--seq-len", "16", "--target-batch", "8",
                             "--device", "estimate", "--memory-budget", "1GiB", "--json", "--quiet",
                             "--dtype", "bf16-true")
    assert code == 0, err
    model = json.loads(out)["probe"]["model"]
    total = reference("llama").num_parameters()
    assert model["total_parameters"] == total == model["trainable_parameters"] and model["dtype"] == "bf16"
    assert model["formula_weights_bytes"] == 2 * total and model["formula_adam_training_bytes"] == 8 * total
    code, out, _ = run_cli(capsys, "probe", "--model", str(folder), "--seq-len", "16", "--device", "estimate",
                           "--memory-budget", "1GiB", "--max-batch", "4", "--quiet")
    assert code == 0 and "accelerate estimate-memory's formula" in out and f"{total:,} parameters" in out


@pytest.mark.parametrize("argv,words", [
    (["--probe", "mlp"], "--model and --probe each name the workload"),
    (["--optimizer", "adamw-8bit"], "needs bitsandbytes"),
    (["--lora", "r=8,bits=8"], "QLoRA over 8-bit weights (lora bits=8) needs bitsandbytes"),
    (["--lora", "bits=3"], "bits is 4 or 8"),
    (["--dtype", "bf16-half"], "bf16-mixed, fp16-mixed"),
    (["--lora", "r=0"], "at least 1"),
    (["--task", "speech"], "invalid choice"),
])
def test_bad_model_settings_are_one_line_and_exit_2(tmp_path, capsys, argv, words):
    folder = write_config(tmp_path / "llama", "llama")
    code, out, err = run_cli(capsys, "plan", "--target-batch", "8", "--model", str(folder), "--device", "estimate",
                             "--memory-budget", "1GiB", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and words in lines[0], err


def test_model_settings_without_a_model_and_bad_names_are_refused(tmp_path, capsys):
    code, _, err = run_cli(capsys, "probe", "--seq-len", "16", "--device", "estimate", "--memory-budget", "1GiB")
    assert code == 2 and "add --model NAME" in err
    code, _, err = run_cli(capsys, "probe", "--model", str(tmp_path), "--device", "estimate", "--memory-budget", "1GiB")
    assert code == 2 and "holds no config.json" in err


def test_a_config_that_needs_remote_code_is_refused_in_words(tmp_path):
    folder = write_config(tmp_path / "custom", "llama", auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    with pytest.raises(BadInput, match=r"never runs code from the hub \(trust_remote_code\); write a probe file"):
        autotune.probe(model=str(folder), device="estimate", memory_budget="1GiB", store=False)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    with pytest.raises(BadInput, match="does not know"):
        autotune.probe(model=str(tmp_path / "odd"), device="estimate", memory_budget="1GiB", store=False)


def test_a_model_spec_is_one_string_a_request_carries(tmp_path):
    folder = write_config(tmp_path / "llama", "llama")
    spec = ModelSpec(name=str(folder / "config.json"), seq_len=16, lora="r=8", gradient_checkpointing=True,
                     dtype="bf16-true")
    text = spec.spec()
    assert text.startswith("hf:/") and ModelSpec.parse(text) == spec
    assert "lora=r%3D8%2Calpha%3D32%2Cdropout%3D0.05%2Ctargets%3Dall-linear" in text
    from autotune.planning.requests import probe_request

    assert probe_request(text, device="cpu").workload == text
    with pytest.raises(BadInput, match="workload and model"):
        autotune.probe("mlp", model=str(folder))


@pytest.mark.parametrize("padding,seq_len,width,real", [("longest", 12, 12, [12, 12]), ("longest", 20, 20, [20, 12]),
                                                        ("max", 30, 30, [30, 12])])
def test_lengths_from_a_file_pad_as_asked(tmp_path, padding, seq_len, width, real):
    folder = write_config(tmp_path / "llama", "llama")
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("text_id,length\n1,5\n2,12\n3,40\n4,3\n")
    workload = load_workload(ModelSpec(name=str(folder), lengths=str(lengths), seq_len=seq_len,
                                       padding=padding).spec())
    batch = workload.make_batch(2, torch.Generator().manual_seed(0))  # the worst case: the longest samples
    assert batch["input_ids"].shape == (2, width)
    assert batch["attention_mask"].sum(1).tolist() == real  # 40 tokens truncated at seq_len
    assert workload.count_items(batch) == sum(n - 1 for n in real)
    jsonl = tmp_path / "lengths.jsonl"
    jsonl.write_text('{"length": 7}\n{"length": 9}\n')
    assert load_workload(ModelSpec(name=str(folder), lengths=str(jsonl)).spec()).facts().seq_len == 9


def test_a_spec_reads_no_relative_path_but_a_user_s_folder_becomes_absolute(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from autotune.results.model import workload_or_model
    from autotune.workload.hf import config_file

    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "org" / "name", "llama")
    assert workload_or_model(None, "org/name") == f"hf:{tmp_path}/org/name"  # the user's folder, here
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert ModelSpec.parse("hf:org/name").name == "org/name"
    with pytest.raises(BadInput, match="not in the Hugging Face cache"):  # a spec's name is the hub's
        config_file(ModelSpec.parse("hf:org/name").name)
    with pytest.raises(BadInput, match="neither an existing folder"):
        ModelSpec.parse("hf:../etc")


#: Llama-3.1-8B's public config (what its config.json says of the shapes).
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=False)


@pytest.mark.slow
def test_an_8b_config_is_counted_and_estimated_without_its_memory(tmp_path):
    import resource

    folder = tmp_path / "llama-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(transformers.LlamaConfig(**LLAMA_8B,
                                                                            architectures=["LlamaForCausalLM"]).to_dict()))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = autotune.probe(model=ModelSpec(name=str(folder), seq_len=256, dtype="bf16", lora="r=16"),
                            device="estimate:H100-80GB", max_batch=2, store=False)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB on Linux
    assert result.model is not None and result.model.total_parameters == 8_030_261_248 + 41_943_040
    assert result.model.trainable_parameters == 41_943_040 and result.max_micro_batch == 2
    assert result.model.dtype == "bf16"  # the weights'; LoRA's adapters stay fp32
    assert result.peak_bytes > 16 * 2**30 > 4 * grown  # 16 GB of bf16 weights on the device, none on the host


def test_a_model_by_name_is_kept_in_the_plan_store(tmp_path):
    folder = write_config(tmp_path / "llama", "llama")
    asked = dict(model=ModelSpec(name=str(folder), seq_len=16), device="estimate", memory_budget="720MiB",
                 max_batch=8, store=f"sqlite:///{tmp_path / 'plans.db'}")
    first, second = autotune.probe(**asked), autotune.probe(**asked)
    assert not first.from_store and second.from_store and first.fingerprint == second.fingerprint
    assert second.model == first.model and second.max_micro_batch == first.max_micro_batch


@pytest.mark.parametrize("dtype,built", [(None, torch.bfloat16), ("fp32", torch.float32), ("16-true", torch.float16)])
def test_the_weights_are_in_the_configs_dtype_unless_told(tmp_path, dtype, built):
    folder = write_config(tmp_path / "llama", "llama", dtype="bfloat16")
    workload = load_workload(ModelSpec(name=str(folder), seq_len=8, dtype=dtype).spec())
    assert {p.dtype for p in workload.make_model().parameters()} == {built}
    facts = workload.facts()
    size = torch.empty((), dtype=built).element_size()
    names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
    assert facts.formula_weights_bytes == size * facts.total_parameters and facts.dtype == names[built]


def _lengths_file(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.csv"
    path.write_text("length\n" + "\n".join(str(8 + (i * 37) % 57) for i in range(200)))
    return path


def test_packed_samples_are_one_row_as_the_flattening_collator_makes_it(tmp_path):
    """padding packed: DataCollatorWithFlattening's row of the n longest samples; split into micro-batches
    packed again; the model's logits of a sample in the row are those of the sample alone (no cache: attention
    stays inside each sample)."""
    folder = write_config(tmp_path / "llama", "llama")
    workload = load_workload(ModelSpec(name=str(folder), lengths=str(_lengths_file(tmp_path)),
                                       padding="packed").spec())
    batch = workload.make_batch(3, torch.Generator().manual_seed(0))
    assert batch["input_ids"].shape == (1, 3 * 64) and batch["cu_seq_lens_q"].tolist() == [0, 64, 128, 192]
    assert workload.count_items(batch) == 3 * 63 and workload.count_tokens(batch) == 192
    parts = workload.split(batch, [1, 2])
    assert [workload.samples(p) for p in parts] == [1, 2] and parts[1]["position_ids"][0, 64] == 0
    row = workload.lengths_batch([5, 9], torch.Generator().manual_seed(1))
    assert row["position_ids"].tolist() == [list(range(5)) + list(range(9))] and (row["labels"] == -100).sum() == 2
    model = workload.make_model()
    alone = model(input_ids=row["input_ids"][:, 5:]).logits
    assert torch.allclose(model(**row).logits[:, 5:], alone, atol=1e-5)


def test_packing_is_for_a_causal_lm(tmp_path):
    folder = write_config(tmp_path / "bert", "bert")
    with pytest.raises(BadInput, match="padding packed concatenates a causal LM's samples into one row, and .* is "
                                       "built for masked-lm: give padding longest or max"):
        load_workload(ModelSpec(name=str(folder), padding="packed").spec())


@pytest.mark.slow
def test_a_packed_plan_says_what_packing_saves_against_padding(tmp_path, capsys):
    folder = write_config(tmp_path / "llama", "llama")
    code, out, _ = run_cli(capsys, "plan", "--target-batch", "64", "--model", str(folder), "--lengths",
                           str(_lengths_file(tmp_path)), "--padding", "packed", "--device", "estimate",
                           "--memory-budget", "700MiB", "--json")
    notes = [n for n in json.loads(out)["notes"] if n.startswith("packing")]
    assert code == 0 and len(notes) == 1, out
    assert re.search(r"micro-batches of up to \d+ samples, against \d+ padded to the longest; at \d+: peak "
                     r"[\d.]+ MiB packed, [\d.]+ MiB padded: packing (saves|takes) [\d.]+ [KM]iB", notes[0])


@pytest.mark.slow
def test_a_packed_llama_is_probed_within_one_sample_of_a_real_bisection(tmp_path):
    """--padding packed on the CPU: the estimate's answer, confirmed, against doubling and bisection by real runs
    of the fit rule alone; at most 2 real runs, none out of memory."""
    from autotune.devices import get_device
    from autotune.probing.finder import find_max_micro_batch

    from ..helpers import exhaustive_max

    folder = write_config(tmp_path / "llama", "llama")
    workload = load_workload(ModelSpec(name=str(folder), lengths=str(_lengths_file(tmp_path)),
                                       padding="packed").spec())
    device = get_device("cpu", memory_budget=8 * 2**20)
    result = find_max_micro_batch(workload, device, max_batch=256)
    expected = exhaustive_max(workload, device, result.usable_bytes, 256)
    assert 4 < expected < 256  # memory, not the limit, decides
    assert abs(result.max_micro_batch - expected) <= 1
    assert result.real_runs <= 2 and result.real_ooms == 0
    assert not [t for t in result.trials if t.source == "real" and not t.fits]  # no miss


@pytest.mark.parametrize("dtype,autocast", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_precision_is_fp32_weights_and_the_forward_under_autocast(tmp_path, dtype, autocast):
    folder = write_config(tmp_path / "llama", "llama", dtype="bfloat16")
    workload = load_workload(ModelSpec(name=str(folder), seq_len=8, dtype=dtype).spec())
    model = workload.make_model()
    assert {p.dtype for p in model.parameters()} == {torch.float32} and workload.facts().dtype == "fp32"
    seen: list[torch.dtype] = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    loss = workload.loss(model, workload.make_batch(2, torch.Generator().manual_seed(0)))
    loss.backward()
    assert seen == [autocast] and all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow
def test_bf16_mixed_on_a_gpu_estimate_holds_bf16_activations_beside_fp32_weights(tmp_path):
    folder = write_config(tmp_path / "llama", "llama")
    asked = dict(device="estimate:A10G-24GB", memory_budget="700MiB", store=False)
    probes = {dtype: autotune.probe(model=ModelSpec(name=str(folder), seq_len=64, dtype=dtype), **asked)
              for dtype in ("fp32", "bf16-mixed", "bf16")}
    batches = {dtype: p.max_micro_batch for dtype, p in probes.items()}
    assert batches["fp32"] < batches["bf16-mixed"] <= batches["bf16"], batches
    assert probes["bf16-mixed"].model is not None and probes["bf16-mixed"].model.dtype == "fp32"


def test_qlora_holds_nf4_base_weights_by_shape_and_counts_as_peft_does(tmp_path):
    from autotune.workload.qlora import Linear4bit

    folder = write_config(tmp_path / "llama", "llama", dtype="bfloat16")
    lora = load_workload(ModelSpec(name=str(folder), seq_len=8, lora="r=4").spec())
    qlora = load_workload(ModelSpec(name=str(folder), seq_len=8, lora="r=4,bits=4").spec())
    facts, plain = qlora.facts(), lora.facts()
    assert (facts.total_parameters, facts.trainable_parameters) == (plain.total_parameters, plain.trainable_parameters)
    model = qlora.make_model()
    linears = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert len(linears) == 2 * 7 and not any(isinstance(m, Linear4bit) for m in [model.get_output_embeddings()])
    packed = sum(m.in_features * m.out_features for m in linears)
    assert sum(m.weight.numel() for m in linears) == packed // 2 and {m.weight.dtype for m in linears} == {torch.uint8}
    rest = [p for n, p in model.named_parameters() if p.dtype != torch.uint8]
    assert {p.dtype for p in rest} == {torch.float32}  # embeddings, norms, head and adapters: fp32
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if "lora_" in n}
    assert facts.dtype == "nf4" and facts.formula_weights_bytes == packed // 2 + 4 * sum(p.numel() for p in rest)
    loss = qlora.loss(model, qlora.make_batch(2, torch.Generator().manual_seed(0)))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_qlora_estimate_is_what_a_real_cpu_run_measures_and_below_lora(tmp_path):
    folder = write_config(tmp_path / "llama", "llama", dtype="bfloat16")
    result = autotune.probe(model=ModelSpec(name=str(folder), seq_len=32, lora="r=4,bits=4"), device="cpu",
                            memory_budget="4MiB", store=False)
    real = [t for t in result.trials if t.source == "real"]
    estimated = {t.batch: t.peak_bytes for t in result.trials if t.source == "estimate"}
    assert len(real) == 1 and real[0].fits and real[0].peak_bytes == estimated[real[0].batch]
    bits = ("", ",bits=4")
    # the 8B's counts (the facts a probe reports, from its config alone): 6.98B weights in 4 bits (3.49 GB),
    # embeddings and head in fp32 (4.20 GB), the adapters (0.17 GB)
    llama = _bf16_llama(tmp_path / "8b", LLAMA_8B)
    facts = {b: load_workload(ModelSpec(name=str(llama), seq_len=256, lora="r=16" + b).spec()).facts() for b in bits}
    assert facts[",bits=4"].formula_weights_bytes == 3_489_660_928 + 2 * 2_101_346_304 + 167_772_160 + 1_064_960
    assert facts[",bits=4"].total_parameters == facts[""].total_parameters == 8_030_261_248 + 41_943_040
    # the estimates on 12 of its 32 layers (the 4-bit layers outweigh the fp32 embeddings from about 7 layers on)
    short = _bf16_llama(tmp_path / "12-layers", {**LLAMA_8B, "num_hidden_layers": 12})
    probes = {b: autotune.probe(model=ModelSpec(name=str(short), seq_len=256, lora="r=16" + b),
                                device="estimate:A10G-24GB", max_batch=1, store=False) for b in bits}
    weights = probes[",bits=4"].model
    assert weights is not None and weights.formula_weights_bytes < probes[",bits=4"].peak_bytes < probes[""].peak_bytes


def _bf16_llama(folder: Path, config: dict) -> Path:
    """A folder holding a bf16 Llama's config.json."""
    folder.mkdir()
    made = transformers.LlamaConfig(**config, architectures=["LlamaForCausalLM"]).to_dict()
    (folder / "config.json").write_text(json.dumps({**made, "dtype": "bfloat16"}))
    return folder


def test_lora_under_mixed_precision_keeps_the_frozen_weights_in_the_configs_dtype(tmp_path):
    folder = write_config(tmp_path / "llama", "llama", dtype="bfloat16")
    workload = load_workload(ModelSpec(name=str(folder), seq_len=8, dtype="bf16-mixed", lora="r=4").spec())
    model = workload.make_model()
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16} and workload.facts().dtype == "bf16"
    seen: list[torch.dtype] = []
    model.base_model.model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    workload.loss(model, workload.make_batch(2, torch.Generator().manual_seed(0))).backward()
    assert seen == [torch.bfloat16]


@pytest.mark.slow
def test_format_hf_prints_the_trainer_settings_that_train_the_model_as_planned(tmp_path, capsys):
    import peft

    folder = write_config(tmp_path / "llama", "llama")
    code, out, err = run_cli(capsys, "plan", "--model", str(folder), "--seq-len", "16", "--target-batch", "64",
                             "--device", "estimate", "--memory-budget", "1GiB", "--format", "hf", "--quiet",
                             "--lora", "r=8,targets=q_proj+v_proj,bits=4", "--dtype", "bf16-mixed",
                             "--gradient-checkpointing", "--optimizer", "adafactor")
    assert code == 0, err
    data = json.loads(out)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                          **data["training_arguments"])
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64
    assert args.bf16 and not args.fp16 and args.optim == "adafactor" and args.gradient_checkpointing
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    lora = peft.LoraConfig(**data["lora_config"])
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, set(lora.target_modules)) == (8, 32, 0.05, {"q_proj", "v_proj"})
    assert data["from_pretrained"] == {"dtype": "auto", "quantization_config": {
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "bfloat16"}}
    code, out, err = run_cli(capsys, "plan", "--model", str(folder), "--seq-len", "16", "--target-batch", "64",
                             "--device", "estimate", "--memory-budget", "1GiB", "--format", "hf", "--quiet",
                             "--dtype", "bf16-true")
    assert code == 0 and set(json.loads(out)) == {"training_arguments", "from_pretrained"}, err
    assert json.loads(out)["from_pretrained"] == {"dtype": "bfloat16"}
    assert json.loads(out)["training_arguments"]["optim"] == "adamw_torch"
