"""Known values: the batch's values and what is computed from them alone, carried beside shape-only tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autotune.devices import CpuDevice, EstimateDevice
from autotune.devices import values as values_mod
from autotune.devices.estimate import ENGINES
from autotune.devices.meta import MetaKernels
from autotune.devices.tracker import LiveStorageTracker
from autotune.devices.values import KnownValues, Unbounded
from autotune.probing.fitrule import fit_rule_work
from autotune.workload import Workload

from .. import workloads
from .known_values import estimate, known, unknown

GiB = 1024**3


MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])


def test_reads_of_values_computed_from_the_batch_are_answered_exactly():
    with estimate() as (values, tracker):
        mask = known(values, MASK)
        lengths = mask.sum(1)
        assert lengths.tolist() == [3, 2, 1]
        assert int(lengths.max()) == 3 and lengths.max().item() == 3
        assert bool(mask.all()) is False and bool((mask >= 0).all()) is True
        assert mask.nonzero().shape == (6, 2) and mask.nonzero()[:, 1].tolist() == [0, 1, 2, 0, 1, 0]
        assert (mask.cumsum(1) * mask).amax(1).tolist() == [3, 2, 1]
        positions = torch.arange(4, device="meta")  # a constant: known too
        assert (positions.unsqueeze(0) < lengths.unsqueeze(1)).sum().item() == 6
        if lengths[0] > 2:  # Python control flow on a value from the batch
            branch = "long"
    assert branch == "long"
    assert tracker.unknown_reads == 0 and values.reads >= 7 and values.shapes == 2


def test_values_that_depend_on_parameters_stay_unknown_and_are_counted():
    with estimate() as (values, tracker):
        weight = unknown(4, 4)  # a parameter: shape only
        mask = known(values, MASK).float()
        scores = mask @ weight
        assert values.value(scores) is None and values.value(mask) is not None
        assert scores.sum().item() == 1.0  # the guess for an unknown float
    assert tracker.unknown_reads == 1


def test_a_write_of_unknown_data_drops_the_value_of_every_tensor_on_that_storage():
    with estimate() as (values, tracker):
        x = known(values, torch.ones(4))
        head, tail = x[:2], x[2:]
        x.add_(1)  # known: the values follow, in every view
        assert head.sum().item() == 4.0 and tail.tolist() == [2.0, 2.0]
        tail.mul_(unknown(2))  # unknown data into the storage
        assert values.value(head) is None and values.value(x) is None
        assert head.sum().item() == 1.0  # guessed, not the stale 4.0
    assert tracker.unknown_reads == 1


@pytest.mark.parametrize("write", [
    lambda x: x.uniform_(), lambda x: x.bernoulli_(0.5), lambda x: x.copy_(unknown(4)),
    lambda x: x.index_add_(0, torch.zeros(1, dtype=torch.long, device="meta"), unknown(1)),
    lambda x: torch.mul(x, unknown(4), out=x),
], ids=["uniform_", "bernoulli_", "copy_ unknown", "index_add_ unknown", "out= unknown"])
def test_every_kind_of_unknown_write_drops_the_value(write):
    with estimate() as (values, tracker):
        x = known(values, torch.ones(4))
        view = x[1:]
        write(x)
        assert values.value(view) is None
        view.sum().item()
    assert tracker.unknown_reads == 1


def test_writes_of_known_data_make_or_keep_values():
    with estimate() as (values, tracker):
        blank = torch.empty(3, device="meta")
        assert values.value(blank) is None  # uninitialised
        blank.fill_(2.0)
        assert blank.tolist() == [2.0, 2.0, 2.0]
        target = torch.empty(3, device="meta").copy_(known(values, torch.tensor([1.0, 2.0, 3.0])))
        assert target.tolist() == [1.0, 2.0, 3.0]
        target[1] = 7.0  # index_put_ / copy_ of known data into a known storage
        assert target.tolist() == [1.0, 7.0, 3.0]
    assert tracker.unknown_reads == 0


def test_random_and_uninitialised_tensors_have_no_value():
    with estimate() as (values, _):
        assert values.value(torch.rand(3, device="meta")) is None
        assert values.value(torch.empty(3, device="meta")) is None
        assert values.value(F.dropout(known(values, torch.ones(3)), 0.5)) is None
        assert values.value(torch.zeros(3, device="meta")) is not None


def test_a_value_above_the_limit_is_not_kept_and_no_host_compute_of_that_size_runs():
    with estimate(limit=8) as (values, tracker):
        small = known(values, torch.arange(8))
        big = known(values, torch.arange(9))
        outer = small.unsqueeze(0) * small.unsqueeze(1)  # 64 elements: over the limit
        assert values.value(small) is not None and values.value(big) is None and values.value(outer) is None
        assert values.dropped == 2
        big.sum().item()
    assert tracker.unknown_reads == 1


def test_memoised_replays_still_carry_each_calls_own_values():
    kernels = MetaKernels()
    values = KnownValues(kernels)
    with LiveStorageTracker(kernel=values, values=values, fake_scalars=True):
        first = known(values, torch.tensor([1, 2, 3])).cumsum(0)
        second = known(values, torch.tensor([4, 5, 6])).cumsum(0)  # same metadata: replayed
    assert kernels.replayed >= 1
    assert values.value(first).tolist() == [1, 3, 6] and values.value(second).tolist() == [4, 9, 15]


def test_copies_to_the_host_are_answered_and_not_counted_as_device_memory():
    with estimate() as (values, tracker):
        lengths = known(values, torch.tensor([5, 3, 2]))
        before = tracker.current_bytes
        host = lengths.cpu()
        assert not host.is_meta and host.tolist() == [5, 3, 2]
        assert tracker.current_bytes == before
        with pytest.raises(NotImplementedError, match="meta"):
            unknown(3).cpu()  # an unknown value still cannot be copied out


def test_data_dependent_shapes_of_unknown_values_take_their_upper_bound():
    with estimate() as (values, tracker):
        routed = unknown(5, 3).gt(0)
        assert routed.nonzero().shape == (15, 2)
        assert torch.argwhere(routed).shape == (15, 2)
        assert unknown(5, 3).masked_select(routed).shape == (15,)
        assert unknown(5, 3)[routed].shape == (15,)
        assert torch.unique(unknown(6)).shape == (6,)
        assert torch.repeat_interleave(unknown(4, dtype=torch.long), output_size=9).shape == (9,)
        with pytest.raises(Unbounded, match="repeat_interleave.*no bound"):
            torch.repeat_interleave(unknown(4, dtype=torch.long))
    assert values.bounded == {"nonzero": 2, "masked_select": 1, "index": 1, "_unique2": 1}
    assert tracker.unknown_reads == 0


def test_values_ride_on_fake_tensors_too():
    """The fallback engine: FakeTensorMode's CPU fakes carry the same values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    values = KnownValues(fake_mode=fake_mode)
    tracker = LiveStorageTracker(kernel=values, values=values, fake_scalars=True)
    with fake_mode, tracker:
        mask = values.move(MASK, fake_mode.from_tensor(MASK).clone())
        assert mask.sum(1).tolist() == [3, 2, 1] and bool(mask.all()) is False
        assert mask.nonzero().shape == (6, 2) and mask[mask.bool()].shape == (6,)
        lengths = mask.sum(1).cpu()  # a fake CPU tensor: .cpu() changes nothing
        assert torch.arange(4)[None, :].lt(lengths[:, None]).sum().item() == 6
    assert tracker.unknown_reads == 0 and values.shapes == 2


