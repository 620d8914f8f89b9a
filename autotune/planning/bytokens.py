"""A plan in tokens: each optimizer step holds ``target_tokens`` tokens (exactly, or the closest whole
samples, stated), from the samples' lengths and the probe's max micro-batch.

The samples' lengths are given (``lengths``), or every sample holds what the workload's loss counts in
a 1-sample batch (``Workload.count_items``), which must then be the same for every sample. A
micro-batch holds at most max micro-batch x the longest sample's tokens (the probe measured that many
samples of the worst case), and no more than the batch the probe measured held (a packed row's memory
follows its tokens). The sample plan beside it is that of the step with the most samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import BadInput
from ..results.tokens import StepTokens, TokenSteps
from .tokens import plan_tokens

#: 1-sample batches drawn to see that every sample holds the same tokens.
DRAWS = 4


def lengths_of(lengths: object) -> tuple[int, ...] | None:
    """``lengths`` checked: None, or whole numbers of at least 1."""
    if lengths is None:
        return None
    if not isinstance(lengths, Sequence) or not lengths or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise BadInput(f"lengths must be a file or a list of whole numbers of tokens, at least 1 each, got "
                       f"{str(lengths)[:60]}")
    return tuple(lengths)


def tokens_per_sample(workload: Any) -> int:
    """What every sample of ``workload`` holds, counted by its loss (``items``) on 1-sample batches."""
    import torch

    counts = {workload.count_items(workload.make_batch(1, torch.Generator().manual_seed(seed)))
              for seed in range(DRAWS)}
    if len(counts) > 1:
        raise BadInput(f"workload {workload.name!r}: its samples hold different tokens ({min(counts)}..{max(counts)} "
                       "in 1-sample batches): give the samples' lengths, lengths=[...] (--lengths FILE)")
    (count,) = counts
    if count < 1:
        raise BadInput(f"workload {workload.name!r}: a sample holds {count} tokens: give lengths=[...] "
                       "(--lengths FILE)")
    return count


def one_step(per_sample: int, target_tokens: int) -> tuple[int, ...]:
    """Samples of ``per_sample`` tokens that make one step closest to ``target_tokens`` (on a tie, the fewer)."""
    k = target_tokens // per_sample
    if k == 0 or (k + 1) * per_sample - target_tokens < target_tokens - k * per_sample:
        k += 1
    return (per_sample,) * k


def most_samples(lengths: Sequence[int], target_tokens: int, *, cut: bool = False) -> int:
    """The most samples any step of ``target_tokens`` holds (a cut sample in each step it is in): the sample
    plan's target batch."""
    token_plan = plan_tokens(lengths, target_tokens, max(target_tokens, max(lengths)), cut=cut)
    if not token_plan.steps:
        raise BadInput(f"the samples hold {sum(lengths)} tokens, less than one step of {target_tokens}: give a "
                       "smaller target_tokens or more samples")
    return max(s.samples for s in token_plan.steps)


def probed_tokens(workload: Any, max_micro_batch: int) -> int:
    """Tokens in the batch of ``max_micro_batch`` samples the probe measured (``Workload.count_tokens``)."""
    import torch

    return workload.count_tokens(workload.make_batch(max_micro_batch, torch.Generator().manual_seed(0)))


def token_steps(lengths: Sequence[int], target_tokens: int, max_micro_batch: int, *, cut: bool = False,
                probed: int | None = None, width: int | str | None = None) -> TokenSteps:
    """The steps of ``target_tokens`` in micro-batches of at most ``max_micro_batch`` longest samples' tokens,
    and at most ``probed`` (the tokens of the batch the probe measured, where known: a packed row's memory
    follows its tokens) (``cut``: every step exactly ``target_tokens``, a sample cut where a step ends).
    ``width``: samples padded to their micro-batch's longest (``"longest"``) or to ``width`` tokens each, the
    micro-batch then holding at most ``max_micro_batch`` samples of that width, padding counted."""
    longest = max(lengths)
    if width is None:
        micro = max_micro_batch * longest if probed is None else min(max_micro_batch * longest, probed)
    else:
        micro = max_micro_batch * (longest if width == "longest" else int(width))
    token_plan = plan_tokens(lengths, target_tokens, micro, cut=cut, width=width)
    steps = tuple(StepTokens(tokens=s.tokens, samples=s.samples, micro_batches=tuple(s.micro_tokens),
                             pieces=tuple(tuple(p.tokens for p in micro) for micro in s.micro_batches))
                  for s in token_plan.steps)
    return TokenSteps(target_tokens=target_tokens, micro_tokens=token_plan.micro_tokens, tokens_per_sample=longest,
                      cut=token_plan.cut, exact=token_plan.exact, left_over=token_plan.left_over, steps=steps,
                      note=f"target {target_tokens} tokens: {token_plan.note().replace('cut=True', 'cutting samples')}"
                      + ("" if width is None else " (padding counted)"))
