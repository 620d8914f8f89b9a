"""The gradient noise scale against the truth: closed form, per-example gradients, planted faults, DDP."""

from __future__ import annotations

import json
import math
import random
import re
import statistics

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from autotune.results.noise import NoiseScaleEstimate, describe
from autotune.training.accumulate import Accumulator
from autotune.training.noise import GradientNoiseScale, SmoothedNoiseScale, two_batch_estimate

from .accumulators import NoisyAccumulator

# -- planted faults -------------------------------------------------------------------------------


class ForgetsTheWeight(GradientNoiseScale):
    """Fault: |g_i|² is the hook norm itself, the n_i/N weight of the micro-step's loss not undone."""

    def micro_step(self, items, weight):
        return super().micro_step(items, 1.0)


class NormsOfTheRunningSum(GradientNoiseScale):
    """Fault: the norm of .grad after each micro-step (the running sum), not the micro-step's own gradient."""

    def _take_micro(self, items, weight):
        for j, p in enumerate(self.params):
            if p.grad is not None:
                self._slots[j] = torch.linalg.vector_norm(p.grad)
        super()._take_micro(items, weight)


class ScaleNotUndone(NoisyAccumulator):
    """Fault: micro-step norms of the GradScaler-scaled gradients (scale not undone)."""

    def finish(self, noise):
        self.amp.scaler.unscale_(self.optimizer)
        noise.end_step(scale=1.0)
        return self.clip()


class TotalBeforeUnscale(NoisyAccumulator):
    """Fault: the accumulated gradient's norm taken before GradScaler's unscale."""

    def finish(self, noise):
        noise.end_step(scale=self.amp.scaler.get_scale())
        self.amp.scaler.unscale_(self.optimizer)
        return self.clip()


class TotalAfterClip(NoisyAccumulator):
    """Fault: the accumulated gradient's norm taken after clipping."""

    def finish(self, noise):
        self.amp.scaler.unscale_(self.optimizer)
        norm = self.clip()
        noise.end_step(scale=self.amp.scaler.get_scale())
        return norm


class WeightNotUndone(NoisyAccumulator):
    noise_cls = ForgetsTheWeight


class RunningSumNorms(NoisyAccumulator):
    noise_cls = NormsOfTheRunningSum


# -- the estimator's algebra ----------------------------------------------------------------------


@pytest.mark.parametrize("b,k,small,big", [(8, 4, 3.0, 1.0), (32, 2, 10.0, 9.5), (1, 64, 5.0, 0.2), (100, 3, 1.0, 2.0)])
def test_equal_sizes_reduce_to_mccandlish_appendix_a(b, k, small, big):
    n = b * k
    micro = [small + (i - (k - 1) / 2) * 0.1 for i in range(k)]  # mean is `small`
    grad_sq, trace = two_batch_estimate([b] * k, micro, big)
    assert grad_sq == pytest.approx((n * big - b * small) / (n - b))
    assert trace == pytest.approx((small - big) / (1 / b - 1 / n))


@pytest.mark.parametrize("sizes", [[5, 9, 13, 37], [3, 100, 7], [8, 8, 8], [1, 2]])
@pytest.mark.parametrize("v,u", [(1.0, 0.0), (1.0, 3.0), (0.1, 5.0)])
def test_estimator_is_the_generalised_least_squares_fit(sizes, v, u):
    """The closed form equals a generic GLS solve of E|g_b|² = |G|² + tr(Σ)/b over the k micro-batches and the
    full batch, with Var(a_i) = v/n_i² + u/n_i, Cov(a_i, B) = Var(B) = v/N² + u/N, in every regime u/v."""
    n = torch.tensor(sizes, dtype=torch.float64)
    k, total = len(sizes), n.sum()
    cov = torch.zeros(k + 1, k + 1, dtype=torch.float64)
    cov[:k, :k] = torch.diag(v / n ** 2 + u / n)
    cov[k, :], cov[:, k] = v / total ** 2 + u / total, v / total ** 2 + u / total
    design = torch.stack([torch.ones(k + 1, dtype=torch.float64), torch.cat([1 / n, (1 / total)[None]])], 1)
    y = torch.rand(k + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) * 10
    inv = torch.linalg.inv(cov)
    gls = torch.linalg.solve(design.T @ inv @ design, design.T @ inv @ y)
    assert two_batch_estimate(sizes, y[:k].tolist(), float(y[k])) == pytest.approx(gls.tolist(), rel=1e-9)


