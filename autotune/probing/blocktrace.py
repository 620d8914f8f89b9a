"""The allocation trace of a model with N identical blocks, from the traces of the same model cut to 2 and 3.

A model whose blocks are identical (see :mod:`autotune.probing.blocks`) runs
each block's work the same way: the fit rule's trace at 3 blocks, each event
tagged with the block it belongs to (the block whose forward or backward runs,
else the block of what it is computed from: a foreach optimizer step's output
per parameter; see :class:`autotune.probing.blockreplay.BlockRecorder`), reads
as stretches outside every block, kept as they are, and *block sequences*: a
block's events for each block in order (the forward, a foreach op over the
parameters) or in reverse order (the backward). The first and the last block of
a sequence may differ from the others (the first block's input is the
embedding's, the last one prefetches nothing); the middle one is the pattern
of every block between them.

:func:`synthesize` builds the trace for N blocks from the 3-block trace: the
stretches outside the blocks as they are, each block sequence as its first
block, N - 2 copies of its middle block and its last block, every free naming
its allocation by where it is (the same block, or the one before, as in the
3-block trace). Nothing is assumed: :func:`blocks_trace` builds the trace for 2
blocks the same way and takes the pattern only when it equals the measured
2-block trace to the byte (and the 3-block one is rebuilt exactly); otherwise it
returns None and the caller evaluates the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

Event = tuple[int, int, int]  # (key, nbytes, stream); nbytes -1: the key is freed
NONE = -1  # the tag of an event outside every block


class NotAPattern(Exception):
    """The tagged trace does not read as stretches and block sequences."""


@dataclass(frozen=True)
class Tagged:
    """A fit rule's allocation trace with each event's block (``NONE`` outside) and each allocation's category."""

    trace: Sequence[Event]
    tags: Sequence[int]
    categories: dict[int, str]  # allocation key -> category (parameters, gradients, ...)


# A template token: ("a", nbytes, stream, category), or ("f", (segment, whose block (see _whose), half, ordinal,
# run), the freed allocation's ("a", ...) token).
Token = tuple


@dataclass
class _Segment:
    """A stretch outside every block, or a walk over the blocks, each step to a neighbouring block, turning only
    at the first or the last (a forward up and its backward down): per run, its tag (None outside blocks; 0 the
    first block, 1 the middle one, 2 the last), its half (the walk's monotone parts, the run at a turn in the one
    before it), whether that half goes up, and its tokens."""

    runs: list[tuple[int | None, int, bool, list[Token]]]

    def blocks(self, n: int) -> list[tuple[int, int | None, int, list[Token]]]:
        """(run, block, half, tokens) of this segment at ``n`` blocks, in the order they run."""
        out: list[tuple[int, int | None, int, list[Token]]] = []
        for r, (tag, half, up, tokens) in enumerate(self.runs):
            if tag is None:
                out.append((r, None, half, tokens))
            elif tag == 1:
                out += [(r, b, half, tokens) for b in (range(1, n - 1) if up else range(n - 2, 0, -1))]
            else:
                out.append((r, 0 if tag == 0 else n - 1, half, tokens))
        return out


def _runs(tags: Sequence[int]) -> list[tuple[int, int, int]]:
    """(tag, start, end) of every maximal stretch of one tag."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(tags) + 1):
        if i == len(tags) or tags[i] != tags[start]:
            out.append((tags[start], start, i))
            start = i
    return out


def _walks(runs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int, int, bool]]]:
    """The 3-block trace's runs as segments: (tag, start, end, half, up) per run (see :class:`_Segment`)."""
    out: list[list[tuple[int, int, int, int, bool]]] = []
    for tag, start, end in runs:
        walk = out[-1] if out else None
        if walk and tag != NONE and walk[-1][0] != NONE and abs(tag - walk[-1][0]) == 1:
            last, half, up = walk[-1][0], walk[-1][3], walk[-1][4]
            going_up = tag > last
            if len(walk) == 1 or walk[-2][3] != half:  # the half's first step says where it goes
                walk[-1] = (*walk[-1][:4], going_up)
                up = going_up
            if going_up == up:
                walk.append((tag, start, end, half, up))
                continue
            if last != 1:  # a turn at the first or the last block
                walk.append((tag, start, end, half + 1, going_up))
                continue
        out.append([(tag, start, end, 0, True)])
    for walk in out:
        if [w[0] for w in walk] == [1]:
            raise NotAPattern("the middle block runs alone, not on a walk from the first or to the last")
    return out


