"""Shape rules for ops whose output shapes come from values: each against the real op's outputs (sizes, strides,
dtype and storage bytes), on meta tensors whose values the estimate knows."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autotune.devices import CpuDevice, EstimateDevice
from autotune.devices.estimate import ENGINES
from autotune.devices.meta import MetaKernels
from autotune.devices.shaperules import pad_packed_sequence
from autotune.devices.tracker import LiveStorageTracker
from autotune.devices.values import KnownValues
from autotune.probing.fitrule import fit_rule_work
from autotune.workload import Workload

from .known_values import estimate, known, unknown

aten = torch.ops.aten
GiB = 1024**3


def layout(t: torch.Tensor) -> tuple:
    """What memory a tensor takes and how it is laid out."""
    return tuple(t.shape), t.stride(), t.dtype, t.untyped_storage().nbytes()


def layouts(out) -> list[tuple]:
    return [layout(t) for t in (out if isinstance(out, (tuple, list)) else [out])]


def on_meta(values: KnownValues, x, keep: bool):
    """A real argument as the estimate holds it: a meta tensor, its value known when ``keep``."""
    if not isinstance(x, torch.Tensor):
        return x
    return known(values, x) if keep else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


# -- _pack_padded_sequence ------------------------------------------------------------------------------


LENGTHS = torch.tensor([7, 5, 5, 2])


@pytest.mark.parametrize(("batch_first", "rest"), list(itertools.product([True, False], [(), (3,), (2, 3)])))
def test_pack_padded_sequence_takes_its_rows_from_the_lengths(batch_first, rest):
    data = torch.randn((4, 7, *rest) if batch_first else (7, 4, *rest))
    real = torch._VF._pack_padded_sequence(data, LENGTHS, batch_first)
    with estimate() as (values, _):
        out = torch._VF._pack_padded_sequence(unknown(*data.shape), known(values, LENGTHS), batch_first)
    assert layouts(out) == layouts(real)
    assert not out[1].is_meta and torch.equal(out[1], real[1])  # batch_sizes stay on the host, as for real
    assert values.shapes == 1 and not values.bounded


def test_pack_padded_sequence_of_unknown_lengths_takes_every_step_of_every_sequence():
    with estimate() as (values, _):
        out, batch_sizes = torch._VF._pack_padded_sequence(unknown(4, 7, 3), unknown(4, dtype=torch.long), True)
    assert out.shape == (28, 3) and batch_sizes.shape == (7,)
    assert values.bounded == {"_pack_padded_sequence": 1}


# -- _pad_packed_sequence: the same ops as PyTorch's composite ------------------------------------------


@pytest.mark.parametrize(("batch_first", "total"), [(True, 0), (False, 0), (True, 9)])
def test_pad_packed_sequence_runs_the_ops_pytorch_composes_and_gives_its_results(batch_first, total):
    data, batch_sizes = torch._VF._pack_padded_sequence(torch.randn(4, 7, 3), LENGTHS, True)

    def run(pad):
        leaf = data.clone().requires_grad_()
        with LiveStorageTracker() as tracker:
            out, lengths = pad(leaf, batch_sizes, batch_first, -1.0, total)
            out.pow(2).sum().backward()
        return out.detach(), lengths, leaf.grad, tracker.timeline

    values = KnownValues(cpu=True)
    ours = run(lambda *args: pad_packed_sequence(values, *args))
    real = run(torch._VF._pad_packed_sequence)
    assert layout(ours[0]) == layout(real[0]) and torch.equal(ours[0], real[0])
    assert torch.equal(ours[1], real[1]) and torch.equal(ours[2], real[2])
    assert ours[3] == real[3]  # the same memory, allocation for allocation, forward and backward


class PackedLinear(nn.Module):
    """Packed sequences without a recurrent layer: pack, a layer on the packed rows, pad back."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        packed = nn.utils.rnn.PackedSequence(self.proj(packed.data), packed.batch_sizes, packed.sorted_indices,
                                             packed.unsorted_indices)
        return nn.utils.rnn.pad_packed_sequence(packed, batch_first=True, total_length=ids.shape[1])[0]


def _packed_batch(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    lengths = torch.randint(1, 12, (n,), generator=g)
    return {"ids": torch.randint(1, 20, (n, 12), generator=g), "lengths": lengths}


@pytest.mark.parametrize("engine", ENGINES)
def test_packed_sequences_are_estimated_as_the_cpu_holds_them(engine):
    workload = Workload(name="packed", model=PackedLinear, batch=_packed_batch,
                        loss=lambda m, b: m(b["ids"], b["lengths"]).pow(2).mean())
    _, real = CpuDevice(memory_budget=GiB).measure(fit_rule_work(workload, 9))
    estimator = EstimateDevice(capacity=GiB, cuda_like=False, engine=engine)
    _, est = estimator.measure(fit_rule_work(workload, 9))
    assert estimator.engine == engine
    assert est.peak_bytes == real.peak_bytes
    assert est.unknown_reads == 0 and est.answered_shapes >= 4


# -- _ctc_loss with tensor lengths ------------------------------------------------------------------------


def _ctc_inputs(concatenated: bool):
    g = torch.Generator().manual_seed(0)
    log_probs = torch.randn(30, 4, 6, generator=g).log_softmax(-1)
    target_lengths = torch.tensor([5, 9, 3, 7])
    if concatenated:
        targets = torch.randint(1, 6, (int(target_lengths.sum()),), generator=g)
    else:
        targets = torch.randint(1, 6, (4, 12), generator=g)
    return log_probs, targets, torch.tensor([30, 28, 25, 30]), target_lengths


@pytest.mark.parametrize("concatenated", [False, True])
def test_ctc_loss_takes_its_alpha_from_the_longest_target(concatenated):
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs(concatenated)
    real = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, 0, True)
    grad = torch.ones(4)
    real_back = aten._ctc_loss_backward.Tensor(grad, log_probs, targets, input_lengths, target_lengths, *real, 0, True)
    with estimate() as (values, _):
        args = (unknown(*log_probs.shape), on_meta(values, targets, False), known(values, input_lengths),
                known(values, target_lengths))
        out = aten._ctc_loss.Tensor(*args, 0, True)
        back = aten._ctc_loss_backward.Tensor(unknown(4), *args, *out, 0, True)
    assert layouts(out) == layouts(real) and layout(back) == layout(real_back)
    assert values.shapes == 1


