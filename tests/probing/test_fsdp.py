"""FSDP in one process: the sharding units, the private fake process group, the fit rule per rank and its
estimate, what an out-of-memory error leaves behind, gradient sync, and the results that record it."""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autotune.devices import get_device
from autotune.errors import BadInput, ProbeFileError, WorkloadError
from autotune.probing import fsdp
from autotune.probing.fitrule import fit_rule_work, run_trial
from autotune.probing.fsdp import Sharding, fake_engine, fake_mesh
from autotune.units import format_bytes
from autotune.workload import Workload

from ..helpers import fake_groups, held_bytes

MIB = 1024**2


def _measure(device, workload, batch, rule):
    return device.measure(fit_rule_work(workload, batch, sharding=rule), enforce_capacity=False)[1]


@pytest.fixture(scope="module")
def real_gpt():
    """The CPU's fit rule at micro-batch 4 of the built-in gpt under a sharding rule with no offload: each rule's
    real run made once for this module's tests that compare with it (a real run's count is exact and repeatable;
    runs that a test patches, or whose host it watches, are made in that test)."""
    from autotune.workload import load_workload

    runs: dict[Sharding, object] = {}

    def run(rule: Sharding):
        assert not rule.offload
        if rule not in runs:
            runs[rule] = _measure(get_device("cpu"), load_workload("gpt"), 4, rule)
        return runs[rule]

    return run


# -- units -------------------------------------------------------------------------------------------


def test_default_units_are_the_blocks_of_the_largest_module_list(gpt):
    model = gpt.make_model()
    assert gpt.shard_units(model) == list(model.blocks)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2)] * 3)
            self.big = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])

    two = Two()
    assert gpt.shard_units(two) == list(two.big)
    assert gpt.shard_units(nn.Linear(3, 3)) == []  # the root alone


def test_a_shard_hook_names_the_units_and_is_checked(gpt):
    model = gpt.make_model()
    assert replace(gpt, shard=lambda m: [m.blocks[0]]).shard_units(model) == [model.blocks[0]]
    with pytest.raises(ProbeFileError, match="submodules of the model"):
        replace(gpt, shard=lambda m: [nn.Linear(2, 2)]).shard_units(model)
    with pytest.raises(ProbeFileError, match="submodules of the model"):
        replace(gpt, shard=lambda m: [m]).shard_units(model)
    with pytest.raises(WorkloadError, match="shard\\(model\\) failed: KeyError"):
        replace(gpt, shard=lambda m: {}["x"]).shard_units(model)
    with pytest.raises(ValueError, match="Workload.shard must be callable"):
        replace(gpt, shard=3)


# -- the fake process group -------------------------------------------------------------------------


def test_the_fake_group_is_private_and_gone_after_the_block():
    from torch._C._distributed_c10d import _resolve_process_group

    with fake_mesh(8, 3) as mesh:
        assert mesh.size() == 8 and tuple(mesh.get_coordinate()) == (3,) and not dist.is_initialized()
        (name,) = fake_groups()
        assert _resolve_process_group(name).size() == 8
        with fake_mesh(8, 3):  # the same shape nested: one group, kept until the outer block ends
            assert fake_groups() == [name]
        assert fake_groups() == [name]
    assert fake_groups() == [] and not dist.is_initialized()
    with pytest.raises(RuntimeError):
        _resolve_process_group(name)
    with pytest.raises(KeyError), fake_mesh(2):
        raise KeyError("fails inside")
    assert fake_groups() == []


@pytest.mark.slow
def test_an_estimate_leaves_no_process_group_and_no_patch_behind(mlp):
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from autotune import compat

    resize = torch.UntypedStorage.resize_
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    flag = compat.strided_shard_flag()  # None on a torch without the flag (2.11): nothing to patch

    def strided_now() -> object:
        return None if flag is None else getattr(flag[0], flag[1])

    strided, lookups = strided_now(), [getattr(o, n) for o, n in compat.fsdp_device_lookups()]
    for estimate in (fake_engine(get_device("cpu").estimator()), get_device("cpu").estimator()):
        m = _measure(estimate, mlp, 2, Sharding(4))
        assert m.peak_bytes > 0
        assert fake_groups() == [] and not dist.is_initialized()
        assert torch.UntypedStorage.resize_ is resize
        assert ShardingPropagator._propagate_tensor_meta_non_cached is propagate
        assert strided_now() is strided and [getattr(o, n) for o, n in compat.fsdp_device_lookups()] == lookups


