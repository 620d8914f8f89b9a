"""Exact accumulation: weights, splitting, and the loss trajectory of full-batch training."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from autotune.errors import BadInput
from autotune.training import Batches, GradientNoiseScale, MixedPrecision, NoiseScale, Sync
from autotune.training.accumulate import Accumulator
from autotune.workload.batches import batch_size, item_weight, split_batch


@pytest.mark.parametrize("n,total,world,want", [(3, 12, 1, 0.25), (255, 1021, 1, 255 / 1021), (16, 64, 4, 1.0),
                                                (0, 5, 1, 0.0)])
def test_item_weight(n, total, world, want):
    assert item_weight(n, total, world) == pytest.approx(want)


def test_item_weight_rejects_empty_batches():
    with pytest.raises(ValueError, match="at least 1"):
        item_weight(1, 0)


def test_split_batch_pytree():
    batch = {"x": torch.arange(10).view(10, 1), "y": (torch.arange(10), 3)}
    parts = split_batch(batch, [3, 3, 4])
    assert [batch_size(p) for p in parts] == [3, 3, 4]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert parts[2]["y"][1] == 3
    with pytest.raises(ValueError, match="sums to 9 but the batch holds 10"):
        split_batch(batch, [3, 3, 3])


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(step: int, n: int = 64):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("sizes", [[16, 16, 16, 16], [21, 21, 22], [64]])
def test_loss_trajectory_equals_full_batch_training(sizes):
    plain, planned = _mlp(), _mlp()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_planned = torch.optim.AdamW(planned.parameters(), lr=1e-2)
    acc = Accumulator(planned, opt_planned, sizes, loss=_loss)
    for step in range(5):
        batch = _data(step)
        loss = _loss(plain, batch)
        loss.backward()
        opt_plain.step()
        opt_plain.zero_grad(set_to_none=True)
        got = acc(batch)
        assert got == pytest.approx(loss.item(), rel=1e-5, abs=1e-6), step
    for a, b in zip(plain.parameters(), planned.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clipping_happens_once_on_the_accumulated_gradient():
    model = _mlp()
    ref = copy.deepcopy(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), [20, 20, 24], loss=_loss, max_norm=0.05)
    out = acc.backward(_data(0))
    _loss(ref, _data(0)).backward()
    full_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    assert out.grad_norm == pytest.approx(full_norm, rel=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_step_outcome_counts_samples_and_items():
    model = _mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [30, 34], loss=_loss)
    out = acc.step(_data(0))
    assert (out.samples, out.items, out.total_items, out.micro_steps) == (64, 64, 64, 2)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True) after the step


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_keeps_fp32_gradients(precision):
    model = _mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [32, 32], loss=_loss, max_norm=1.0,
                      parts=[MixedPrecision(precision)])
    out = acc.backward(_data(0))
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert out.loss == pytest.approx(_loss(_mlp(), _data(0)).item(), rel=3e-2)
    trained = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [32, 32], loss=_loss,
                          parts=[MixedPrecision(precision)])
    assert not trained.step(_data(1)).skipped and trained.skipped_steps == 0


def test_accumulator_rejects_bad_input():
    model = _mlp()
    with pytest.raises(ValueError, match="precision"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [4], loss=_loss, parts=[MixedPrecision("fp8")])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [], loss=_loss)


def test_a_batch_of_another_size_is_split_under_the_largest_planned_size_and_weighted_exactly():
    from autotune.training.verify import flat_grad, relative_error

    planned, reference = _mlp(), _mlp()
    acc = Accumulator(planned, torch.optim.SGD(planned.parameters(), lr=0.0), [16, 16, 16, 16], loss=_loss)
    short = _data(0, n=37)  # the last batch of a DataLoader without drop_last
    out = acc.backward(short)
    assert out.micro_steps == 3 and out.samples == 37 and acc.sizes_for(37) == [12, 12, 13]
    _loss(reference, short).backward()
    assert relative_error(flat_grad(planned), flat_grad(reference)) < 1e-6
    assert acc.sizes_for(64) == [16, 16, 16, 16]  # the planned batch keeps the plan's schedule


def test_the_readme_loop_runs_over_a_default_dataloader():
    from torch.utils.data import DataLoader, TensorDataset

    from autotune.planning.planner import make_plan

    x, y = _data(0, n=1021 + 916)
    loader = DataLoader(TensorDataset(x, y), batch_size=1021)  # drop_last=False: 1021, then 916
    model = _mlp()
    step = Accumulator(model, torch.optim.AdamW(model.parameters()), make_plan(1021, 256), loss=_loss)
    losses = [step(batch) for batch in loader]
    assert len(losses) == 2 and all(map(math.isfinite, losses))


@pytest.mark.parametrize("max_norm", [-1.0, 0.0, float("nan"), "x"])
def test_a_max_norm_that_is_not_positive_is_refused_by_name(max_norm):
    from autotune.errors import BadInput

    model = _mlp()
    with pytest.raises(BadInput, match="max_norm .* must be a positive number"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [4], loss=_loss, max_norm=max_norm)


def test_backward_is_the_frameworks_when_given():
    calls = []

    def backward(loss):
        calls.append(float(loss.detach()))
        loss.backward()

    model = _mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [16, 16, 32], loss=_loss,
                      parts=[MixedPrecision(backward=backward)])
    acc.step(_data(0))
    assert len(calls) == 3  # one backward per micro-step, through the framework's function


def test_several_ranks_without_gradient_sync_are_refused():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(BadInput, match="2 ranks are training but the model .* not wrapped in DistributedDataParallel"):
        Accumulator(model, opt, [4], loss=_loss, parts=[Sync(rank=0, world_size=2)])
    Accumulator(model, opt, [4], loss=_loss, parts=[Sync(rank=0, world_size=2, external=True)])  # the caller syncs


# -- the parts an Accumulator is composed of ---------------------------------------------------------


def test_left_out_parts_take_their_defaults():
    model = _mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [16, 16], loss=_loss)
    assert (acc.precision, acc.sync.world_size, acc.sync.no_sync, acc.ramp) == ("fp32", 1, None, None)
    assert isinstance(acc.noise_scale, GradientNoiseScale) and acc.move((1, 2)) == (1, 2)
    acc.noise_scale.close()


def test_each_part_works_alone():
    model = _mlp()
    sync = Sync().bind(model)  # one process: N is this rank's, the loss is its own, no context to skip sync
    assert (sync.total_items(37), sync.global_loss(torch.tensor(0.5)), sync.every_micro_step) == (37, 0.5, False)
    amp = MixedPrecision("fp16").bind(model)
    assert amp.scaler is not None and amp.loss_scale() == 65536.0
    assert MixedPrecision("bf16").bind(model).scaler is None
    assert NoiseScale(measure=False).build(model) is None
    noise = NoiseScale(every=3).build(model)
    assert noise is not None and noise.every == 3 and len(noise.params) == 4
    noise.close()


def test_the_parts_compose_the_accumulation_the_keywords_of_the_last_release_did():
    from autotune.training.verify import flat_grad

    calls = []

    def backward(loss):
        calls.append(1)
        loss.backward()

    new, old = _mlp(), _mlp()
    Accumulator(new, torch.optim.SGD(new.parameters(), lr=0.0), [20, 20, 24], loss=_loss, max_norm=0.05,
                parts=[MixedPrecision("bf16", backward=backward), Batches(move=lambda b: b),
                       NoiseScale(measure=False)]).backward(_data(0))
    with pytest.warns(DeprecationWarning, match=r"Accumulator\(precision=, backward=, move=, noise_scale=\) is "
                      r"deprecated .* parts=\[MixedPrecision\(\.\.\.\), MixedPrecision\(backward=\.\.\.\), "
                      r"Batches\(move=\.\.\.\), NoiseScale"):
        acc = Accumulator(old, torch.optim.SGD(old.parameters(), lr=0.0), [20, 20, 24], loss=_loss, max_norm=0.05,
                          precision="bf16", backward=backward, move=lambda b: b, noise_scale=False)
    acc.backward(_data(0))
    assert acc.noise_scale is None and len(calls) == 6
    assert torch.equal(flat_grad(new), flat_grad(old))


def test_a_keyword_that_never_existed_is_a_type_error():
    model = _mlp()
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_nrom'"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [4], loss=_loss, max_nrom=1.0)


@pytest.mark.parametrize("parts,words", [
    ([MixedPrecision("bf16"), MixedPrecision("fp16")], "two precision parts .* give each kind once"),
    ([NoiseScale(), NoiseScale(every=2)], "two noise parts"),
    (["bf16"], "parts takes Batches, Sync, MixedPrecision, .* got str"),
])
def test_parts_that_cannot_compose_are_refused(parts, words):
    model = _mlp()
    with pytest.raises(BadInput, match=words):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [4], loss=_loss, parts=parts)


def test_a_part_keeps_its_kind_when_given_by_an_old_keyword_too():
    model = _mlp()
    with pytest.warns(DeprecationWarning), pytest.raises(BadInput, match="two precision parts"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [4], loss=_loss, precision="bf16",
                    parts=[MixedPrecision("fp16")])


def test_no_part_takes_another_parts_settings():
    import inspect
    from itertools import combinations

    from autotune import RampConfig

    settings = {part: set(inspect.signature(part).parameters) for part in
                (Batches, Sync, MixedPrecision, NoiseScale, RampConfig)}
    assert all(settings.values())
    assert {(a.__name__, b.__name__): settings[a] & settings[b] for a, b in combinations(settings, 2)
            if settings[a] & settings[b]} == {}
