"""Recurrent layers in the CPU estimate: seconds and bytes, meta engine vs FakeTensorMode, against the real CPU.

    python bench/recurrent_estimate.py              # ~2 min on 2 cores (FakeTensorMode on GRUs is the slow part)
    python bench/recurrent_estimate.py --repeat 5

For each workload: seconds of the estimate a probe on the CPU starts from (the
fit rule at micro-batches 2 and 3 on a fresh estimator; median of ``--repeat``)
on the meta engine and under FakeTensorMode, and the peak each estimates at
micro-batch ``--batch`` next to the real CPU's (the tracker's live bytes: equal
means to the byte). The meta engine runs an LSTM as oneDNN's kernel with its
workspace, GRUs and packed sequences through PyTorch's cells; FakeTensorMode
decomposes every layer into cells, holds no oneDNN workspace and cannot pack
sequences ("-": it failed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine
from torch import nn
from torch.nn import functional as F

from autotune.devices import CpuDevice, EstimateDevice
from autotune.errors import WorkloadError
from autotune.probing.fitrule import fit_rule_work, run_trial
from autotune.workload import Workload

GiB = 2**30


class Classifier(nn.Module):
    """Two-layer LSTM over 24 tokens, classifying from the last step (tests/realistic.py's ``lstm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(96, 32), nn.LSTM(32, 64, 2, batch_first=True), nn.Linear(64, 10)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0][:, -1])


class Encoder(nn.Module):
    """Bidirectional two-layer GRU (or LSTM) over 32 steps of 64 features, packed when ``packed``."""

    def __init__(self, kind: str, packed: bool = False) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(64, 128, 2, batch_first=True, bidirectional=True, dropout=0.1)
        self.head, self.packed = nn.Linear(256, 4), packed

    def forward(self, x):
        if not self.packed:
            return self.head(self.rnn(x)[0])
        lengths = sorted((x.shape[1] - i % 8 for i in range(x.shape[0])), reverse=True)  # known from the shape
        out = self.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True))[0]
        return self.head(nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0])


def features(n, g):
    return torch.randn(n, 32, 64, generator=g)


WORKLOADS = [
    Workload(name="lstm-classifier", model=Classifier, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
             batch=lambda n, g: (torch.randint(1, 96, (n, 24), generator=g), torch.randint(0, 10, (n,), generator=g))),
    Workload(name="lstm-2x128-bi", model=lambda: Encoder("LSTM"), batch=features, loss=lambda m, b: m(b).pow(2).mean()),
    Workload(name="gru-2x128-bi", model=lambda: Encoder("GRU"), batch=features, loss=lambda m, b: m(b).pow(2).mean()),
    Workload(name="packed-gru-2x128-bi", model=lambda: Encoder("GRU", packed=True), batch=features,
             loss=lambda m, b: m(b).pow(2).mean()),
]


def probe_estimate(workload: Workload, engine: str, repeat: int) -> float | None:
    """Median seconds of the fit rule at 2 and 3 on a fresh CPU estimator (None: the engine cannot run it)."""
    times = []
    for _ in range(repeat):
        device = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False, engine=engine)
        start = time.perf_counter()
        try:
            for b in (2, 3):
                run_trial(device, workload, b, 2**62, source="estimate")
        except WorkloadError:
            return None
        if device.engine != engine:
            raise SystemExit(f"{workload.name}: the {engine} engine fell back to FakeTensorMode ({device.fallback})")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak(device, workload: Workload, n: int) -> int | None:
    try:
        return device.measure(fit_rule_work(workload, n))[1].peak_bytes
    except Exception:  # noqa: BLE001 - an engine that cannot run the workload fails with the workload's own error
        return None


def cell(value: float | int | None, spec: str, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}{spec}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="micro-batch whose peaks are compared")
    args = parser.parse_args()
    print(machine())
    print(f"# probe est. s = the fit rule at micro-batches 2 and 3 on a fresh CPU estimator, median of {args.repeat}; "
          f"peaks at micro-batch {args.batch}: the CPU's tracker, the meta engine, FakeTensorMode")
    header = f"{'workload':20s} {'meta s':>8s} {'fake s':>8s} {'fake/meta':>9s} {'real peak':>11s} " \
             f"{'meta peak':>11s} {'fake peak':>11s}  meta = real"
    print(header)
    print("-" * len(header))
    for workload in WORKLOADS:
        seconds = {engine: probe_estimate(workload, engine, args.repeat) for engine in ("meta", "fake")}
        real = peak(CpuDevice(memory_budget=GiB), workload, args.batch)
        est = {engine: peak(EstimateDevice(capacity=GiB, round_to=1, cuda_like=False, engine=engine), workload,
                            args.batch) for engine in ("meta", "fake")}
        ratio = seconds["fake"] / seconds["meta"] if seconds["fake"] and seconds["meta"] else None
        print(f"{workload.name:20s} {cell(seconds['meta'], '.3f', 8)} {cell(seconds['fake'], '.3f', 8)} "
              f"{cell(ratio, '.1f', 8)}x {cell(real, 'd', 11)} {cell(est['meta'], 'd', 11)} "
              f"{cell(est['fake'], 'd', 11)}  {'yes' if est['meta'] == real else 'NO'}")


if __name__ == "__main__":
    main()