@pytest.mark.slow
def test_estimating_inside_a_real_process_group_leaves_it_alone(mlp, tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        m = _measure(fake_engine(get_device("cpu").estimator()), mlp, 2, Sharding(4, 2))
        assert m.peak_bytes > 0 and dist.group.WORLD is world and dist.get_world_size() == 1
        assert fake_groups() == []
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("on_copies", [True, False])
def test_on_gloo_fsdp_collectives_leave_no_buffer_of_fsdp_to_the_transport(tmp_path, monkeypatch, on_copies):
    from autotune.probing import fsdpcomm

    from ..helpers import transport_keeps_buffers

    if not on_copies:  # the planted fault: gloo is given FSDP's own buffers, which its threads free when they run
        monkeypatch.setattr(fsdpcomm, "transport_keeps_tensors", lambda group, device: False)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        gathered, shard, reduced, grads = torch.zeros(6), torch.arange(6.0), torch.zeros(4), torch.arange(4.0)
        with transport_keeps_buffers() as kept:
            fsdpcomm.CallerReleasedAllGather()(output_tensor=gathered, input_tensor=shard, group=dist.group.WORLD)
            fsdpcomm.CallerReleasedReduceScatter()(output_tensor=reduced, input_tensor=grads, group=dist.group.WORLD,
                                                   op=dist.ReduceOp.SUM)
            given = {t.untyped_storage().data_ptr() for call in kept for t in call if isinstance(t, torch.Tensor)}
        fsdps = {t.untyped_storage().data_ptr() for t in (gathered, shard, reduced, grads)}
    finally:
        dist.destroy_process_group()
    assert torch.equal(gathered, shard) and torch.equal(reduced, grads)  # the results land in FSDP's buffers
    assert given and given.isdisjoint(fsdps) is on_copies


# -- the fit rule per rank -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "every", "precision"), [("meta", False, "fp32"), ("meta", True, "fp32"),
                                                            ("fake", False, "fp32"), ("fake", True, "fp32"),
                                                            ("meta", False, "bf16")])
def test_the_estimate_is_the_real_run_on_the_same_fake_group(gpt, real_gpt, engine, every, precision):
    from autotune.devices.estimate import EstimateDevice

    rule = Sharding(2, sync_every=every, precision=precision)
    real = real_gpt(rule)
    estimate = EstimateDevice(capacity=1024**3, round_to=1, cuda_like=False, engine=engine)
    est = _measure(estimate, gpt, 4, rule)
    if precision == "fp32":  # FSDP runs on meta tensors too
        assert estimate.engine == engine and estimate.fallback is None
    else:  # the CPU's bf16 layer norm keeps its statistics in bf16, meta's in fp32 (CUDA's): FakeTensorMode runs it
        assert estimate.engine == "fake" and "bf16 units on the CPU" in estimate.fallback
    assert est.peak_bytes == real.peak_bytes and est.timeline == real.timeline
    assert est.breakdown == real.breakdown


@pytest.mark.slow
def test_shards_shrink_with_the_world_size_and_unsharded_gradients_wait_for_the_last_micro_step(gpt):
    cpu = get_device("cpu")
    one, four = (_measure(cpu, gpt, 4, Sharding(w)).breakdown for w in (1, 4))
    full = sum(p.numel() * 4 for p in gpt.make_model().parameters())
    assert one["parameters"] == pytest.approx(full, rel=0.01)
    assert four["parameters"] == pytest.approx(full / 4, rel=0.05)
    assert four["optimizer_state"] == pytest.approx(one["optimizer_state"] / 4, rel=0.05)
    # Between micro-steps every rank keeps the whole gradient, unsharded, until the last one synchronises.
    assert four["gradients"] == pytest.approx(full, rel=0.01)


@pytest.mark.slow
def test_the_meta_engine_gives_way_to_fake_tensors_with_the_reason(gpt):
    from autotune.devices.estimate import EstimateDevice

    def loss(model, batch):  # CPU autocast: the meta engine cannot stand in for it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gpt.loss(model, batch)

    autocast = replace(gpt, loss=loss)
    meta = EstimateDevice(capacity=1024**3, round_to=1, cuda_like=False, engine="meta")
    assert fake_engine(meta).engine == "fake" and meta.engine == "meta"
    m = _measure(meta, autocast, 2, Sharding(2))
    assert meta.engine == "fake" and "autocast on the CPU" in meta.fallback
    assert m.peak_bytes == _measure(get_device("cpu"), autocast, 2, Sharding(2)).peak_bytes


