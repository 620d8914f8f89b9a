"""Nested tensors of jagged layout on the meta engine: the estimate builds the batch's NJT on ``meta`` (values and
offsets, the offsets' values known) and its peak is the real CPU run's, to the byte; attention over NJTs, which
the CPU runs through nested tensors of strided layout, stops the estimate and says why."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nested._internal import nested_tensor

from autotune.compat import active_fake_mode
from autotune.devices import EstimateDevice, get_device, measurement
from autotune.errors import WorkloadError
from autotune.probing.fitrule import run_trial
from autotune.workload import Workload

from ..workload.batch_kinds import FEATURES, jagged, jagged_attention_workload, jagged_workload


def _from_offsets(n: int, g: torch.Generator) -> torch.Tensor:
    """An NJT made from values and offsets (no cached lengths)."""
    lengths = torch.randint(4, 17, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(torch.randn(int(offsets[-1]), FEATURES, generator=g), offsets)


def _with_holes(n: int, g: torch.Generator) -> torch.Tensor:
    """An NJT whose sequences are shorter than their slots (offsets and lengths): not contiguous."""
    slots = torch.randint(6, 17, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), slots.cumsum(0)])
    lengths = slots - torch.randint(0, 4, (n,), generator=g)
    values = torch.randn(int(offsets[-1]), FEATURES, generator=g)
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths)


def _contiguous_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    dense = batch.contiguous()  # copies the sequences out of their slots (reads the lengths)
    return (model(dense) - dense).values().pow(2).mean()


def _padded(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Sequences padded to 16 vectors, and their lengths."""
    return {"x": torch.randn(n, 16, FEATURES, generator=g), "lengths": torch.randint(4, 17, (n,), generator=g)}


def _nested_in_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """An NJT built in the forward from the batch's rows (its offsets from their sizes), each sequence's loss
    read back by unbind (which reads the offsets)."""
    rows = [batch["x"][i, :length] for i, length in enumerate(batch["lengths"].tolist())]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    return torch.stack([s.pow(2).mean() for s in (model(nested) - nested).unbind()]).mean()


WORKLOADS = {
    "list": jagged_workload(),
    "list-worst": jagged_workload(worst=True),
    "offsets": replace(jagged_workload(), batch=_from_offsets),
    "lengths": replace(jagged_workload(), batch=_with_holes, loss=_contiguous_loss),
    "in the forward": Workload(name="nested-in-forward", model=jagged_workload().model, batch=_padded,
                               loss=_nested_in_forward),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(WORKLOADS))
def test_the_estimate_of_a_jagged_batch_is_the_real_cpu_peak_to_the_byte(kind):
    """Forward over an NJT (from a list, with its cache; from offsets; with lengths, copied contiguous),
    backward, two optimizer steps: the meta engine's peak and breakdown are those of the real CPU run at every
    size, with nothing guessed (the lengths its ops read are the offsets' and lengths' values)."""
    w = WORKLOADS[kind]
    device = get_device("cpu", memory_budget=1 << 30)
    for n in (1, 4, 9):
        estimator = device.estimator()
        est = run_trial(estimator, w, n, 1 << 30, source="estimate")
        real = run_trial(device, w, n, 1 << 30, source="real", capacity_guard=False)
        assert est.measurement is not None and real.measurement is not None
        assert est.peak_bytes == real.peak_bytes, n
        assert est.measurement.breakdown == real.measurement.breakdown
        assert est.measurement.unknown_reads == 0 and estimator.engine == "meta" and estimator.fallback is None


def test_the_first_nested_view_of_a_process_is_not_counted(monkeypatch):
    """torch makes a dummy NJT of two meta tensors on the first view of values as an NJT in a process: made
    before any measurement, the first real run that builds an NJT counts no more than the estimate."""
    monkeypatch.setattr(nested_tensor, "_dummy_instance", None)
    measurement._load_dispatch_machinery.cache_clear()
    w = WORKLOADS["in the forward"]
    device = get_device("cpu", memory_budget=1 << 30)
    real = run_trial(device, w, 2, 1 << 30, source="real", capacity_guard=False)
    assert real.peak_bytes == run_trial(device.estimator(), w, 2, 1 << 30, source="estimate").peak_bytes