@pytest.mark.parametrize("sizes", [[5, 9, 13, 37], [1, 1000], [17, 16, 16, 16, 15], [2, 3]])
def test_expected_observations_give_the_truth_for_any_sizes(sizes):
    """Linear in the observations, so unbiased: E|g_b|² = |G|² + tr(Σ)/b in, (|G|², tr(Σ)) out, exactly."""
    grad_sq, trace = 0.7, 42.0
    micro = [grad_sq + trace / n for n in sizes]
    assert two_batch_estimate(sizes, micro, grad_sq + trace / sum(sizes)) == pytest.approx((grad_sq, trace))


def test_one_micro_batch_has_no_estimate():
    assert two_batch_estimate([64], [1.0], 1.0) is None
    with pytest.raises(ValueError, match="2 micro-batch sizes for 1 norms"):
        two_batch_estimate([3, 4], [1.0], 1.0)


# -- (a) least squares with Gaussian inputs: tr(Σ) and |G|² in closed form ---------------------------

DIM, NOISE_SD = 10, 1.0
UNEVEN = [5, 9, 13, 37]


def linear_problem():
    """0.5 (w·x − y)², x ~ N(0, I), y = w*·x + ε: at w = w* + δ, G = δ and Σ = (|δ|² + σ²) I + δδᵀ."""
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(DIM, generator=g)
    delta = torch.randn(DIM, generator=g)
    delta /= delta.norm()
    model = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    d2 = float(delta @ delta)
    truth = {"grad_sq": d2, "trace_cov": (DIM + 1) * d2 + DIM * NOISE_SD ** 2}
    return model, w_star, truth


def linear_loss(model, batch):
    x, y = batch
    return 0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()


def linear_history(steps, acc_cls=NoisyAccumulator, *, precision="fp32", max_norm=None, sizes=UNEVEN):
    model, w_star, truth = linear_problem()
    acc = acc_cls(model, torch.optim.SGD(model.parameters(), lr=0.0), sizes, loss=linear_loss, precision=precision,
                  max_norm=max_norm)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(sum(sizes), DIM, generator=g)
        acc.step((x, x @ w_star + NOISE_SD * torch.randn(sum(sizes), generator=g)))
    return acc.noise_scale, truth


def mean_se(values):
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def misses(noise, truth) -> float:
    """The larger distance of the per-step means of |G|² and tr(Σ) from the truth, in standard errors."""
    worst = 0.0
    for key in ("grad_sq", "trace_cov"):
        mean, se = mean_se([getattr(h, key) for h in noise.history])
        worst = max(worst, abs(mean - truth[key]) / se)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("precision,max_norm", [("fp32", None), ("fp16", 0.5)])
def test_linear_gaussian_estimates_converge_to_the_closed_form(precision, max_norm):
    noise, truth = linear_history(600, precision=precision, max_norm=max_norm)
    assert noise.steps == 600 and noise.skipped == 0
    for key in ("grad_sq", "trace_cov"):
        mean, se = mean_se([getattr(h, key) for h in noise.history])
        assert abs(mean - truth[key]) < 4 * se, (key, mean, se, truth[key])
        assert se < 0.03 * truth[key]  # precise enough for the check to mean something
    b_true = truth["trace_cov"] / truth["grad_sq"]
    low, high = noise.interval
    assert low < noise.b_simple < high and high / low < 1.5
    assert abs(noise.b_simple - b_true) < (high - low)