def _mlp(width: int) -> Workload:
    """A small MLP of a width no other test uses: DTensor has not worked out its ops' shapes yet."""
    return Workload(name=f"mlp{width}", model=lambda: nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(),
                                                                      nn.Linear(2 * width, 3)),
                    batch=lambda n, g: torch.randn(n, width, generator=g), loss=lambda m, x: m(x).square().mean())


@pytest.mark.slow
@pytest.mark.parametrize("uncounted", [True, False])
def test_dtensor_shape_propagation_is_not_counted(monkeypatch, uncounted):
    if not uncounted:  # the planted fault: the global-shape fakes DTensor makes once per op are counted
        monkeypatch.setattr(fsdp, "shape_propagation_uncounted", lambda tracker: contextlib.nullcontext())
    workload = _mlp(37 if uncounted else 41)
    estimate = fake_engine(get_device("cpu").estimator())  # DTensor propagates in the estimate's own fake mode
    first, again = (_measure(estimate, workload, 2, Sharding(2)) for _ in range(2))
    assert (first.timeline == again.timeline) is uncounted


# -- an out-of-memory error mid-step ------------------------------------------------------------------


def _keeps_model_and_runs_out_of_memory(gpt: Workload, kept: list, above: int) -> Workload:
    """The gpt workload, but the loss keeps the model (as a user's global would) and real runs above
    ``above`` samples run out of memory in the last block's forward, with units all-gathered."""

    def oom(module, args):
        if not isinstance(args[0], torch._subclasses.fake_tensor.FakeTensor) and args[0].shape[0] > above:
            raise torch.OutOfMemoryError("planted: out of memory mid-forward")

    def loss(model, batch):
        kept.append(model)
        model.blocks[-1].register_forward_pre_hook(oom)
        return gpt.loss(model, batch)

    return replace(gpt, loss=loss)


@pytest.mark.slow
@pytest.mark.parametrize("released", [True, False])
def test_an_oom_mid_step_gives_back_everything_beyond_the_shards(gpt, monkeypatch, released):
    kept: list[nn.Module] = []
    workload = _keeps_model_and_runs_out_of_memory(gpt, kept, above=3)
    if not released:  # the planted fault: the sharded state is not released after the error
        monkeypatch.setattr(fsdp, "release", lambda model: None)
    measured = run_trial(get_device("cpu"), workload, 4, 10 * MIB, source="real", sharding=Sharding(2))
    assert measured.oom and not measured.fits
    held = held_bytes(kept[-1])
    assert (held == 0) if released else held > 0
    assert fake_groups() == []


@pytest.mark.slow
def test_gradients_synchronise_once_per_step_and_the_counter_sees_every_extra_round(gpt):
    from autotune.training.accumulate import Accumulator
    from autotune.training.fsdp import ReduceScatterCounter
    from autotune.training.sync import Sync
    from autotune.training.verify import rounds_check

    class SyncsEveryMicroStep(Accumulator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, parts=[Sync(no_sync=contextlib.nullcontext)], **kwargs)

    batch = gpt.make_batch(6, torch.Generator().manual_seed(0))
    rounds = {}
    for cls in (Accumulator, SyncsEveryMicroStep):
        with fake_mesh(2) as mesh:
            model = fsdp.shard(m := gpt.make_model(), gpt.shard_units(m), mesh)
            counter = ReduceScatterCounter(model)
            acc = cls(model, torch.optim.SGD(model.parameters(), lr=0.0), [2, 2, 2], loss=gpt.loss,
                      items=gpt.items)
            acc.backward(batch)
            rounds[cls] = counter.take()
    assert rounds == {Accumulator: 1, SyncsEveryMicroStep: 3}
    check = rounds_check([rounds[SyncsEveryMicroStep]], collective="reduce-scatter")
    assert check.name == "reduce_scatter_rounds" and not check.passed
    assert "set_requires_gradient_sync(False)" in check.message


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_gradient_gathered_from_the_shards_equals_the_reference(gpt, precision):
    from autotune.training import MixedPrecision, NoiseScale
    from autotune.training.accumulate import Accumulator
    from autotune.training.fsdp import wrap
    from autotune.training.verify import gradient_check

    batch = gpt.make_batch(8, torch.Generator().manual_seed(0))
    with fake_mesh(1) as mesh:  # one rank: FSDP moves no data, the values are the real ones
        model = gpt.make_model()
        sharded = wrap(copy.deepcopy(model), gpt, mesh, precision)
        acc = Accumulator(sharded, torch.optim.SGD(sharded.parameters(), lr=0.0), [3, 5], loss=gpt.loss,
                          items=gpt.items, parts=[MixedPrecision(precision), NoiseScale(measure=False)])
        check = gradient_check(acc, model, batch)
    assert check.passed, check.message  # fp16: the scaler unscales the gradients FSDP made