def test_ctc_loss_of_unknown_target_lengths_takes_the_widest_target():
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs(False)
    with estimate() as (values, _):
        _, alpha = aten._ctc_loss.Tensor(unknown(*log_probs.shape), unknown(4, 12, dtype=torch.long),
                                         unknown(4, dtype=torch.long), unknown(4, dtype=torch.long), 0, False)
    assert alpha.shape == (4, 30, 2 * 12 + 1) and values.bounded == {"_ctc_loss": 1}


def test_ctc_loss_through_autograd_on_meta_matches_the_cpu():
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs(False)

    def run(tracker, log_probs, weight, *lengths):
        with tracker:
            F.ctc_loss((log_probs @ weight).log_softmax(-1), *lengths, zero_infinity=True).backward()
        return tracker

    real = run(LiveStorageTracker(), log_probs, torch.randn(6, 6, requires_grad=True), targets, input_lengths,
               target_lengths)
    values = KnownValues(MetaKernels())
    est = run(LiveStorageTracker(kernel=values, values=values, fake_scalars=True), unknown(*log_probs.shape),
              unknown(6, 6).requires_grad_(), *[known(values, t) for t in (targets, input_lengths, target_lengths)])
    assert est.peak_bytes == real.peak_bytes and est.timeline == real.timeline


# -- _embedding_bag as the CPU lays it out ---------------------------------------------------------------


BAGS = list(itertools.product(
    [aten._embedding_bag.default, aten._embedding_bag_forward_only.default],
    [0, 1, 2],                                  # sum, mean, max
    [False, True],                              # per-sample weights (sum only)
    [-1, 0],                                    # padding index
    [False, True],                              # include_last_offset
    [torch.float32, torch.bfloat16],
    [torch.long, torch.int32],                  # offsets' dtype (indices are long)
))


@pytest.mark.parametrize(("op", "mode", "scaled", "padding", "last", "dtype", "offsets_dtype"),
                         [b for b in BAGS if not (b[2] and b[1] != 0)])
def test_embedding_bag_is_laid_out_as_the_cpu_does(op, mode, scaled, padding, last, dtype, offsets_dtype):
    weight = torch.randn(50, 16, dtype=dtype)
    indices = torch.randint(0, 50, (300,))
    offsets = torch.arange(0, 300 + (1 if last else 0), 5).to(offsets_dtype)
    if last:
        offsets[-1] = 300
    scale = torch.rand(300, dtype=dtype) if scaled else None
    args = (weight, indices, offsets, False, mode, False, scale, last, padding)
    real = op(*args)
    with estimate(cpu=True) as (values, _):
        out = op(*[on_meta(values, a, keep=False) for a in args])
    assert layouts(out) == layouts(real)


def test_embedding_bag_for_a_gpu_keeps_the_meta_kernels_cuda_layout():
    args = (unknown(50, 16), unknown(300, dtype=torch.long), unknown(60, dtype=torch.long), False, 0, False, None,
            False, -1)
    expected = aten._embedding_bag.default(*args)
    with estimate(cpu=False):
        out = aten._embedding_bag.default(*args)
    assert layouts(out) == layouts(expected)


# -- data-dependent ops on known values: exact --------------------------------------------------------------


MASK = torch.tensor([[True, False, True], [False, False, True]])
DATA = torch.arange(6.0).reshape(2, 3)


@pytest.mark.parametrize("op", [
    lambda x, m: m.nonzero(), lambda x, m: x.masked_select(m), lambda x, m: x[m], lambda x, m: torch.unique(m * 2),
    lambda x, m: torch.repeat_interleave(m.sum(1)), lambda x, m: torch.bincount(m.flatten().long()),
    lambda x, m: x[m.any(1)], lambda x, m: x.unsqueeze(0).masked_select(m),
], ids=["nonzero", "masked_select", "bool index", "unique", "repeat_interleave", "bincount", "row index",
        "masked_select broadcast"])
@pytest.mark.parametrize("data_known", [True, False])
def test_data_dependent_shapes_from_known_masks_match_the_real_op(op, data_known):
    """Shapes that come from the mask alone are exact whether or not the data's values are known."""
    real = op(DATA, MASK)
    with estimate() as (values, tracker):
        out = op(on_meta(values, DATA, keep=data_known), known(values, MASK))
        value = values.value(out)
    assert out.is_meta and layout(out) == layout(real)
    if data_known or value is not None:
        assert torch.equal(value, real)
    assert not values.bounded and tracker.unknown_reads == 0