def parse(tagged: Tagged) -> list[_Segment]:
    """The 3-block trace as segments whose frees name their allocations by where they are."""
    trace, tags = tagged.trace, tagged.tags
    if len(trace) != len(tags):
        raise NotAPattern("the tags do not cover the trace")
    where: dict[int, tuple[int, int | None, int, int, Token, int]] = {}  # key -> (segment, block, half, ordinal,
    # its token, its run)
    counts: dict[tuple[int, int | None, int], int] = {}
    segments: list[_Segment] = []
    for s, walk in enumerate(_walks(_runs(tags))):
        runs: list[tuple[int | None, int, bool, list[Token]]] = []
        for r, (tag, start, end, half, up) in enumerate(walk):
            block = None if tag == NONE else tag
            tokens: list[Token] = []
            for key, nbytes, stream in trace[start:end]:
                if nbytes >= 0:
                    ordinal = counts.get((s, block, half), 0)
                    counts[(s, block, half)] = ordinal + 1
                    token = ("a", nbytes, stream, tagged.categories.get(key, "activations"))
                    where[key] = (s, block, half, ordinal, token, r)
                    tokens.append(token)
                    continue
                if key not in where:
                    raise NotAPattern("a free of an allocation made before the trace began")
                seg, at, at_half, ordinal, made, run = where[key]
                if at is not None and block is None:
                    raise NotAPattern("an allocation of a block freed outside every block")
                tokens.append(("f", (seg, _whose(at, block), at_half, ordinal, run), made))
            runs.append((block, half, up, tokens))
        segments.append(_Segment(runs))
    return segments


def synthesize(segments: list[_Segment], n: int, grow: dict[tuple[int, int, int], int] | None = None
               ) -> tuple[list[Event], dict[int, str], list[tuple[int, int, int] | None]]:
    """The trace for ``n`` >= 2 blocks (new keys, in order), its allocations' categories, and each event's
    origin (segment, run, index of its token; None for a free). ``grow``: bytes an allocation grows by per
    block, by origin (a buffer with an entry per parameter)."""
    if n < 2:
        raise ValueError(f"a trace is made for 2 blocks or more, not {n}")
    out: list[Event] = []
    origins: list[tuple[int, int, int] | None] = []
    categories: dict[int, str] = {}
    made: dict[tuple[int, int | None, int], tuple[int, list[tuple[int, Token]]]] = {}  # -> (its run, allocations)
    aligned: dict[tuple[int, int, int], dict[int, int]] = {}
    for s, segment in enumerate(segments):
        for r, block, half, tokens in segment.blocks(n):
            allocations = made.setdefault((s, block, half), (r, []))[1]
            for i, token in enumerate(tokens):
                if token[0] == "a":
                    key = len(out) + 1
                    allocations.append((key, token))
                    origin = (s, r, i)
                    out.append((key, token[1] + (grow or {}).get(origin, 0) * (n - 3), token[2]))
                    origins.append(origin)
                    categories[key] = token[3]
                    continue
                seg, whose, at_half, ordinal, run = token[1]
                found = _find(made, aligned, segments[seg], (seg, _block(whose, block, n), at_half), ordinal, run,
                              token[2])
                if found is None:
                    raise NotAPattern(f"a free in block {block} names an allocation its pattern does not make")
                out.append((found, -1, 0))
                origins.append(None)
                continue
    return out, categories, origins


def _find(made: dict[tuple[int, int | None, int], tuple[int, list[tuple[int, Token]]]],
          aligned: dict[tuple[int, int, int], dict[int, int]], segment: _Segment, at: tuple[int, int | None, int],
          ordinal: int, run: int, token: Token) -> int | None:
    """The key of the allocation a free names: ``ordinal`` of ``at`` (segment, block, half) as the pattern
    numbered it in ``run``; where that block ran another run of the pattern (a middle block where the pattern
    had the last, whose run holds its forward and backward at once), the allocation that run's matches."""
    seg, block, half = at
    for h in (half, half + 1, half - 1):
        target = made.get((seg, block, h))
        if target is None:
            continue
        o = ordinal if target[0] == run else _alignment(aligned, segment, run, target[0]).get(ordinal, -1)
        if 0 <= o < len(target[1]) and target[1][o][1] == token:
            return target[1][o][0]
    return None


