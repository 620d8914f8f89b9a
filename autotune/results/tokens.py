"""TokenSteps: a plan's optimizer steps counted in tokens, as ``target_tokens`` asks (see
:mod:`autotune.planning.tokens`). No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from .record import Record, Whole


@dataclass(frozen=True, kw_only=True)
class StepTokens(Record):
    """One optimizer step: its tokens, the samples that hold them, each micro-batch's tokens, and (``pieces``)
    the tokens of each sample, or piece of a cut sample, in each micro-batch, in data order."""

    tokens: Whole
    samples: Whole
    micro_batches: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...] = ()

    def validate(self) -> None:
        if sum(self.micro_batches) != self.tokens:
            raise ValueError(f"micro-batches hold {sum(self.micro_batches)} tokens, the step {self.tokens}")
        if self.pieces and tuple(sum(p) for p in self.pieces) != tuple(self.micro_batches):
            raise ValueError(f"pieces hold {[sum(p) for p in self.pieces]} tokens, the micro-batches "
                             f"{list(self.micro_batches)}")


@dataclass(frozen=True, kw_only=True)
class TokenSteps(Record):
    """Steps of ``target_tokens`` tokens (``exact``: every one; else the closest whole samples), in
    micro-batches of at most ``micro_tokens`` = the max micro-batch x ``tokens_per_sample`` (the longest
    sample's tokens), or the tokens of the batch the probe measured where fewer; ``left_over``: tokens at the
    end that make no whole step; ``note``: all that in one line."""

    target_tokens: Whole
    micro_tokens: Whole
    tokens_per_sample: Whole
    cut: bool = False
    exact: bool
    left_over: int = 0
    steps: tuple[StepTokens, ...]
    note: str = ""

    def validate(self) -> None:
        if not self.steps:
            raise ValueError(f"no whole step of {self.target_tokens} tokens")
        if self.exact != all(s.tokens == self.target_tokens for s in self.steps):
            raise ValueError(f"exact={self.exact} but the steps hold {sorted({s.tokens for s in self.steps})} tokens")
        if any(t > self.micro_tokens for s in self.steps for t in s.micro_batches):
            raise ValueError(f"a micro-batch holds more than micro_tokens={self.micro_tokens} tokens")
