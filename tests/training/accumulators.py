"""Accumulators for the training tests: one that measures the noise scale with a class of the test's choosing, and
planted faults of exact accumulation (each breaks one rule the runner's verification exists to catch)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from autotune.training.accumulate import Accumulator
from autotune.training.noise import GradientNoiseScale, NoiseScale
from autotune.training.precision import MixedPrecision
from autotune.training.sync import Sync
from autotune.workload.batches import batch_size


class NoisyAccumulator(Accumulator):
    """``Accumulator`` measuring with ``noise_cls`` (a planted fault's class, or the real one)."""

    noise_cls = GradientNoiseScale

    def __init__(self, model, optimizer, schedule, *, noise_scale=True, precision="fp32", rank=None, world_size=None,
                 **kwargs):
        sync = Sync(rank=rank, world_size=world_size)
        measurer = self.noise_cls(model.parameters(), world_size=sync.world_size) if noise_scale \
            else NoiseScale(measure=False)
        super().__init__(model, optimizer, schedule, parts=[measurer, MixedPrecision(precision), sync], **kwargs)


# -- planted faults --------------------------------------------------------------------------------


class NaiveOneOverK(Accumulator):
    """Fault: every micro-step weighted 1/k, whatever its size."""

    def weight(self, n_items, total_items):
        return 1.0 / len(self.sizes)


class PerSequenceMeans(Accumulator):
    """Fault: micro-batches weighted by sequences, not by the tokens their means are over."""

    def count_items(self, micro, samples=None):
        return batch_size(micro)


class ClipsEveryMicroStep(Accumulator):
    """Fault: clips the gradient after every micro-step instead of once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        move = self.move

        def clip_then_move(micro):
            self.clip()
            return move(micro)

        self.move = clip_then_move


class DropsASample(Accumulator):
    """Fault: the last micro-batch loses its last sample."""

    def split(self, batch):
        parts = super().split(batch)
        parts[-1] = tree_map(lambda t: t[:-1] if isinstance(t, torch.Tensor) else t, parts[-1])
        return parts


class CountsASampleTwice(Accumulator):
    """Fault: the first sample is fed again with the last micro-batch."""

    def split(self, batch):
        parts = super().split(batch)
        parts[-1] = tree_map(lambda a, b: torch.cat([a, b[:1]]) if isinstance(a, torch.Tensor) else a,
                             parts[-1], parts[0])
        return parts