FAULTS = {
    "weight n_i/N not undone": WeightNotUndone,
    "norms of the running sum": RunningSumNorms,
    "GradScaler scale not undone": ScaleNotUndone,
    "total norm before unscale": TotalBeforeUnscale,
    "total norm after clipping": TotalAfterClip,
}


@pytest.fixture(scope="module")
def right_fp16_clipped():
    return linear_history(100, precision="fp16", max_norm=0.5)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_faults_miss_the_truth(fault, right_fp16_clipped):
    """Same data, fp16 with a GradScaler and clipping at 0.5 (|G_N| is about 1.15): the right measurement
    stays within 4 standard errors of the closed form, each fault lands far outside."""
    right, truth = right_fp16_clipped
    wrong, _ = linear_history(100, FAULTS[fault], precision="fp16", max_norm=0.5)
    assert misses(right, truth) < 4
    assert misses(wrong, truth) > 10, fault


# -- (b) per-example gradients (torch.func) on an MLP and a transformer --------------------------------


def mlp_case():
    """Regression with the probe's MLP; targets chosen so the noise scale (about 60) is near the batch (64):
    both |G|² and tr(Σ) are then determined by a few dozen steps."""
    from probes.mlp import CLASSES, FEATURES, model

    torch.manual_seed(0)
    net = model()

    def batch(n, g):
        x = torch.randn(n, FEATURES, generator=g)
        return x, 0.5 + 3 * x[:, :CLASSES] + 0.5 * torch.randn(n, CLASSES, generator=g)

    def loss(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    def example_loss(m, params, x, y):
        return nn.functional.mse_loss(functional_call(m, params, (x[None],)), y[None])

    return net, batch, loss, example_loss, lambda b: (b[0], b[1])


def gpt_case():
    from probes.gpt import GPT, Config, make_batch
    from probes.gpt import loss as gpt_loss

    c = Config(vocab=64, seq_len=16, d_model=32, heads=2, layers=2, dropout=0.0, min_len=17)  # full length
    torch.manual_seed(0)
    net = GPT(c)

    def example_loss(m, params, tokens, targets):
        logits = functional_call(m, params, (tokens[None],))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets)

    return (net, lambda n, g: make_batch(n, g, c=c), gpt_loss, example_loss,
            lambda b: (b["tokens"], b["targets"]))


CASES = {"mlp": mlp_case, "transformer": gpt_case}


def per_example_grads(net, example_loss, args):
    params = {k: v.detach() for k, v in net.named_parameters()}  # tied weights once, as the hooks see them
    grads = vmap(grad(lambda p, *a: example_loss(net, p, *a)), in_dims=(None, 0, 0))(params, *args)
    return torch.cat([g.flatten(1) for g in grads.values()], 1).double()


def per_example_estimate(flat):
    """tr(Σ) = Σ|g_x − ḡ|²/(N − 1), |G|² = |ḡ|² − tr(Σ)/N: the unbiased per-example estimates."""
    n = flat.shape[0]
    mean = flat.mean(0)
    trace = float(((flat - mean) ** 2).sum()) / (n - 1)
    return float(mean @ mean) - trace / n, trace


def one_step_against_per_example(case, acc_cls=NoisyAccumulator, max_norm=None):
    """One step's measured (|G|², tr(Σ)) and the two-batch estimate from per-example gradients grouped into
    the same micro-batches (|g_i|² of each group's mean, |G|² of all)."""
    net, make, loss, example_loss, args = CASES[case]()
    sizes = [7, 3, 12, 10]
    data = make(sum(sizes), torch.Generator().manual_seed(3))
    flat = per_example_grads(net, example_loss, args(data))
    acc = acc_cls(net, torch.optim.SGD(net.parameters(), lr=0.0), sizes, loss=loss, max_norm=max_norm)
    acc.step(data)
    (step,) = acc.noise_scale.history
    groups = torch.split(flat, sizes)
    want = two_batch_estimate(sizes, [float(g.mean(0) @ g.mean(0)) for g in groups], float(flat.mean(0) @ flat.mean(0)))
    return (step.grad_sq, step.trace_cov), want