# -- results, API, command line ----------------------------------------------------------------------


@pytest.mark.slow
def test_an_fsdp_plan_round_trips_and_older_plans_load_as_ddp(tmp_path):
    from autotune import api
    from autotune.results.plan import Plan
    from autotune.serial import dumps

    plan = api.plan(16, probe="mlp", device="estimate", memory_budget="4GiB", parallel="fsdp", world_size=4)
    assert plan.parallel == "fsdp" and plan.probe.parallel == "fsdp" and plan.probe.world_size == 4
    assert "FSDP: the model sharded over 4 ranks" in plan.summary()
    data = json.loads(dumps(plan.to_dict()))
    assert Plan.from_dict(data) == plan
    old = {k: v for k, v in data.items() if k != "parallel"}
    old["probe"] = {k: v for k, v in data["probe"].items() if k not in ("parallel", "world_size", "fsdp_sync")}
    assert Plan.from_dict(old).parallel == "ddp" and Plan.from_dict(old).probe.parallel == "ddp"
    with pytest.raises(ValueError, match="sharded over 4 ranks, the plan has 8"):
        replace(plan, world_size=8, schedule=((2,),) * 8, micro_batch=2)
    with pytest.raises(ValueError, match="a plan for ddp needs a probe made for ddp"):
        replace(plan, parallel="ddp")
    path = tmp_path / "plan.json"
    path.write_text(dumps(plan.to_dict()))
    with pytest.raises(BadInput, match="parallel 'ddp' but the plan was made for fsdp: drop parallel"):
        api.run(plan=path, device="cpu", parallel="ddp")


def test_bad_parallel_values_name_the_parameter_and_the_flag(capsys):
    from autotune import api
    from autotune.cli import main

    with pytest.raises(BadInput, match="parallel 'zero3' must be one of ddp, fsdp"):
        api.probe("mlp", device="cpu", parallel="zero3")
    with pytest.raises(BadInput, match="plan with parallel='fsdp' without tune=True") as info:
        api.plan(64, probe="mlp", device="cpu", parallel="fsdp", tune=True)
    assert info.value.field == "tune"
    assert main(["plan", "--target-batch", "64", "--parallel", "fsdp", "--tune", "--probe", "mlp"]) == 2
    assert "plan with --parallel fsdp without --tune" in capsys.readouterr().err
    assert main(["probe", "--parallel", "zero3"]) == 2
    assert "invalid choice: 'zero3'" in capsys.readouterr().err


@pytest.mark.slow
def test_probe_command_shards_over_the_world_size_given(capsys):
    from autotune.cli import main

    code = main(["probe", "--probe", "gpt", "--device", "estimate", "--memory-budget", "2GiB", "--parallel", "fsdp",
                 "--world-size", "8", "--max-batch", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["parallel"] == "fsdp" and data["world_size"] == 8 and not data["data_parallel"]
    assert any(note.startswith("FSDP: the fit rule of rank 0 of 8") for note in data["notes"])


def noise_history(model, workload, batches, precision="fp32"):
    from autotune.training import MixedPrecision
    from autotune.training.accumulate import Accumulator

    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), [5, 4, 3], loss=workload.loss,
                      items=workload.items, parts=[MixedPrecision(precision)])
    torch.manual_seed(5)  # the same dropout masks for both models
    for batch in batches:
        acc.step(batch)
    return [(h.grad_sq, h.trace_cov) for h in acc.noise_scale.history]


