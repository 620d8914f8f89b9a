"""Running a plan in tokens (``Plan.tokens``): each optimizer step is the plan's step, its samples of the
planned lengths (the workload's ``lengths_batch``), in the planned micro-batches, each weighted ``n_i / N``
by the items its loss counts (the Accumulator's weighting, exact for any split). A piece of a sample cut at
a step's end is a sample of its own. The steps are the plan's in order, from the first again past its last.

What the run checks beside the sample plan's checks: every step fed exactly the plan's tokens, micro-batch
by micro-batch, counted by the workload (``Workload.count_tokens``) on the micro-batches as split.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BadInput
from ..results.run import Check
from ..results.tokens import StepTokens, TokenSteps
from ..units import plural
from ..workload import Workload
from ..workload.batches import count_samples, split_batch


class TokenFeed:
    """The batches of a plan in tokens, step by step, and the tokens each micro-batch held."""

    def __init__(self, tokens: TokenSteps, workload: Workload):
        if not all(s.pieces for s in tokens.steps):
            raise BadInput("the plan in tokens names no sample lengths per micro-batch (a plan file of an older "
                           "autotune): plan it again with autotune plan --target-tokens")
        lengths = {n for s in tokens.steps for micro in s.pieces for n in micro}
        if workload.lengths_batch is None and len(lengths) > 1:
            raise BadInput(f"the plan in tokens holds samples of {min(lengths)}..{max(lengths)} tokens and workload "
                           f"{workload.name!r} cannot build samples of given lengths: give the workload "
                           "lengths_batch=lambda lengths, generator: <one sample of each length>")
        self.tokens, self.workload = tokens, workload
        self.done = 0
        self.counted: list[tuple[int, ...]] = []  # tokens per micro-batch, step by step, as fed
        self.planned: list[tuple[int, ...]] = []

    def step(self, i: int) -> StepTokens:
        return self.tokens.steps[i % len(self.tokens.steps)]

    @staticmethod
    def sizes(step: StepTokens) -> list[int]:
        """Samples in each of the step's micro-batches."""
        return [len(micro) for micro in step.pieces]

    def batch(self, step: StepTokens, generator: torch.Generator) -> Any:
        """The step's samples, one of each planned length in order."""
        w, lengths = self.workload, [n for micro in step.pieces for n in micro]
        if w.lengths_batch is None:
            return w.make_batch(len(lengths), generator)
        batch = w.lengths_batch(lengths, generator)
        if count_samples(batch, w.samples) != len(lengths):
            raise BadInput(f"workload {w.name!r}: lengths_batch(<{len(lengths)} lengths>, generator) built "
                           f"{count_samples(batch, w.samples)} samples: it must build one sample per length")
        return batch

    def next(self, generator: torch.Generator) -> tuple[Any, list[int]]:
        """The next step's batch and its micro-batches' samples; its micro-batches' tokens counted."""
        step = self.step(self.done)
        self.done += 1
        sizes = self.sizes(step)
        batch = self.batch(step, generator)
        w = self.workload
        parts = split_batch(batch, sizes, samples=w.samples, split=w.split)
        self.counted.append(tuple(w.count_tokens(p) for p in parts))
        self.planned.append(tuple(step.micro_batches))
        return batch, sizes

    def check(self) -> Check:
        """Every step fed the plan's tokens, micro-batch by micro-batch."""
        t = self.tokens
        bad = [i for i, (got, want) in enumerate(zip(self.counted, self.planned)) if got != want]
        steps = len(self.counted)
        totals = [sum(c) for c in self.counted]
        details = {"target_tokens": t.target_tokens, "step_tokens": totals}
        if bad:
            i = bad[0]
            return Check(name="tokens", passed=False, value=steps - len(bad), limit=steps, details=details,
                         message=f"step {i + 1} fed {sum(self.counted[i])} tokens in micro-batches of "
                                 f"{list(self.counted[i])}, the plan {list(self.planned[i])}: the batches do not "
                                 f"hold the planned lengths ({len(bad)} of {plural(steps, 'step')} wrong)")
        said = (f"exactly the target {t.target_tokens} tokens" if all(n == t.target_tokens for n in totals) else
                f"the plan's {min(totals)}..{max(totals)} tokens (whole samples closest to {t.target_tokens})")
        return Check(name="tokens", passed=True, value=steps, limit=steps, details=details,
                     message=f"every one of {plural(steps, 'step')} fed {said}, micro-batch by micro-batch")
