"""What exact accumulation holds on the device besides the model: the step's loss and the noise
measurement's one buffer, the same for every micro-step and step.

The runner measures the gradient noise scale on every step (see
:mod:`autotune.training.noise`). Everything that measurement keeps between
micro-steps and steps lives in one buffer made once, so it holds the same
bytes whatever the number of micro-steps or steps; the fit rule holds the same
buffer and weighs and sums the loss as the runner does, so a run at the probe's
micro-batch needs no more memory than the probe saw.
"""

from __future__ import annotations

import torch

#: Measured steps whose values stay on the device until they are read back together (one host sync).
PENDING_LIMIT = 64
#: Values kept per pending step: Σ n_i |g_i|², micro-batches, |G_N|², the GradScaler's scale.
PENDING_VALUES = 4


def noise_buffer_numel(parameters: int) -> int:
    """Values in the noise measurement's buffer for ``parameters`` parameter tensors: one norm slot per
    parameter, the step's running weighted sum, and ``PENDING_LIMIT`` rows of pending values."""
    return parameters + 1 + PENDING_LIMIT * PENDING_VALUES


def noise_buffer(parameters: int, device: torch.device | str) -> torch.Tensor:
    """The noise measurement's buffer for ``parameters`` parameter tensors (float32, zeroed)."""
    return torch.zeros(noise_buffer_numel(parameters), dtype=torch.float32, device=device)


def weighted_loss(loss: torch.Tensor, weight: float) -> torch.Tensor:
    """A micro-step's mean loss times its weight ``n_i / N``, in float32 whatever autocast computed it in."""
    return (loss if loss.dtype == torch.float32 else loss.float()) * weight


def loss_total(weighted: torch.Tensor) -> torch.Tensor:
    """The step's loss, summed on the device in place (one scalar, made before the first backward)."""
    return torch.zeros_like(weighted.detach())