@pytest.mark.slow
def test_the_noise_scale_under_fsdp_equals_the_unsharded_models(gpt):
    import copy

    batches = [gpt.make_batch(12, torch.Generator().manual_seed(s)) for s in range(3)]
    torch.manual_seed(0)
    plain = gpt.make_model()
    copied = copy.deepcopy(plain)
    with fake_mesh(1) as mesh:
        sharded = noise_history(fsdp.shard(copied, gpt.shard_units(copied), mesh), gpt, batches)
    expected = noise_history(plain, gpt, batches)
    assert len(expected) == 3
    assert sharded == [pytest.approx(e, rel=1e-4) for e in expected]


@pytest.mark.slow
def test_a_run_under_fsdp_measures_the_noise_scale():
    from autotune import api

    result = api.run(target_batch=61, probe="mlp", device="cpu", memory_budget="2200KB", parallel="fsdp",
                     steps=2)
    assert result.verification.passed and result.plan.accumulation_steps > 1
    assert result.noise_scale is not None and result.noise_scale.steps == 2, result.noise_scale
    assert "noise scale:" in result.summary()


# ---- FSDP's gradient sync: after every micro-step, at the last one only, or chosen ---------------------------


def _wide() -> Workload:
    """Parameters far larger than the activations of a few samples: the unsharded gradients that a deferred
    sync holds between micro-steps decide what fits."""

    def model() -> nn.Module:
        return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)], nn.Linear(512, 10))

    def batch(n: int, g: torch.Generator):
        return torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g)

    return Workload(name="wide", model=model, batch=batch,
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


@pytest.mark.slow
def test_syncing_every_micro_step_holds_no_unsharded_gradients_between_micro_steps():
    cpu = get_device("cpu")
    peaks = {}
    for every in (False, True):
        _, m = cpu.measure(fit_rule_work(_wide(), 4, sharding=Sharding(8, 0, sync_every=every)))
        peaks[every] = m.peak_bytes
    gradients = sum(p.numel() * 4 for p in _wide().make_model().parameters())
    # deferring holds the whole model's unsharded gradients beside the next micro-step; every micro-step, an
    # eighth of them (the shards) at most
    assert peaks[False] - peaks[True] >= 0.8 * gradients * 7 / 8, (peaks, gradients)


@pytest.mark.slow
def test_fsdp_sync_auto_takes_every_micro_step_where_the_deferred_sync_does_not_fit():
    from autotune import api
    from autotune.errors import DoesNotFit

    asked = dict(device="cpu", memory_budget="12MiB", parallel="fsdp", world_size=8, max_batch=4096)
    with pytest.raises(DoesNotFit, match="micro-batch 1 needs"):
        api.probe(_wide(), fsdp_sync="last", **asked)
    every = api.probe(_wide(), fsdp_sync="every", **asked)
    chosen = api.probe(_wide(), **asked)
    assert chosen.fsdp_sync == "every" and chosen.max_micro_batch == every.max_micro_batch > 1
    assert any("sync after every micro-step (chosen" in n and "last micro-step only" in n and "does not fit" in n
               for n in chosen.notes), chosen.notes


def test_fsdp_sync_auto_on_an_estimate_evaluates_the_deferred_sync_once_where_it_does_not_fit(monkeypatch, caplog):
    """On an estimate, "auto" probes "every" and evaluates "last" once, at that max micro-batch: it does not fit
    there, so "every" is chosen with what "last" needs there (the figure of that one evaluation); the progress
    says which sync that evaluation is of, before its own lines."""
    import logging

    from autotune import api
    from autotune.probing import finder

    asked = dict(device="estimate", memory_budget="700MiB", parallel="fsdp", world_size=8, max_batch=100000)
    evaluated: list[tuple[int, int | None]] = []
    measure = finder.fit_rule_at

    def once(*args):
        trial = measure(*args)
        evaluated.append((args[2], trial.peak_bytes))
        return trial

    monkeypatch.setattr(finder, "fit_rule_at", once)
    with caplog.at_level(logging.INFO, logger="autotune"):
        chosen = api.probe(_wide(), **asked)
    said = [r.getMessage() for r in caplog.records]
    every = api.probe(_wide(), fsdp_sync="every", **asked)
    last = api.probe(_wide(), fsdp_sync="last", **asked)
    assert chosen.fsdp_sync == "every" and chosen.max_micro_batch == every.max_micro_batch > last.max_micro_batch
    [(at, needs)] = evaluated
    assert at == every.max_micro_batch and needs is not None and needs > chosen.usable_bytes
    assert len(chosen.trials) == len(every.trials)  # no probe of "last" beside it
    assert any(f"needs {format_bytes(needs)} at {at}, over the usable" in n for n in chosen.notes), chosen.notes
    checking = [i for i, line in enumerate(said) if "FSDP gradient sync at the last micro-step only" in line]
    assert len(checking) == 1 and f"at micro-batch {at}" in said[checking[0]], said
    assert f"estimate at micro-batch {at}: peak {format_bytes(needs)}, does not fit" in said[checking[0] + 1], said


def test_fsdp_sync_auto_on_an_estimate_where_neither_sync_fits_probes_each_once_and_says_the_smaller_need(caplog):
    """Neither sync fits a micro-batch of 1: each is probed once, and the refusal gives the need of the one that
    needs less, naming it, and what the other needs."""
    import logging

    from autotune import api
    from autotune.errors import DoesNotFit

    asked = dict(device="estimate", memory_budget="642MiB", parallel="fsdp", world_size=8)
    needs = {}
    for sync in ("every", "last"):
        with pytest.raises(DoesNotFit) as info:
            api.probe(_wide(), fsdp_sync=sync, **asked)
        needs[sync] = info.value.needed
    assert needs["every"] is not None and needs["last"] is not None and needs["every"] < needs["last"]
    with caplog.at_level(logging.INFO, logger="autotune"), pytest.raises(DoesNotFit) as info:
        api.probe(_wide(), **asked)
    probed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("probing wide on")]
    assert len(probed) == 2, probed  # "every", then "last": each once
    said = str(info.value)
    assert info.value.needed == needs["every"], said
    assert said.startswith(f"FSDP gradient sync after every micro-step: micro-batch 1 needs "
                           f"{format_bytes(needs['every'])}"), said
    assert f"syncing at the last micro-step only needs {format_bytes(needs['last'])}" in said, said


