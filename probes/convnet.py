"""A small conv net with BatchNorm on random 32x32 images.

BatchNorm normalises each micro-batch with its own statistics, so gradients
accumulated over micro-batches differ from the full batch's: the runner's
verifier names these layers and measures the difference.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune import Workload

CLASSES = 10
SIZE = 32


def model() -> nn.Module:
    def stage(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *stage(3, 16, 1), *stage(16, 32, 2), *stage(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES),
    )


def batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(size, 3, SIZE, SIZE, generator=generator)
    labels = torch.randint(0, CLASSES, (size,), generator=generator)
    return images, labels


def loss(net: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = data
    return nn.functional.cross_entropy(net(images), labels)


def build() -> Workload:
    return Workload(name="convnet", model=model, batch=batch, loss=loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
