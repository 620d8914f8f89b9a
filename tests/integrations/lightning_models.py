"""Small LightningModules and data for the Lightning tests, in one process and under torchrun."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from autotune import Accumulator
from autotune.integrations.lightning import accumulator
from autotune.training import MixedPrecision, Sync

from .tokens import TokenNet, pad, sequences, token_loss, tokens


class TinyLM(pl.LightningModule):
    """TokenNet trained by Lightning with SGD, its loss the mean over real tokens."""

    def __init__(self, lr: float = 0.5):
        super().__init__()
        self.lr = lr
        self.net = TokenNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = token_loss(self, batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Sequences(pl.LightningDataModule):
    """Sequences of the given lengths, batched by ``batch_size`` (which AutotuneBatchSize sets), in order."""

    def __init__(self, lengths: list[int], batch_size: int = 2):
        super().__init__()
        self.batch_size = batch_size
        self.data = sequences(lengths)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=pad)


class ManualLM(TinyLM):
    """Manual optimization, one accumulated optimizer step per training_step, by ``how``:
    "autotune" (autotune.integrations.lightning.accumulator), "naive" (a plain Accumulator that says it
    synchronises when it does not), "checked" (a plain Accumulator, which refuses several ranks), "every"
    (manual_backward, but no block_backward_sync).
    ``rounds``: per optimizer step, the backward passes that communicated (DDP's all-reduce), read from
    the process group's collective counter around each backward."""

    def __init__(self, plan, how: str, lr: float = 0.5, max_norm: float | None = None):
        super().__init__(lr)
        self.automatic_optimization = False
        self.plan, self.how, self.max_norm = plan, how, max_norm
        self.rounds: list[int] = []
        self._communicated = 0

    def counted(self, backward: Callable[[torch.Tensor], None], loss: torch.Tensor) -> None:
        if not dist.is_initialized():
            return backward(loss)
        sequence = dist.group.WORLD._get_sequence_number_for_group  # type: ignore[union-attr]
        before = sequence()
        backward(loss)
        self._communicated += sequence() != before

    def manual_backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        self.counted(lambda value: super(ManualLM, self).manual_backward(value, *args, **kwargs), loss)

    def on_train_start(self) -> None:
        opt = self.optimizers()
        if self.how == "autotune":
            self.accumulate = accumulator(self, opt, self.plan, loss=token_loss, items=tokens, max_norm=self.max_norm)
        elif self.how == "every":  # manual_backward without block_backward_sync: DDP syncs every micro-step
            self.accumulate = Accumulator(self, opt, self.plan, loss=token_loss, items=tokens,
                                          parts=[MixedPrecision(backward=self.manual_backward),
                                                 Sync(no_sync=contextlib.nullcontext, external=True)])
        else:
            self.accumulate = Accumulator(self, opt, self.plan, loss=token_loss, items=tokens,
                                          parts=[Sync(external=self.how == "naive"), MixedPrecision(
                                              backward=lambda loss: self.counted(torch.Tensor.backward, loss))])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("loss", self.accumulate(batch))
        self.rounds.append(self._communicated)
        self._communicated = 0


def trainer(**kwargs) -> pl.Trainer:
    settings = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(**(settings | kwargs))