def test_fsdp_sync_auto_takes_the_last_micro_step_on_a_tie_and_the_plan_says_which(tmp_path):
    from autotune import api
    from autotune.results.plan import Plan
    from autotune.serial import dumps

    plan = api.plan(16, probe="mlp", device="cpu", memory_budget="1GiB", parallel="fsdp", world_size=4)
    assert plan.probe.fsdp_sync == "last" and plan.fsdp_sync == "last"
    [why] = [n for n in plan.probe.notes if "at the last micro-step only (chosen" in n]
    assert "gradients reduce-scattered at the last micro-step" in plan.summary()
    assert f"  {why}" in plan.summary().splitlines()  # why, under the FSDP line
    every = api.plan(16, probe="mlp", device="cpu", memory_budget="1GiB", parallel="fsdp", world_size=4,
                     fsdp_sync="every")
    assert every.fsdp_sync == "every" and "reduce-scattered after every micro-step" in every.summary()
    assert "(chosen" not in every.summary()  # asked for, not chosen
    assert Plan.from_dict(json.loads(dumps(every.to_dict()))).fsdp_sync == "every"
    path = tmp_path / "plan.json"
    path.write_text(dumps(every.to_dict()))
    with pytest.raises(BadInput, match="fsdp_sync 'last' but the plan synchronises FSDP's gradients at every") as info:
        api.run(plan=path, device="cpu", fsdp_sync="last")
    assert (info.value.field, info.value.value) == ("fsdp_sync", "last")