@pytest.mark.parametrize("case", list(CASES))
def test_hooks_measure_each_micro_batchs_own_gradient(case):
    """Hooks, weights, tied embeddings (the transformer's head): equal to float precision, with clipping on."""
    got, want = one_step_against_per_example(case, max_norm=0.1)
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("fault", [WeightNotUndone, RunningSumNorms, "clipped"])
def test_per_example_truth_catches_the_planted_faults(fault):
    class Clipped(NoisyAccumulator):
        def finish(self, noise):
            norm = self.clip()
            noise.end_step()
            return norm

    got, want = one_step_against_per_example("mlp", Clipped if fault == "clipped" else fault, max_norm=0.1)
    assert got != pytest.approx(want, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_accumulated_estimate_agrees_with_the_per_example_one(case):
    """Over 20 batches at fixed parameters: mean accumulated estimate − mean per-example estimate within 4
    standard errors of the paired differences, and both means within a few percent of each other (the
    standard error is under 2% of the mean here: a bias of 7% would show)."""
    net, make, loss, example_loss, args = CASES[case]()
    sizes = [16, 15, 17, 16]
    acc = NoisyAccumulator(net, torch.optim.SGD(net.parameters(), lr=0.0), sizes, loss=loss)
    g = torch.Generator().manual_seed(4)
    ref = []
    for _ in range(20):
        data = make(sum(sizes), g)
        acc.step(data)
        ref.append(per_example_estimate(per_example_grads(net, example_loss, args(data))))
    for j, key in enumerate(("grad_sq", "trace_cov")):
        ours = [getattr(h, key) for h in acc.noise_scale.history]
        diff_mean, diff_se = mean_se([a - r[j] for a, r in zip(ours, ref)])
        ref_mean = statistics.fmean(r[j] for r in ref)
        assert abs(diff_mean) < 4 * diff_se, (key, diff_mean, diff_se, ref_mean)
        assert diff_se < 0.2 * abs(ref_mean), (key, diff_se, ref_mean)  # the comparison has power


# -- smoothing and its interval -------------------------------------------------------------------


def test_smoothing_is_a_bias_corrected_ema_of_each_part():
    s = SmoothedNoiseScale(beta=0.9)
    s.add(grad_sq=2.0, trace_cov=10.0, items=64)
    assert (s.grad_sq, s.trace_cov, s.b_simple, s.steps) == (pytest.approx(2.0), pytest.approx(10.0),
                                                             pytest.approx(5.0), 1)
    assert s.interval() == (None, None)  # one step: no spread to judge from
    s.add(grad_sq=4.0, trace_cov=30.0, items=32)
    w = [0.9 * 0.1 / 0.19, 0.1 / 0.19]
    assert s.grad_sq == pytest.approx(w[0] * 2 + w[1] * 4) and s.trace_cov == pytest.approx(w[0] * 10 + w[1] * 30)
    assert s.b_simple == pytest.approx(s.trace_cov / s.grad_sq) and s.items_per_step == 48


@pytest.mark.parametrize("steps,beta", [(4, 0.99), (30, 0.99), (200, 0.9)])
def test_interval_covers_the_truth_about_95_percent_of_the_time(steps, beta):
    """Synthetic per-step estimates spread like the linear problem's (sd 8 around tr(Σ) = 21, sd 0.45 around
    |G|² = 1, correlated): the 95% interval holds B_simple = 21 in about 95% of 1000 runs (never less than
    90%), and is bounded in most runs once there are enough steps."""
    rng = random.Random(steps)
    covered = bounded = 0
    for _ in range(1000):
        s = SmoothedNoiseScale(beta)
        for _ in range(steps):
            z1, z2 = rng.gauss(0, 1), rng.gauss(0, 1)
            s.add(grad_sq=1.0 + 0.45 * (-0.5 * z1 + 0.866 * z2), trace_cov=21.0 + 8.0 * z1, items=64)
        low, high = s.interval()
        if low is None:
            covered += 1  # "too noisy to bound" claims nothing false
            continue
        bounded += high < math.inf
        covered += low <= 21.0 <= high
    assert 0.90 <= covered / 1000 <= 0.995, covered
    if steps >= 30:
        assert bounded / 1000 > 0.9, bounded


# -- the API's edges ------------------------------------------------------------------------------


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def mlp_loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def mlp_batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def hook_count(model):
    return sum(len(p._backward_hooks or {}) for p in model.parameters())


def test_off_registers_nothing_and_close_removes_the_hooks():
    model = small_mlp()
    acc = NoisyAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [4, 4], loss=mlp_loss, noise_scale=False)
    assert acc.noise_scale is None and hook_count(model) == 0
    acc.step(mlp_batch(8))
    on = NoisyAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [4, 4], loss=mlp_loss)
    assert hook_count(model) == 4
    on.step(mlp_batch(8))
    on.noise_scale.close()
    assert hook_count(model) == 0 and on.noise_scale.steps == 1