def _alignment(memo: dict[tuple[int, int, int], dict[int, int]], segment: _Segment, a: int,
               b: int) -> dict[int, int]:
    """Ordinals of run ``a``'s allocations -> those of run ``b``'s that match them (the longest matching
    stretches: the first block's run holds what the middle one does, and more)."""
    key = (id(segment), a, b)
    if key not in memo:
        first = [t for t in segment.runs[a][3] if t[0] == "a"]
        second = [t for t in segment.runs[b][3] if t[0] == "a"]
        mapping: dict[int, int] = {}
        for i, j, size in SequenceMatcher(None, first, second, autojunk=False).get_matching_blocks():
            mapping.update(zip(range(i, i + size), range(j, j + size)))
        memo[key] = mapping
    return memo[key]


def _whose(at: int | None, block: int | None) -> tuple[str, int] | None:
    """Which block's allocation a free names, as the 3-block trace says it: none (outside blocks); the first or
    the last block; else one relative to the freeing block (the middle block's neighbours)."""
    if at is None:
        return None
    if at != 1 and block != 1:
        return ("first" if at == 0 else "last", 0)
    return ("from", at - (block or 0))


def _block(whose: tuple[str, int] | None, block: int | None, n: int) -> int | None:
    """The block :func:`_whose` names, at ``n`` blocks, for a free in ``block``."""
    if whose is None:
        return None
    kind, offset = whose
    return 0 if kind == "first" else n - 1 if kind == "last" else (block or 0) + offset


def canonical(trace: Sequence[Event], categories: dict[int, str]) -> list[tuple[int, int, int, str]]:
    """The trace with its keys numbered in order of allocation (what two traces of one run share)."""
    number: dict[int, int] = {}
    out = []
    for key, nbytes, stream in trace:
        if nbytes >= 0:
            number[key] = len(number)
            out.append((number[key], nbytes, stream, categories.get(key, "activations")))
        else:
            out.append((number.get(key, -1), -1, 0, ""))
    return out


def blocks_trace(three: Tagged, n: int, checks: dict[int, Tagged]) -> tuple[list[Event], dict[int, str]] | None:
    """The trace for ``n`` blocks, when the 3-block trace's pattern rebuilds itself and each trace of
    ``checks`` (blocks -> its tagged trace; 2 among them) to the byte; None when it does not (the blocks do not
    repeat as one pattern). An allocation outside the repeated blocks may grow by the same bytes with each
    block (a buffer with an entry per parameter): the 2-block trace says by how much, the others check it."""
    try:
        segments = parse(three)
        grow = _growth(segments, checks[2])
        if grow is None:
            return None
        for count, tagged in ((3, three), *checks.items()):
            trace, categories, _ = synthesize(segments, count, grow)
            if canonical(tagged.trace, tagged.categories) != canonical(trace, categories):
                return None
        trace, categories, _ = synthesize(segments, n, grow)
        return trace, categories
    except NotAPattern:
        return None


def _growth(segments: list[_Segment], two: Tagged) -> dict[tuple[int, int, int], int] | None:
    """Bytes per block by which allocations made once grow: the 3-block pattern's sizes against the 2-block
    trace's, where the two differ in nothing else; None where they differ otherwise."""
    trace, categories, origins = synthesize(segments, 2)
    made, measured = canonical(trace, categories), canonical(two.trace, two.categories)
    if len(made) != len(measured):
        return None
    grow: dict[tuple[int, int, int], int] = {}
    for a, b, origin in zip(made, measured, origins):
        if a == b:
            continue
        if origin is None or a[1] < 0 or b[1] < 0 or (a[0], a[2], a[3]) != (b[0], b[2], b[3]) or origin in grow:
            return None
        grow[origin] = a[1] - b[1]
    return grow