def test_fsdp_sync_is_refused_without_fsdp_on_every_surface(capsys):
    from autotune import api
    from autotune.cli import main
    from autotune.planning.requests import plan_request

    with pytest.raises(BadInput, match="fsdp_sync 'every' is FSDP's gradient sync and parallel is ddp: add "
                                       "parallel='fsdp'") as info:
        api.probe("mlp", device="cpu", fsdp_sync="every")
    assert (info.value.field, info.value.value) == ("fsdp_sync", "every")
    with pytest.raises(BadInput, match="fsdp_sync 'sometimes' must be one of auto, every, last"):
        plan_request(64, probe="mlp", parallel="fsdp", fsdp_sync="sometimes")
    assert main(["plan", "--target-batch", "64", "--probe", "mlp", "--device", "cpu", "--fsdp-sync", "last"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp-sync 'last' is FSDP's gradient sync and --parallel is ddp: add --parallel fsdp" in err, err


# -- CPU offload ---------------------------------------------------------------------------------------------


def _host_bytes_expected(model: nn.Module, world_size: int, *, every: bool) -> int:
    """What FSDP's CPU offload keeps on the host of rank 0 at most, from the parameters' shapes alone: each
    parameter's padded dim-0 shard, its gradient shard, AdamW's two moments of the shard and its step counter
    (one fp32 scalar); syncing every micro-step, one more gradient shard while a copy is added in."""
    total, largest = 0, 0
    for p in model.parameters():
        rows = -(-p.shape[0] // world_size) if p.dim() else 1
        shard = min(rows, p.shape[0] if p.dim() else 1) * (p[0].numel() if p.dim() else 1) * p.element_size()
        padded = rows * (p[0].numel() if p.dim() else 1) * p.element_size()
        total += padded + 3 * shard + 4
        largest = max(largest, shard)
    return total + (largest if every else 0)


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "every"), [("meta", False), ("meta", True), ("fake", True)])
def test_offload_estimate_is_the_real_cpu_run_with_the_host_told_apart(gpt, real_gpt, engine, every, monkeypatch):
    from autotune.devices.estimate import EstimateDevice
    from autotune.probing import fsdpoffload

    hosts: list = []

    class Kept(fsdpoffload.Host):
        def __init__(self, tracker):
            super().__init__(tracker)
            hosts.append(self)

    monkeypatch.setattr(fsdpoffload, "Host", Kept)
    rule = Sharding(2, sync_every=every, offload=True, host_apart=True)
    real = _measure(get_device("cpu"), gpt, 4, rule)
    estimate = EstimateDevice(capacity=1024**3, round_to=1, cuda_like=False, engine=engine)
    est = _measure(estimate, gpt, 4, rule)
    assert estimate.engine == engine and estimate.fallback is None  # FSDP's own offload code ran on shape-only tensors
    assert est.peak_bytes == real.peak_bytes and est.timeline == real.timeline and est.breakdown == real.breakdown
    # What the real run's host holds is exactly the shards and AdamW's state, as the parameters' shapes give them.
    assert hosts[0].peak_bytes == _host_bytes_expected(gpt.make_model(), 2, every=every)
    assert real.breakdown["optimizer_state"] == 0
    # The device holds less than without offload by at least AdamW's state.
    plain = real_gpt(Sharding(2, sync_every=every))
    assert real.peak_bytes <= plain.peak_bytes - plain.breakdown["optimizer_state"]


@pytest.mark.slow
def test_offload_on_the_cpu_counts_everything_as_the_cpu_is_the_host(gpt, real_gpt):
    assert _measure(get_device("cpu"), gpt, 4, Sharding(2, offload=True)).peak_bytes == real_gpt(Sharding(2)).peak_bytes


@pytest.mark.slow
def test_a_gpu_estimate_with_offload_holds_less_and_stays_on_meta(gpt):
    from autotune.devices.estimate import EstimateDevice

    peaks = {}
    for offload in (False, True):
        estimate = EstimateDevice(capacity=1024**3, cuda_like=True)
        peaks[offload] = _measure(estimate, gpt, 4, Sharding(2, sync_every=True, offload=offload)).peak_bytes
        assert estimate.engine == "meta" and estimate.fallback is None
    assert peaks[True] < peaks[False]


def test_offload_is_refused_without_fsdp():
    from autotune.results.request import FitRule

    with pytest.raises(BadInput, match="offload.*CPU offload"):
        FitRule(offload=True)
    assert Sharding.of(FitRule.of("fsdp", 2, offload=True)).offload


@pytest.mark.slow
def test_the_host_check_fails_where_gradients_are_left_on_the_device(gpt, monkeypatch):
    """Plant the bug: FSDP's copies of the gradient shards to the host stay on the device."""
    from autotune.probing import fsdpoffload

    hosts: list = []

    class Leaky(fsdpoffload.Host):
        def __init__(self, tracker):
            super().__init__(tracker)
            hosts.append(self)

        def copy_out(self, t):
            return t

    monkeypatch.setattr(fsdpoffload, "Host", Leaky)
    rule = Sharding(2, sync_every=True, offload=True, host_apart=True)
    leaky = _measure(get_device("cpu"), gpt, 4, rule)
    assert hosts[0].peak_bytes != _host_bytes_expected(gpt.make_model(), 2, every=True)
    monkeypatch.undo()
    assert leaky.peak_bytes > _measure(get_device("cpu"), gpt, 4, rule).peak_bytes