def test_the_batch_s_nested_tensor_lives_on_meta_with_its_offsets_known():
    """The estimate's micro-batch is an NJT of meta tensors: its values cost no memory, its offsets carry the
    host's values (a read of them is answered), its ragged size is a nested int as on the CPU."""
    seen: list[tuple] = []

    def loss(model, batch):
        seen.append((batch.is_nested, batch.layout, batch.values().device.type, batch.offsets().tolist(),
                     int(batch.offsets().diff().max()), str(batch.shape[1]).startswith("j")))
        return (model(batch) - batch).values().pow(2).mean()

    w = replace(jagged_workload(), loss=loss)
    host = w.batch(3, torch.Generator().manual_seed(0))
    run_trial(get_device("cpu").estimator(), w, 3, 1 << 30, source="estimate")
    offsets = host.offsets().tolist()
    assert seen[0] == (True, torch.jagged, "meta", offsets, max(b - a for a, b in zip(offsets, offsets[1:])), True)


def test_attention_over_a_jagged_batch_stops_the_estimate_naming_why():
    """The CPU's attention over NJTs takes the math backend, over nested tensors of strided layout: no
    shape-only engine holds one, so the estimate stops with that reason, not a guess."""
    device = get_device("cpu", memory_budget=1 << 30)
    with pytest.raises(WorkloadError, match=r"NotShapeOnly: attention over a nested tensor of jagged layout takes the "
                                        r"math backend on the cpu, which runs over nested tensors of strided "
                                        r"layout: neither meta tensors nor FakeTensorMode can hold one"):
        run_trial(device.estimator(), jagged_attention_workload(), 2, 1 << 30, source="estimate")


def test_standing_in_for_a_gpu_a_jagged_batch_runs_on_meta_and_attention_over_it_says_why():
    """An estimate of a CUDA GPU runs the NJT on meta too; CUDA's fused attention kernels over nested
    tensors it does not stand in for, and says so rather than size them as the CPU's math backend."""
    gpu = EstimateDevice.for_gpu(8 << 30)
    assert run_trial(gpu, jagged_workload(), 4, 8 << 30, source="estimate").fits
    assert gpu.engine == "meta" and gpu.fallback is None
    with pytest.raises(WorkloadError, match=r"NotShapeOnly: attention over a nested tensor of jagged layout on a "
                                            r"CUDA GPU: the estimate does not stand in for CUDA's kernels"):
        run_trial(EstimateDevice.for_gpu(8 << 30), jagged_attention_workload(), 4, 8 << 30, source="estimate")


def _autocast_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (model(batch) - batch).values().float().pow(2).mean()


def test_cpu_autocast_over_a_jagged_batch_stops_the_estimate_naming_why():
    """CPU autocast casts an NJT's ops on the CPU (the real run computes in bf16); a meta NJT takes no CPU
    autocast and would be sized in fp32: the estimate stops, saying so, rather than over-count."""
    w = replace(jagged_workload(), loss=_autocast_loss)
    with pytest.raises(WorkloadError, match=r"NotShapeOnly: CPU autocast over a nested tensor of jagged layout"):
        run_trial(get_device("cpu").estimator(), w, 2, 1 << 30, source="estimate")


class _WithRecurrent(torch.nn.Module):
    """Token-wise over an NJT, and a GRU over a dense tensor beside it (cuDNN's, standing in for a GPU)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, FEATURES)
        self.rnn = torch.nn.GRU(FEATURES, FEATURES, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rnn(torch.zeros(1, 2, FEATURES, device=x.device))
        return self.linear(x)


def test_a_jagged_batch_the_meta_engine_cannot_run_says_both_engines_reasons():
    """Where the meta engine gives way to FakeTensorMode (a GRU standing in for a GPU), FakeTensorMode cannot
    hold the NJT either: the error names both reasons, not torch's missing shape environment."""
    w = replace(jagged_workload(), model=_WithRecurrent)
    with pytest.raises(WorkloadError, match=r"NotShapeOnly: FakeTensorMode cannot hold a nested tensor of jagged "
                                            r"layout \(its ragged size needs a shape environment\); and the meta "
                                            r"engine cannot run this workload \(NeedsFakeTensors: torch.gru"):
        run_trial(EstimateDevice.for_gpu(8 << 30), w, 2, 8 << 30, source="estimate")


def test_a_jagged_batch_is_tried_shape_only_once():
    """FakeTensorMode cannot build a nested tensor: once the batch turned out to hold one, the estimate builds
    it for real only, never again first under FakeTensorMode (a wasted build of every sequence)."""
    tries: list[bool] = []

    def batch(n: int, g: torch.Generator) -> torch.Tensor:
        tries.append(active_fake_mode() is not None)
        return jagged(n, g)

    w = replace(jagged_workload(), batch=batch)
    estimator = get_device("cpu").estimator()
    run_trial(estimator, w, 2, 1 << 30, source="estimate")
    assert tries[0] and not all(tries)  # the first build tried shape-only, then built for real
    tries.clear()
    run_trial(estimator, w, 3, 1 << 30, source="estimate")
    assert tries and not any(tries)  # every micro-step's batch built for real, once
