"""The probe: exact max on the CPU, few real runs, honest when the estimate is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autotune.devices import get_device
from autotune.errors import DoesNotFit, WorkloadError
from autotune.options import usable_bytes
from autotune.probing.finder import find_max_micro_batch
from autotune.results.probe import ProbeResult
from autotune.units import format_bytes
from autotune.workload import Workload

from ..helpers import autocast_workload, true_max


@pytest.mark.parametrize("budget", [2_400_000, 3_200_000, 5_000_000])
def test_mlp_max_equals_exhaustive_real_bisection(mlp, budget):
    device = get_device("cpu", memory_budget=budget)
    result = find_max_micro_batch(mlp, device, max_batch=2048)
    expected, _ = true_max(mlp, device, result.usable_bytes, 2048)
    assert result.max_micro_batch == expected
    # The estimate is exact on the CPU: one real run, at the answer.
    assert result.real_runs == 1 and result.real_ooms == 0
    assert result.estimate_error == 0.0
    assert result.peak_bytes <= result.usable_bytes
    assert result.limited_by == "memory" and not result.estimated


@pytest.mark.slow
def test_gpt_max_equals_exhaustive_real_bisection(gpt):
    device = get_device("cpu", memory_budget=10 * 2**20)
    result = find_max_micro_batch(gpt, device, max_batch=32)
    expected, _ = true_max(gpt, device, result.usable_bytes, 32)
    assert 1 < expected < 32  # memory, not the limit, decides
    assert result.max_micro_batch == expected
    assert result.real_runs == 1 and result.real_ooms == 0


def test_trials_table_shows_the_runs(mlp):
    result = find_max_micro_batch(mlp, get_device("cpu", memory_budget=4_000_000), max_batch=4096)
    t = result.trials
    assert {x.source for x in t} == {"estimate", "real"}
    # The lines through 2 and 3 guess the max, one estimate there checks them, one real run confirms it.
    assert [x.batch for x in t if x.source == "estimate"] == [2, 3, result.max_micro_batch]
    assert all(x.seconds > 0 for x in t)
    assert [x.batch for x in t if x.source == "real"] == [result.max_micro_batch]


def test_whole_batch_fits_is_limited_by_max_batch(mlp):
    result = find_max_micro_batch(mlp, get_device("cpu", memory_budget=2**30), max_batch=64)
    assert result.max_micro_batch == 64 and result.limited_by == "max_batch"


def test_micro_batch_one_too_big_says_what_it_needs(mlp):
    with pytest.raises(DoesNotFit, match=r"micro-batch 1 needs .* usable memory is .*bf16.*checkpointing"):
        find_max_micro_batch(mlp, get_device("cpu", memory_budget=1_000_000))


def test_non_oom_error_stops_the_probe_with_the_batch_size():
    def loss(model, batch):
        if batch.shape[0] > 8:
            raise ValueError("index out of range in my loss")
        return model(batch).mean()

    w = Workload(name="flaky", model=lambda: nn.Linear(4, 4), batch=lambda n, g: torch.randn(n, 4, generator=g),
                 loss=loss)
    with pytest.raises(WorkloadError, match=r"workload 'flaky' failed at micro-batch (9|\d\d+).*ValueError: "
                                            r"index out of range in my loss") as info:
        find_max_micro_batch(w, get_device("cpu", memory_budget=2**30), max_batch=1000)
    assert info.value.batch > 8 and "does not fit" not in str(info.value)


def test_users_model_and_optimizer_untouched():
    torch.manual_seed(3)
    user_model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    user_opt = torch.optim.AdamW(user_model.parameters())
    user_model(torch.randn(4, 8)).sum().backward()
    user_opt.step()
    before = {k: v.clone() for k, v in user_model.state_dict().items()}
    grads = [p.grad.clone() for p in user_model.parameters()]
    opt_before = [v.clone() for s in user_opt.state.values() for v in s.values()]
    rng = torch.get_rng_state()
    w = Workload(name="shared", model=lambda: user_model, batch=lambda n, g: torch.randn(n, 8, generator=g),
                 loss=lambda m, b: m(b).pow(2).mean())
    find_max_micro_batch(w, get_device("cpu", memory_budget=300_000), max_batch=256)
    for k, v in user_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(user_model.parameters(), grads))
    opt_after = [v for s in user_opt.state.values() for v in s.values()]
    assert len(opt_after) == len(opt_before) and all(map(torch.equal, opt_after, opt_before))
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.slow
def test_estimate_device_marks_the_result(gpt):
    result = find_max_micro_batch(gpt, get_device("estimate", memory_budget=700 * 2**20), max_batch=4096)
    assert result.estimated and result.real_runs == 0
    assert any("not confirmed" in n for n in result.notes)
    assert result.device.summary.startswith("estimate for") and "CUDA context" in result.device.summary
    assert "(estimated, not confirmed on a real device" in result.summary()  # said once, not in the device too
    assert result.summary().count("not confirmed") == 1
    assert result.peak_bytes <= result.usable_bytes


def test_json_round_trip(mlp):
    result = find_max_micro_batch(mlp, get_device("cpu", memory_budget=4_000_000), max_batch=512)
    data = json.loads(json.dumps(result.to_dict()))
    again = ProbeResult.from_dict(data)
    assert again == result
    assert again.to_dict() == result.to_dict()
    assert again.trials == result.trials


# -- an estimate that misses memory ------------------------------------------------------

EXTRA = 512  # floats per sample the real kernel keeps that the fake kernel does not declare


@torch.library.custom_op("autotune_test::hungry", mutates_args=())
def hungry(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    workspace = torch.zeros(x.shape[0], EXTRA)  # a fused kernel's buffer, kept for backward
    return x.clone(), workspace


@hungry.register_fake
def _(x):
    return torch.empty_like(x), x.new_empty(0)  # the fake kernel forgets the buffer


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


hungry.register_autograd(lambda ctx, grad, _grad_ws: grad, setup_context=_setup)


class Hungry(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.b(hungry(torch.relu(self.a(x)))[0])


@pytest.mark.slow
def test_estimate_that_misses_memory_is_caught_and_the_exact_max_found():
    w = Workload(name="hungry", model=Hungry, batch=lambda n, g: torch.randn(n, 32, generator=g),
                 loss=lambda m, b: m(b).pow(2).mean())
    device = get_device("cpu", memory_budget=6_000_000)
    result = find_max_micro_batch(w, device, max_batch=8192)
    expected, _ = true_max(w, device, usable_bytes(device.capacity_bytes(), 0.1), 8192)
    assert result.max_micro_batch == expected
    # Its max runs out of memory; one real run where the estimate grows with the batch measures the
    # memory it misses, and the corrected estimate goes straight to the answer.
    assert result.real_runs <= 4 and sum(not t.fits for t in result.trials if t.source == "real") <= 2
    assert result.estimate_error > 0.05  # real peak above the estimate, reported
    assert any("under-counted" in n and "searched on the real device" in n for n in result.notes)
    said = [n for n in result.notes if "the estimate said" in n]
    assert said and int(said[0].rsplit(" ", 1)[1]) > expected  # the estimate alone would have been wrong


@pytest.mark.slow
def test_a_workload_the_meta_engine_cannot_run_is_estimated_under_fake_tensors_and_says_so():
    workload = autocast_workload()
    device = get_device("cpu", memory_budget=3_000_000)
    result = find_max_micro_batch(workload, device, max_batch=4096)
    expected, _ = true_max(workload, device, result.usable_bytes, 4096)
    assert result.max_micro_batch == expected
    assert result.real_runs == 1 and result.real_ooms == 0
    # The timelines at 2 and 3 pair up point by point however autocast's cache frees its casts: the lines
    # through them are right at the first guess.
    assert [t.batch for t in result.trials if t.source == "estimate"] == [2, 3, expected]
    assert any("estimated under FakeTensorMode" in n and "autocast" in n for n in result.notes)


def test_a_note_every_evaluation_makes_is_said_once_with_the_answers_figure():
    """The convnet's estimate notes the cuDNN workspaces it counts as 0 bytes at each size it evaluates (2, 3
    and the answer, each its own figure): the probe says it once, with the figure at the max micro-batch."""
    from autotune.workload import load_workload

    result = find_max_micro_batch(load_workload("convnet"), get_device("estimate", memory_budget=2**30))
    (cudnn,) = [n for n in result.notes if n.startswith("cuDNN convolution workspaces counted as 0 bytes")]
    at_answer = result.trials[[t.batch for t in result.trials].index(result.max_micro_batch)]
    assert at_answer.source == "estimate" and {t.batch for t in result.trials} == {2, 3, result.max_micro_batch}
    assert len(result.notes) == len(set(result.notes)) and len(result.notes) < 10, result.notes
    assert "(44.0 MiB)" in cudnn, cudnn


@pytest.mark.slow  # Inductor compiles C++ for the CPU, once (a dynamic batch size): seconds to a minute on 2 cores
@pytest.mark.skipif(__import__("shutil").which("gcc") is None, reason="Inductor on the CPU needs gcc: none on PATH")
def test_a_compiled_model_is_estimated_eager_and_confirmed_compiled_and_the_probe_says_both():
    from ..devices.compiled_net import compiled_net, workload

    compiled = workload(compiled_net)
    result = find_max_micro_batch(compiled, get_device("cpu", memory_budget=2**22), margin=0.1)
    assert any(t.source == "real" for t in result.trials)
    (eager,) = [n for n in result.notes if n.startswith("the model is compiled (torch.compile): estimated as its "
                                                         "eager program")]
    # its figures are the estimate's nearest the (real) answer, not the first evaluation's at micro-batch 2
    nearest = min((t for t in result.trials if t.source == "estimate"),
                  key=lambda t: abs(t.batch - result.max_micro_batch))
    assert nearest.batch > 3 and f" of {format_bytes(nearest.peak_bytes)} (" in eager, (nearest, eager)
    assert any(n.startswith("the model ran compiled (torch.compile)") for n in result.notes), result.notes
    assert result.peak_bytes <= result.usable_bytes


@pytest.mark.slow
@pytest.mark.parametrize("budget,world", [(720 * 2**20, None), (900 * 2**20, None), (720 * 2**20, 2)])
def test_standing_in_for_a_gpu_the_size_past_the_answer_is_replayed_from_the_trace_lines(gpt, budget, world,
                                                                                          monkeypatch):
    """Issue 40, item 4: the allocation traces at 2 and 3 are lines in the batch size; their replay through the
    allocator simulation gives the size to evaluate, and once its evaluated trace lies on them to the byte the
    size past it is replayed, not evaluated: three evaluations, the same answer as evaluating every size (under
    FSDP over ``world`` ranks too)."""
    from autotune.probing import tracelines
    from autotune.probing.fitrule import run_trial
    from autotune.probing.fsdp import Sharding

    sharding = Sharding(world) if world else None
    device = get_device("estimate", memory_budget=budget)
    result = find_max_micro_batch(gpt, device, max_batch=512, sharding=sharding)
    found = result.max_micro_batch
    assert [t.batch for t in result.trials] == [2, 3, found]
    assert device.estimator().engine == "meta" and not any("FakeTensorMode" in n for n in result.notes)
    assert any(n.startswith(f"micro-batch {found + 1} was not evaluated") for n in result.notes), result.notes

    monkeypatch.setattr(tracelines.TraceLines, "through", classmethod(lambda cls, *a: None))
    evaluated = find_max_micro_batch(gpt, device, max_batch=512, sharding=sharding)
    assert evaluated.max_micro_batch == found and len(evaluated.trials) > 3
    # The evaluation past the answer: its trace is the lines' to the byte, and it does not fit.
    engine = device  # the probe's engine, FSDP's too
    traces = {b: run_trial(engine, gpt, b, result.usable_bytes, source="estimate", capacity_guard=False,
                           sharding=sharding) for b in (2, 3, found + 1)}
    monkeypatch.undo()
    lines = tracelines.TraceLines.through(2, traces[2].measurement.trace, 3, traces[3].measurement.trace)
    assert lines is not None and lines.hold(found + 1, traces[found + 1].measurement.trace)
    assert not traces[found + 1].fits
    assert engine.replay(lines.at(found + 1)).reserved_peak == traces[found + 1].peak_bytes


def test_trace_lines_are_none_where_the_traces_are_not_lines():
    from autotune.probing.tracelines import TraceLines

    two = [(1, 200, 0), (2, 64, 0), (1, -1, 0)]
    three = [(1, 300, 0), (2, 64, 0), (1, -1, 0)]
    lines = TraceLines.through(2, two, 3, three)
    assert lines is not None and lines.at(5) == [(1, 500, 0), (2, 64, 0), (1, -1, 0)]
    assert lines.hold(5, [(1, 500, 0), (2, 64, 0), (1, -1, 0)]) and not lines.hold(5, [(1, 501, 0), (2, 64, 0),
                                                                                        (1, -1, 0)])
    assert TraceLines.through(2, two, 3, three[:2]) is None  # another number of events
    assert TraceLines.through(2, two, 3, [(1, 300, 0), (3, 64, 0), (1, -1, 0)]) is None  # another key
    assert TraceLines.through(2, two, 3, [(1, 300, 1), (2, 64, 0), (1, -1, 0)]) is None  # another stream
    assert TraceLines.through(2, two, 4, [(1, 301, 0), (2, 64, 0), (1, -1, 0)]) is None  # half a byte a sample
    assert TraceLines.through(2, [(1, 300, 0)], 3, [(1, 200, 0)]).at(5) is None  # shrinks to nothing
    assert TraceLines.through(2, [(1, 0, 0), *two], 3, [(1, 0, 0), *three]).at(5)[0] == (1, 0, 0)  # 0 bytes stay


class InBatch(nn.Module):
    """Every sample against every other: a (B, B) similarity, memory quadratic in the batch."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        z = self.proj(x)
        return (z @ z.T).logsumexp(dim=1).mean()