def test_every_nth_step_measures_the_same_steps_as_every_step():
    runs = {}
    for every in (1, 3):
        class Sampled(NoisyAccumulator):
            noise_cls = staticmethod(lambda params, every=every, **kw: GradientNoiseScale(params, every=every, **kw))

        model = small_mlp()
        acc = Sampled(model, torch.optim.SGD(model.parameters(), lr=0.1), [3, 5, 4], loss=mlp_loss)
        for step in range(7):
            acc.step(mlp_batch(12, step))
        runs[every] = {h.step: (h.grad_sq, h.trace_cov) for h in acc.noise_scale.history}
    assert list(runs[3]) == [0, 3, 6]
    assert runs[3] == {k: pytest.approx(runs[1][k], rel=1e-6) for k in (0, 3, 6)}


def test_backwards_outside_micro_steps_are_not_measured():
    model = small_mlp()
    acc = NoisyAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), [3, 5], loss=mlp_loss)
    acc.step(mlp_batch(8))
    mlp_loss(model, mlp_batch(8, seed=1)).backward()  # e.g. a verification pass on the same model
    model.zero_grad(set_to_none=True)
    acc.step(mlp_batch(8))
    first, second = acc.noise_scale.history
    assert second.grad_sq == pytest.approx(first.grad_sq) and second.trace_cov == pytest.approx(first.trace_cov)


def test_the_clip_norm_passed_in_equals_the_norm_taken_before_clipping():
    """end_step(grad_norm=...) with clip_grad_norm_'s return (the norm before clipping) saves one pass."""

    class NormFromGrad(NoisyAccumulator):  # end_step takes the norm from .grad itself, before clipping
        def finish(self, noise):
            noise.end_step()
            return self.clip()

    runs = []
    for cls in (NoisyAccumulator, NormFromGrad):
        model = small_mlp()
        acc = cls(model, torch.optim.SGD(model.parameters(), lr=0.1), [3, 5, 4], loss=mlp_loss, max_norm=0.01)
        for step in range(3):
            acc.step(mlp_batch(12, step))
        runs.append([(h.grad_sq, h.trace_cov) for h in acc.noise_scale.history])
    assert runs[0] == [pytest.approx(r, rel=1e-5) for r in runs[1]]


def test_a_scale_tensor_is_read_as_it_was_at_end_step():
    """GradScaler updates its scale tensor in place after the step; the lazy read-back must not see that."""
    runs = []
    for as_tensor in (False, True):
        model = small_mlp()
        noise = GradientNoiseScale(model.parameters())
        data = mlp_batch(8)
        noise.begin_step(8)
        for part, n in ((slice(0, 3), 3), (slice(3, 8), 5)):
            with noise.micro_step(n, n / 8):
                (mlp_loss(model, (data[0][part], data[1][part])) * (n / 8) * 1024.0).backward()
        for p in model.parameters():
            p.grad /= 1024.0  # unscale
        scale = torch.tensor(1024.0) if as_tensor else 1024.0
        noise.end_step(scale=scale)
        if as_tensor:
            scale.mul_(2.0)  # what scaler.update() does
        runs.append((noise.grad_sq, noise.trace_cov))
    assert runs[1] == pytest.approx(runs[0], rel=1e-6)


