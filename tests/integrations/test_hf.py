"""The Hugging Face Trainer, for real on the CPU: planned TrainingArguments train, probed at the worst case."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import autotune  # noqa: E402
from autotune.devices import get_device  # noqa: E402
from autotune.errors import BadInput, PlanError  # noqa: E402
from autotune.integrations.hf import plan_training_args, trainer_optimizer, trainer_workload, worst_case_batch  # noqa: E402
from autotune.probing.fitrule import fit_rule_work  # noqa: E402
from autotune.units import parse_size  # noqa: E402

from .hf_models import LENGTHS, Forwarding, collate, examples, gpt2  # noqa: E402

BUDGET = "6MiB"  # the tiny GPT-2 fits 45 examples of 12 tokens, 6 of 64
TARGET = 24


@pytest.fixture(autouse=True)
def quiet():
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def training_args(tmp_path, **kwargs) -> TrainingArguments:
    settings = dict(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=2,
                    save_strategy="no", disable_tqdm=True, learning_rate=1e-3, weight_decay=0.1)
    return TrainingArguments(**(settings | kwargs))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    model, data, args = gpt2(), examples(LENGTHS), training_args(tmp)
    new, plan = plan_training_args(args, model, data, target_batch=TARGET, data_collator=collate, device="cpu",
                                   memory_budget=BUDGET)
    return model, data, args, new, plan


@pytest.mark.slow
def test_planned_arguments_give_the_target_and_train(planned):
    model, data, args, new, plan = planned
    assert plan.uniform and plan.arithmetic == "24 = 6 x 4 steps x 1 rank"
    assert (new.per_device_train_batch_size, new.gradient_accumulation_steps) == (6, 4)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)  # the user's, untouched
    unchanged = {f.name for f in dataclasses.fields(args)} - {"per_device_train_batch_size",
                                                               "gradient_accumulation_steps"}
    assert all(getattr(new, name) == getattr(args, name) for name in unchanged)
    fed: list[int] = []  # examples per forward: the loader prefetches, the model sees what trains
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(len(kw["input_ids"])), with_kwargs=True)
    trainer = Trainer(model=model, args=new, train_dataset=data, data_collator=collate)
    trainer.train()
    hook.remove()
    assert trainer.state.global_step == 2 and fed == [6] * 8  # 2 optimizer steps of exactly 24 examples


@pytest.mark.slow
def test_a_typical_batch_picks_a_size_that_runs_out_of_memory_on_the_longest(planned):
    model, data, args, _, plan = planned
    device = get_device("cpu", memory_budget=parse_size(BUDGET))
    typical = trainer_workload(args, model, collate(data[:8]))  # what a probe on the first batch sees
    typical_max = autotune.probe(typical, device=device, max_batch=64).max_micro_batch
    worst = trainer_workload(args, model, worst_case_batch(data, collate))
    assert plan.micro_batch < TARGET <= typical_max  # the typical probe would train 24 at once
    with pytest.raises(torch.OutOfMemoryError):  # and the first long batch of 24 runs out of memory
        device.measure(fit_rule_work(worst, TARGET))
    _, measured = device.measure(fit_rule_work(worst, plan.micro_batch))  # the planned size fits the longest
    assert measured.peak_bytes <= plan.probe.usable_bytes


def test_the_worst_case_is_the_longest_examples_as_the_collator_pads_them():
    data = examples([5, 9, 30, 7, 30, 12])
    batch = worst_case_batch(data, collate, columns={"input_ids"})
    assert batch["input_ids"].shape == (6, 30)  # every example, longest first, padded to 30
    assert batch["input_ids"][0].tolist() == data[2]["input_ids"]  # the first of the longest first
    with pytest.raises(BadInput, match="train_dataset is empty"):
        worst_case_batch([], collate)


def test_columns_the_trainer_drops_are_named_when_the_collator_is_left_without_them(tmp_path):
    """A forward(*args, **kwargs) names no column: the Trainer's remove_unused_columns drops them all, and the
    error says which and why, before any probe."""
    model, data, args = Forwarding(gpt2().config), examples([5, 6]), training_args(tmp_path)
    assert next(iter(Trainer(model=model, args=args, train_dataset=data).get_train_dataloader())) == {}  # the Trainer's
    every = (r"^remove_unused_columns drops every column of train_dataset \(input_ids, source\): the Trainer keeps "
             r"only the parameters of Forwarding\.forward\(\*args, \*\*kwargs\) and the label names \(args, kwargs, "
             r"label, label_ids\); set remove_unused_columns=False")
    with pytest.raises(BadInput, match=every):
        plan_training_args(args, model, data, target_batch=8, device="cpu", memory_budget=BUDGET)
    labelled = [{**e, "label": 0} for e in data]  # a column kept, the ones the collator needs dropped
    failed = (r"^data_collator failed \(KeyError: 'input_ids'\) on examples without the columns "
              r"remove_unused_columns drops \(input_ids, source\): the Trainer keeps only")
    with pytest.raises(BadInput, match=failed):
        plan_training_args(args, model, labelled, target_batch=8, data_collator=collate, device="cpu",
                           memory_budget=BUDGET)


@pytest.mark.slow
def test_a_dataset_smaller_than_one_effective_batch_is_a_warning_and_a_note(tmp_path):
    """3 examples, target 64: the Trainer steps at the end of each epoch, on 3 examples; the plan says so."""
    model, data = gpt2(), examples([12] * 3)
    with pytest.warns(UserWarning, match=r"^the dataset holds 3 samples, fewer than one effective batch of 64: the "
                      r"Trainer steps at the end of every epoch, so no optimizer step sees more than 3; plan a target "
                      r"of at most 3, or train on more data$") as caught:
        new, plan = plan_training_args(training_args(tmp_path), model, data, target_batch=64, data_collator=collate,
                                       device="cpu", memory_budget=BUDGET)
    assert len(caught) == 1 and plan.notes[-1] == str(caught[0].message) and plan.notes[-1] in plan.summary()
    fed: list[int] = []
    model.register_forward_pre_hook(lambda m, a, kw: fed.append(len(kw["input_ids"])), with_kwargs=True)
    trainer = Trainer(model=model, args=new, train_dataset=data, data_collator=collate)
    trainer.train()
    assert trainer.state.global_step == 2 and fed == [3, 3]  # what the warning says: 3 examples a step
    from autotune.integrations.common import short_dataset

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert short_dataset(plan, examples([12] * 64), "the Trainer") is plan  # one batch's worth: no word


def test_the_probe_builds_the_trainers_optimizer(tmp_path):
    model = gpt2()
    args = training_args(tmp_path, optim="adamw_torch", adam_beta2=0.95)
    theirs = Trainer(model=model, args=args, train_dataset=examples([4]), data_collator=collate).create_optimizer()
    copy = trainer_workload(args, model, collate(examples([4, 4]))).make_model()
    ours = trainer_optimizer(args, model)(copy.parameters())
    assert type(ours) is type(theirs) and len(ours.param_groups) == len(theirs.param_groups) == 2
    names = {id(p): n for n, p in model.named_parameters()} | {id(p): n for n, p in copy.named_parameters()}
    for mine, trainers in zip(ours.param_groups, theirs.param_groups):
        assert [names[id(p)] for p in mine["params"]] == [names[id(p)] for p in trainers["params"]]
        assert {k: v for k, v in mine.items() if k != "params"} == {k: v for k, v in trainers.items() if k != "params"}
    assert not any(p is q for p in copy.parameters() for q in model.parameters())


def test_the_probe_trains_as_the_trainer_would(tmp_path):
    model = gpt2()
    batch = collate(examples([6, 6]))
    checkpointed = trainer_workload(training_args(tmp_path, activation_checkpointing=True), model, batch)
    assert checkpointed.make_model().is_gradient_checkpointing and not model.is_gradient_checkpointing
    seen: list[torch.dtype] = []
    probe_model = trainer_workload(training_args(tmp_path, bf16=True), model, batch).make_model()
    probe_model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    trainer_workload(training_args(tmp_path, bf16=True), model, batch).loss(probe_model, batch)
    assert seen == [torch.bfloat16]


@pytest.mark.slow
def test_a_target_with_no_equal_split_names_the_nearest(tmp_path):
    # Sized for a GPU by the estimate alone: about twenty examples of 64 tokens fit, and 1021 is prime.
    with pytest.raises(PlanError, match=r"the Hugging Face Trainer runs equal micro-batches, and target_batch 1021 "
                                        r"does not split .* use target_batch 1020 \(.*\) or 10\d\d \("):
        plan_training_args(training_args(tmp_path), gpt2(), examples(LENGTHS), target_batch=1021,
                           data_collator=collate, device="estimate", memory_budget="680MiB")


def test_an_estimate_for_a_gpu_runs_the_trainers_bf16_as_cudas_autocast(tmp_path):
    workload = trainer_workload(training_args(tmp_path, bf16=True), gpt2(), collate(examples([6, 6])))
    seen: list[torch.dtype] = []

    def hooked(**kwargs):
        made = workload.model(**kwargs)
        made.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        return made

    device = get_device("estimate:A10G-24GB")
    device.measure(fit_rule_work(dataclasses.replace(workload, model=hooked), 2))
    assert seen and set(seen) == {torch.bfloat16}  # on meta tensors, as on the GPU
    assert device.fallback is None


def _llama(use_cache: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        use_cache=use_cache))


@pytest.mark.slow
def test_a_flattening_collator_plans_examples_packed_into_one_row_and_trains(tmp_path):
    """DataCollatorWithFlattening: a micro-batch is per_device_train_batch_size examples in one row. The probe's
    micro-batches are the longest examples packed (one row, position ids restarting), the plan exact, and the
    Trainer trains by it; a model with a cache is told that SDPA would attend across the examples."""
    from transformers import DataCollatorWithFlattening

    from autotune.integrations.packed import is_packed, packed_workload

    flat, data = DataCollatorWithFlattening(), [{"input_ids": e["input_ids"]} for e in examples(LENGTHS)]
    model, args = _llama(use_cache=False), training_args(tmp_path, remove_unused_columns=False)
    batch = worst_case_batch(data, flat)
    assert is_packed(batch) and batch["input_ids"].shape == (1, 4 * 64 + 4 * 12)
    workload = packed_workload(trainer_workload(args, model, batch), batch)
    micro = workload.make_batch(6, torch.Generator())
    assert micro["input_ids"].shape == (1, 4 * 64 + 2 * 12) and workload.count_items(micro) == 4 * 63 + 2 * 11
    new, plan = plan_training_args(args, model, data, target_batch=TARGET, data_collator=flat, device="cpu",
                                   memory_budget="24MiB")
    assert new.per_device_train_batch_size * new.gradient_accumulation_steps == TARGET
    assert plan.max_micro_batch > 1 and not any("use_cache" in n for n in plan.notes)
    Trainer(model=model, args=new, train_dataset=data, data_collator=flat).train()
    _, cached = plan_training_args(args, _llama(use_cache=True), data, target_batch=TARGET, data_collator=flat,
                                   device="cpu", memory_budget="24MiB")
    assert any("set model.config.use_cache = False" in n for n in cached.notes)
