"""Token budgets: every optimizer step holds ``T`` tokens, in micro-batches of at most ``M`` tokens each.

Pure arithmetic, no torch. Samples are taken in data order, each of its length
in tokens. With whole samples a step ends where its tokens come closest to
``T``: before or after the sample that crosses ``T`` (on a tie, before; a
single sample longer than ``T`` is a step of its own); the plan states every
step's tokens and the largest distance from ``T``. With ``cut=True`` every
step holds exactly ``T``: the sample that crosses ``T`` is cut there and its
rest opens the next step, as a stream of concatenated documents is cut. Each
step's samples are filled in order into micro-batches of at most ``M``
tokens; filling each as full as the next sample allows gives the fewest
micro-batches any split in order can. A sample longer than ``M`` is cut into
pieces of at most ``M`` with ``cut=True``, and refused otherwise. Tokens that
do not make a whole step at the end are left over (stated), never a short step.

A micro-batch whose samples are padded (``width``) holds its samples times the width each is padded to:
``"longest"`` its longest sample's, ``N`` every sample's; then at most ``M`` of those padded tokens.

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError
from ..units import plural


@dataclass(frozen=True)
class Piece:
    """Tokens ``start`` .. ``start + tokens`` of sample ``sample`` (its index in data order)."""

    sample: int
    start: int
    tokens: int


@dataclass(frozen=True)
class TokenStep:
    """One optimizer step: its micro-batches, each the pieces of samples it packs, in order."""

    micro_batches: tuple[tuple[Piece, ...], ...]

    @property
    def tokens(self) -> int:
        return sum(self.micro_tokens)

    @property
    def micro_tokens(self) -> list[int]:
        return [sum(p.tokens for p in micro) for micro in self.micro_batches]

    @property
    def samples(self) -> int:
        """Samples with tokens in this step (a cut sample counts in each step it is in)."""
        return len({p.sample for micro in self.micro_batches for p in micro})


@dataclass(frozen=True)
class TokenPlan:
    """Steps of ``target_tokens`` tokens (exactly, or the closest whole samples) in micro-batches of at most
    ``micro_tokens``."""

    target_tokens: int
    micro_tokens: int
    cut: bool
    steps: tuple[TokenStep, ...]
    left_over: int  # tokens at the end that make no whole step

    @property
    def exact(self) -> bool:
        return all(s.tokens == self.target_tokens for s in self.steps)

    @property
    def largest_miss(self) -> int:
        return max((abs(s.tokens - self.target_tokens) for s in self.steps), default=0)

    def note(self) -> str:
        """What the plan holds to, in one line."""
        if self.exact:
            how = "samples cut at step boundaries" if self.cut else "whole samples"
            said = f"every step holds exactly {self.target_tokens} tokens ({how})"
        else:
            tokens = [s.tokens for s in self.steps]
            said = (f"whole samples: steps hold {min(tokens)}..{max(tokens)} tokens, the closest to the target "
                    f"{self.target_tokens} (off by at most {self.largest_miss}); cut=True makes every step exact")
        return f"{said}; {plural(len(self.steps), 'step')}, micro-batches of at most {self.micro_tokens} tokens" + (
            f"; {self.left_over} tokens at the end make no whole step" if self.left_over else "")

    def to_dict(self) -> dict[str, Any]:
        return {"target_tokens": self.target_tokens, "micro_tokens": self.micro_tokens, "cut": self.cut,
                "exact": self.exact, "left_over": self.left_over,
                "steps": [{"tokens": s.tokens, "samples": s.samples, "micro_batches": s.micro_tokens}
                          for s in self.steps]}


def plan_tokens(lengths: Sequence[int], target_tokens: int, micro_tokens: int, *, cut: bool = False,
                width: int | str | None = None) -> TokenPlan:
    """Steps of ``target_tokens`` over samples of ``lengths`` tokens (data order), micro-batches of at most
    ``micro_tokens``, padded to ``width`` (see the module docstring)."""
    _check(lengths, target_tokens, micro_tokens, cut)
    spans, left = (_cut_steps if cut else _whole_steps)([int(n) for n in lengths], target_tokens)
    steps = tuple(TokenStep(micro_batches=_fill(span, micro_tokens) if width is None else
                            _fill_padded(span, micro_tokens, width)) for span in spans)
    return TokenPlan(target_tokens=target_tokens, micro_tokens=micro_tokens, cut=cut, steps=steps, left_over=left)


def _check(lengths: Sequence[int], target: int, micro: int, cut: bool) -> None:
    for what, value in (("target_tokens", target), ("micro_tokens", micro)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{what} must be a whole number of tokens, at least 1, got {value!r}")
    if any(int(n) < 1 for n in lengths):
        raise PlanError(f"every sample needs at least 1 token, got a length of {min(int(n) for n in lengths)}")
    longest = max((int(n) for n in lengths), default=0)
    if not cut and longest > micro:
        raise PlanError(f"a sample of {longest} tokens is more than a micro-batch holds ({micro} tokens): give "
                        "cut=True to cut long samples, or a micro-batch of more tokens")


def _whole_steps(lengths: list[int], target: int) -> tuple[list[list[Piece]], int]:
    """Steps of whole samples, each ending where its tokens come closest to ``target``."""
    steps: list[list[Piece]] = []
    i = 0
    while i < len(lengths):
        total, j = 0, i
        while j < len(lengths) and total + lengths[j] <= target:
            total += lengths[j]
            j += 1
        if j < len(lengths) and (j == i or total + lengths[j] - target < target - total):
            j += 1  # the sample that crosses the target brings the step closer to it
        elif j == len(lengths) and total < target:
            return steps, total  # the rest makes no whole step
        steps.append([Piece(s, 0, lengths[s]) for s in range(i, j)])
        i = j
    return steps, 0


def _cut_steps(lengths: list[int], target: int) -> tuple[list[list[Piece]], int]:
    """Steps of exactly ``target`` tokens of the samples' stream, a sample cut where a step ends."""
    steps: list[list[Piece]] = []
    step: list[Piece] = []
    room = target
    for sample, length in enumerate(lengths):
        start = 0
        while start < length:
            take = min(room, length - start)
            step.append(Piece(sample, start, take))
            start, room = start + take, room - take
            if room == 0:
                steps.append(step)
                step, room = [], target
    return steps, target - room if step else 0