def test_non_finite_steps_are_skipped_and_counted():
    model = small_mlp()
    acc = NoisyAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), [3, 5], loss=mlp_loss)
    acc.step(mlp_batch(8))
    x, y = mlp_batch(8, 1)
    x[6, 0] = float("nan")
    acc.backward((x, y))
    model.zero_grad(set_to_none=True)
    acc.step(mlp_batch(8, 2))
    noise = acc.noise_scale
    assert (noise.steps, noise.skipped, noise.reasons) == (2, 1, {"non-finite gradients": 1})
    assert [h.step for h in noise.history] == [0, 2]


def test_a_gradient_arriving_in_parts_drops_the_step():
    """Reentrant checkpointing of a layer used twice gives its parameters two gradients per backward: their
    squared norms do not add up to the micro-step's, so the step is dropped, not mis-measured."""
    from torch.utils.checkpoint import checkpoint

    layer = nn.Linear(8, 8)
    twice = nn.Sequential(layer, nn.Tanh(), layer)

    def loss(model, batch):
        h = checkpoint(layer, batch[0].clone().requires_grad_(), use_reentrant=True)
        return checkpoint(layer, torch.tanh(h), use_reentrant=True).square().mean()

    acc = NoisyAccumulator(twice, torch.optim.SGD(twice.parameters(), lr=0.0), [4, 4], loss=loss)
    acc.step(mlp_batch(8))
    noise = acc.noise_scale
    assert noise.steps == 0 and noise.skipped == 1
    assert "several parts" in noise.estimate().reason


def test_sparse_gradients_measure_like_dense_ones():
    def build(sparse):
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(50, 8, sparse=sparse), nn.Flatten(), nn.Linear(24, 3))

    def tokens(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 50, (12, 3), generator=g), torch.randint(0, 3, (12,), generator=g)

    runs = []
    for sparse in (False, True):
        model = build(sparse)
        acc = NoisyAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [5, 4, 3], loss=mlp_loss)
        for step in range(3):
            acc.step(tokens(step))
        runs.append([(h.grad_sq, h.trace_cov) for h in acc.noise_scale.history])
    assert len(runs[1]) == 3 and runs[1] == [pytest.approx(r, rel=1e-5) for r in runs[0]]


def test_one_micro_batch_per_step_says_why_there_is_no_estimate():
    model = small_mlp()
    acc = NoisyAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [8], loss=mlp_loss)
    for step in range(3):
        acc.step(mlp_batch(8, step))
    est = acc.noise_scale.estimate()
    assert est.b_simple is None and est.steps == 0 and est.skipped == 3
    assert "at least 2 micro-batches" in est.reason
    assert describe(est, 8).startswith("noise scale: no estimate (each step ran one micro-batch")


def test_estimate_serialises():
    model = small_mlp()
    acc = NoisyAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), [2, 3, 3], loss=mlp_loss)
    for step in range(4):
        acc.step(mlp_batch(8, step))
    estimate = acc.noise_scale.estimate()
    out = json.loads(json.dumps(estimate.to_dict()))
    assert {"b_simple", "low", "high", "grad_sq", "trace_cov", "steps", "unit", "history"} <= set(out)
    assert out["steps"] == 4 and out["items_per_step"] == 8 and len(out["history"]) == 4
    again = NoiseScaleEstimate.from_dict(out, kind="RunResult", source="x.json")
    assert again == estimate


# -- the word to the user ----------------------------------------------------------------------------


def estimate(**kw):
    base = {"b_simple": 250.0, "low": 210.0, "high": 300.0, "grad_sq": 0.4, "trace_cov": 100.0, "steps": 40,
            "skipped": 0, "items_per_step": 1024.0}
    return NoiseScaleEstimate(**{**base, **kw})