@pytest.mark.slow
def test_where_the_traces_are_not_lines_the_evaluated_search_decides(monkeypatch):
    """Issue 40, item 4: a (B, B) similarity's allocations are not lines in the batch size; the size the lines
    replayed to is evaluated, off them, and the search evaluates on: the same answer as without the lines."""
    from autotune.probing import tracelines

    w = Workload(name="in-batch", model=InBatch, batch=lambda n, g: torch.randn(n, 64, generator=g),
                 loss=lambda m, b: m(b))
    device = get_device("estimate", memory_budget=(640 + 64) * 2**20)
    result = find_max_micro_batch(w, device, max_batch=8192)
    monkeypatch.setattr(tracelines.TraceLines, "through", classmethod(lambda cls, *a: None))
    evaluated = find_max_micro_batch(w, device, max_batch=8192)
    assert result.max_micro_batch == evaluated.max_micro_batch and 3 < result.max_micro_batch < 8192
    assert not any("was not evaluated" in n for n in result.notes)


def tiny_llama() -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    return Workload(name="llama", model=lambda: LlamaForCausalLM(config),
                    batch=lambda n, g: {"input_ids": (ids := torch.randint(0, 1000, (n, 64), generator=g)),
                                        "labels": ids},
                    loss=lambda net, data: net(**data).loss)


@pytest.mark.slow
@pytest.mark.parametrize("world", [None, 2])
def test_a_hugging_face_llama_standing_in_for_a_gpu_takes_three_evaluations_and_the_same_answer(world,
                                                                                                 monkeypatch):
    """Issue 40, item 4, on a transformers Llama (with FSDP over 2 ranks too): the lines of its allocation
    traces give the answer the search evaluating every size gives, in three evaluations."""
    from autotune.probing import tracelines
    from autotune.probing.fsdp import Sharding

    w, sharding = tiny_llama(), Sharding(world) if world else None
    device = get_device("estimate", memory_budget=(640 + 256) * 2**20)
    result = find_max_micro_batch(w, device, max_batch=4096, sharding=sharding)
    assert 3 < result.max_micro_batch < 4096  # memory decides
    assert [t.batch for t in result.trials] == [2, 3, result.max_micro_batch]
    monkeypatch.setattr(tracelines.TraceLines, "through", classmethod(lambda cls, *a: None))
    evaluated = find_max_micro_batch(w, device, max_batch=4096, sharding=sharding)
    assert evaluated.max_micro_batch == result.max_micro_batch and len(evaluated.trials) > 3