def _fill(pieces: list[Piece], micro: int) -> tuple[tuple[Piece, ...], ...]:
    """``pieces`` in order into micro-batches of at most ``micro`` tokens, each as full as the next piece allows;
    a piece longer than ``micro`` (only with cut) fills the micro-batch it starts in, then whole ones."""
    out: list[tuple[Piece, ...]] = []
    now: list[Piece] = []
    room = micro
    for piece in pieces:
        done = 0
        while done < piece.tokens:
            rest = piece.tokens - done
            if room < rest <= micro:  # fits a micro-batch of its own whole: it starts the next one
                out.append(tuple(now))
                now, room = [], micro
            take = min(rest, room)
            now.append(Piece(piece.sample, piece.start + done, take))
            done, room = done + take, room - take
            if room == 0:
                out.append(tuple(now))
                now, room = [], micro
    if now:
        out.append(tuple(now))
    return tuple(out)


def _fill_padded(pieces: list[Piece], micro: int, width: int | str) -> tuple[tuple[Piece, ...], ...]:
    """``pieces`` in order into micro-batches of at most ``micro`` padded tokens (samples x the width each is
    padded to), each as full as the next piece allows: the fewest any split in order can (a part of a micro-batch
    that fits never holds more padded tokens than the whole)."""
    out: list[tuple[Piece, ...]] = []
    now: list[Piece] = []
    for piece in pieces:
        wide = max([p.tokens for p in now] + [piece.tokens]) if width == "longest" else int(width)
        if now and (len(now) + 1) * wide > micro:
            out.append(tuple(now))
            now = []
        now.append(piece)
    if now:
        out.append(tuple(now))
    return tuple(out)