@pytest.mark.parametrize("kw,batch,says", [
    ({}, 1024, ["target 1024 samples is 4.1x the measured noise scale (~250 samples, 95% 210–300, "
                "from 40 optimizer steps)",
                "about 1.2x the fewest optimizer steps (1.2–1.3) for 5.1x the fewest samples (4.4–5.9)",
                "a batch near 250 (210–300) trades them evenly", "re-measure later"]),
    ({}, 64, ["0.26x the measured noise scale", "about 4.9x the fewest optimizer steps", "1.3x the fewest samples"]),
    ({"low": 60.0, "high": 900.0}, 1024, ["95% 60–900", "rough: the interval spans more than 4x"]),
    ({"high": None}, 1024, ["at least ~210 samples", "no upper bound yet", "at most 5.9x the fewest samples"]),
    ({"low": None, "high": None, "steps": 3}, 1024, ["~250 samples from 3 optimizer steps, too noisy yet to bound",
                                                     "measure more steps"]),
    ({"b_simple": None, "grad_sq": -0.1, "low": 3000.0, "high": None}, 1024,
     ["|G|² is estimated at -0.1 <= 0", "probably well above the target 1024 samples (95%: above ~3000 samples)"]),
    ({"b_simple": None, "trace_cov": -5.0, "low": None, "high": None}, 1024,
     ["tr(Σ) is estimated at -5 <= 0", "not independent samples"]),
    ({"steps": 0, "b_simple": None, "low": None, "high": None, "grad_sq": None, "trace_cov": None,
      "reason": "no optimizer step measured yet"}, 1024, ["noise scale: no estimate (no optimizer step measured"]),
])
def test_the_word_says_no_more_than_the_data(kw, batch, says):
    text = describe(estimate(**kw), batch)
    for part in says:
        assert part in text, (part, text)


def test_the_word_uses_the_estimates_items():
    text = describe(estimate(b_simple=5000.0, low=4000.0, high=6000.0, items_per_step=20000.0), unit="tokens")
    assert "target 20000 tokens is 4x the measured noise scale (~5000 tokens" in text and "fewest tokens" in text
    measured = estimate(b_simple=5000.0, low=4000.0, high=6000.0, items_per_step=20000.0, unit="items")
    assert "target 20000 items is 4x the measured noise scale (~5000 items" in describe(measured)


# -- DDP: two gloo ranks under torchrun --------------------------------------------------------------


@pytest.mark.parametrize(("value", "text"), [(250.4, "250"), (12345.0, "12000"), (4.14, "4.1"), (0.2612, "0.26"),
                                             (99.6, "100"), (9.96, "10"), (float("inf"), "∞"), (None, "?")])
def test_figures_are_written_with_two_significant_digits_never_in_e_notation(value, text):
    from autotune.results.noise import _fmt

    assert _fmt(value) == text


def test_an_accumulator_let_go_takes_its_hooks_with_it():
    # a new Accumulator per epoch on the same model must not leave the old ones' hooks behind (each one
    # would cost a call per parameter and micro-step, for good)
    import gc


    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(12, 4), torch.randint(0, 2, (12,))
    for _ in range(3):
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [6, 6],
                          loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
        acc.step((x, y))
        del acc
        gc.collect()
    assert all(not p._backward_hooks for p in model.parameters())


@pytest.mark.parametrize(("kw", "words"), [
    ({"grad_sq": None}, "grad_sq is None though 40 steps were measured"),
    ({"trace_cov": None}, "trace_cov is None though 40 steps were measured"),
    ({"items_per_step": None}, "items_per_step is None though 40 steps were measured"),
    ({"items_per_step": 0.0}, "items_per_step 0.0 must be more than 0"),
    ({"b_simple": None}, "b_simple is None though grad_sq 0.4 and trace_cov 100.0 are both above 0"),
    ({"grad_sq": -0.1}, "b_simple 250.0 is given though grad_sq -0.1 is not above 0"),
    ({"steps": -1}, "steps -1 must be at least 0"),
    ({"skipped": -2}, "skipped -2 must be at least 0"),
])
def test_an_estimate_that_contradicts_itself_is_refused(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        estimate(**kw)
