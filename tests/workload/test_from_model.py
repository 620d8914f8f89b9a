"""Workload.from_model: a model instance and one batch are enough, and the user's objects stay untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotune
from autotune.errors import BadInput, ProbeFileError
from autotune.workload import Workload


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 6, 50))
    return m


def _batch(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (n, 6), generator=g), torch.randint(0, 50, (n,), generator=g)


def _loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_plan_from_a_model_instance_and_one_batch():
    w = Workload.from_model(_model(), _batch(), loss=_loss)
    plan = autotune.plan(1000, probe=w, device="cpu", memory_budget="1MiB")
    assert plan.target_batch == 1000 and plan.probe.max_micro_batch >= 1
    assert sum(map(sum, plan.schedule)) == 1000


def test_micro_batches_of_any_size_cycle_through_the_samples():
    x, y = _batch(5)
    w = Workload.from_model(_model(), (x, y), loss=_loss)
    big = w.make_batch(12, torch.Generator())
    assert big[0].shape == (12, 6) and torch.equal(big[0][5:10], x) and torch.equal(big[1][10:], y[:2])


def test_probing_leaves_the_users_model_optimizer_and_rng_untouched():
    model = _model()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.1},
                             {"params": model[2].parameters(), "weight_decay": 0.5}], lr=3e-3, betas=(0.8, 0.9))
    _loss(model, _batch()).backward()
    opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    opt_state = [v.clone() for s in opt.state.values() for v in s.values()]
    torch.manual_seed(77)
    rng = torch.get_rng_state()
    w = Workload.from_model(model, _batch(), loss=_loss, optimizer=opt)
    autotune.probe(w, device="cpu", memory_budget="1MiB", max_batch=256)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(a, b) for a, b in zip((v for s in opt.state.values() for v in s.values()), opt_state))
    assert torch.equal(torch.get_rng_state(), rng)


def test_an_optimizer_instance_is_reproduced_with_its_groups_and_hyperparameters():
    model = _model()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.1},
                             {"params": model[2].parameters(), "weight_decay": 0.5}], lr=3e-3, betas=(0.8, 0.9))
    w = Workload.from_model(model, _batch(), loss=_loss, optimizer=opt)
    copy = w.make_model()
    made = w.optimizer(copy.parameters())
    assert type(made) is torch.optim.AdamW and len(made.param_groups) == 2
    assert made.param_groups[0]["lr"] == 0.1 and made.param_groups[1]["weight_decay"] == 0.5
    assert made.param_groups[1]["lr"] == 3e-3 and made.param_groups[0]["betas"] == (0.8, 0.9)
    assert [id(p) for p in made.param_groups[0]["params"]] == [id(p) for p in copy[0].parameters()]
    assert not any(p is q for p in copy.parameters() for q in model.parameters())


def test_tied_weights_stay_tied_in_every_copy_and_on_meta():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    w = Workload.from_model(model, torch.zeros(2, 3, dtype=torch.long), loss=lambda m, b: m(b).sum())
    for copy in (w.make_model(), _on_meta(w)):
        assert copy[0].weight is copy[1].weight and copy[0].weight is not model[0].weight
    assert _on_meta(w)[0].weight.is_meta


def _on_meta(w: Workload) -> nn.Module:
    with torch.device("meta"):
        return w.make_model()


class WithLoss(nn.Module):
    """A model that returns its own loss, as Hugging Face models do when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, inputs, labels=None):
        logits = self.lin(inputs)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels) if labels is not None else None}


def test_the_loss_defaults_to_the_models_own():
    batch = {"inputs": torch.randn(6, 4), "labels": torch.randint(0, 3, (6,))}
    w = Workload.from_model(WithLoss(), batch)
    assert torch.isfinite(w.loss(w.make_model(), batch))
    result = autotune.probe(w, device="cpu", memory_budget="256KiB", max_batch=64)
    assert result.max_micro_batch >= 1


def test_a_model_without_a_loss_says_to_pass_one():
    w = Workload.from_model(WithLoss(), {"inputs": torch.randn(6, 4)})
    with pytest.raises(ProbeFileError, match="no loss.*pass loss="):
        autotune.probe(w, device="cpu", memory_budget="256KiB", max_batch=8)


@pytest.mark.parametrize("args,words", [
    ((3, torch.zeros(2)), "model must be a torch.nn.Module"),
    ((nn.Linear(2, 2), "text"), "batch must be a tensor"),
    ((nn.Linear(2, 2), {"a": torch.zeros(2, 1), "b": torch.zeros(3, 1)}), "first"),
])
def test_bad_arguments_are_named(args, words):
    with pytest.raises(BadInput, match=words):
        Workload.from_model(*args)