def test_the_model_is_built_without_values():
    values = KnownValues(MetaKernels())
    with LiveStorageTracker(kernel=values, values=values), values.suspended(), torch.device("meta"):
        layer = nn.Linear(4, 4)
        nn.init.zeros_(layer.bias)
    assert values.value(layer.bias) is None and values.host_bytes == 0


# -- through the estimate device -------------------------------------------------------------------


def _trim_padding() -> Workload:
    return workloads.trim_padding()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_estimate_reads_the_batch_as_the_real_run_does(engine):
    """trim_padding cuts its batch at a length it reads with .item(): both engines answer it from the batch."""
    workload = _trim_padding()
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 6))
    estimator = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False, engine=engine)
    _, est = estimator.measure(fit_rule_work(workload, 6))
    assert estimator.engine == engine
    assert est.peak_bytes == real.peak_bytes and est.timeline == real.timeline
    assert est.unknown_reads == 0 and est.answered_reads == 4  # one read per micro-step


def test_a_batch_larger_than_the_limit_is_built_shape_only_and_says_so(monkeypatch):
    monkeypatch.setattr(values_mod, "BATCH_LIMIT", 64)
    monkeypatch.setattr("autotune.devices.estimate.BATCH_LIMIT", 64)
    _, est = EstimateDevice(capacity=GiB, cuda_like=False).measure(fit_rule_work(_trim_padding(), 6))
    assert est.unknown_reads == 4 and est.answered_reads == 0
    assert any("built for real" in n and "shape-only" in n for n in est.notes), est.notes
