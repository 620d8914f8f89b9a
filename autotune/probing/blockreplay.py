"""An estimate of a model with N identical blocks evaluated through 2, 3 and 4 of them.

An LLM's fit rule spends its time in its blocks: every op of 32 (80) layers'
forward, recompute and backward, four micro-steps, through the tracker. When
the blocks are identical (:mod:`autotune.probing.blocks`), the estimate runs
the fit rule on the model cut to its first 3 blocks, and to its first 2 (and,
at a probe's first size, 4), each event of their traces tagged with its block
by a :class:`BlockRecorder`, and builds the whole model's trace from the
3-block one (:mod:`autotune.probing.blocktrace`), taken only when the same
pattern rebuilds the 2-block (and 4-block) trace to the byte. The caching-
allocator simulation then replays the whole model's trace, as it would an
evaluation's. Where the pattern does not hold, the model is evaluated whole
(the caller's fallback), and the probe says so.

What no cut shows is assumed away: a block whose work differs by its own index
beyond the fourth (its code reading ``layer_idx`` to do more) is not seen;
blocks that differ in class, shapes, hooks or plain attributes are
(:func:`autotune.probing.blocks.identical_blocks`).
"""

from __future__ import annotations

import copy
import itertools
from bisect import bisect_right
from dataclasses import replace
from typing import Any

import torch

from .. import log
from ..compat import current_autograd_node, next_sequence_nr, node_sequence_nr, tree_flatten
from ..devices.recorder import Recorder
from ..devices.tracker import plain_tensors
from ..errors import AutotuneError
from ..results.probe import Trial
from ..units import format_bytes
from ..workload import Workload
from .blocks import Blocks, blocks_of
from .blocktrace import NONE, Event, Tagged, blocks_trace
from .fitrule import run_trial

CUTS = (2, 3, 4)
_NEXT = -2  # a tag not known yet: the next event's
DEVICE = "device"  # the category of device memory no tensor holds (a workspace): not in the live bytes


class BlockRecorder(Recorder):
    """Tags each event of the trace of the trackers that start while it is active with its block (``NONE``
    outside every block): the block whose forward runs (global module hooks), else the block whose forward made
    the autograd node that runs (its sequence numbers), else the block of the tensors the op computes from (a
    foreach op's output, the block of its parameter); a free outside every block takes its allocation's block;
    a parameter or buffer counted when the model is placed, its block."""

    def __init__(self, blocks: Blocks):
        super().__init__(frames=False)
        self.blocks = blocks
        self.tags: list[int] = []
        self._key_tag: dict[int, int] = {}
        self._serial: dict[int, int] = {}
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, int]] = []
        self._path_block: dict[str, int | None] = {}
        self._placed: dict[int, int] = {}  # id -> block of the placed model's tensors (made anew at each placing:
        # an id of a tensor that died may be another's)
        self._func: Any = None
        self._args: tuple = ()
        self._registering: torch.Tensor | None = None
        self._foreach: dict[Any, bool] = {}
        self._last = self._last_next = NONE  # the tag of the event before
        self.tags_next: list[int] = []
        self._key_next: dict[int, int] = {}

    def bind(self, tracker: Any) -> None:
        super().bind(tracker)
        self.tags, self.tags_next, self._key_tag, self._key_next, self._serial = [], [], {}, {}, {}
        self._last = self._last_next = NONE

    # -- what the tracker tells ---------------------------------------------------------

    def alloc(self, key: int, serial: int, label: str | None = None) -> None:
        tag = self._context()
        outside = tag is None and self._outside()
        if tag is None:
            tag = self._computed_from() if outside else NONE
        nothing = tag == NONE and outside and self._registering is None  # a step counter, a scalar
        if tag == NONE:
            tag = self._last
        self._serial[key] = serial if label is None else -1  # (-1: device memory no tensor holds)
        self._key_tag[key] = tag
        self._key_next[key] = _NEXT if nothing else tag
        self._tagged(tag, _NEXT if nothing else tag)

    def free(self, key: int) -> None:
        tag = self._context()
        if tag is not None:
            self._tagged(tag, tag)
            return
        outside = self._outside()
        before = self._key_tag.get(key, NONE) if outside else NONE
        after = self._key_next.get(key, NONE) if outside else NONE
        self._tagged(self._last if before == NONE else before, self._last_next if after == NONE else after)

    def replayed_alloc(self, key: int, serial: int, tags: tuple[int, int]) -> None:
        """An allocation made again from another run (:mod:`autotune.probing.stepreuse`), with the two tags it had
        there (``serial`` -1: device memory no tensor holds)."""
        tag, with_next = tags
        self._serial[key] = serial
        self._key_tag[key] = tag
        self._key_next[key] = with_next
        self._tagged(tag, with_next)

    def state(self) -> tuple[int, int]:
        """What the tags of an allocation made from nothing next depend on: the tags of the event before."""
        return self._last, self._last_next

    def tag_of_key(self, key: int) -> int:
        """The block of the allocation ``key`` of the trace (NONE: none)."""
        return self._key_tag.get(key, NONE)

    def tag_of(self, t: torch.Tensor) -> int:
        """The block of a tensor: of the model's parameter or buffer it is, else of its allocation (NONE: none)."""
        return self._tag_of(t)

    def _tagged(self, tag: int, with_next: int) -> None:
        """Two tags for the event: made from nothing, it goes with the event before it, or with the next."""
        self.tags.append(tag)
        self.tags_next.append(with_next)
        self._last = tag
        if with_next != _NEXT:
            self._last_next = with_next

    def op(self, func: Any, args: tuple) -> None:
        self._func, self._args, self._registering = func, args, None
        self.leaf = 0

    def placing(self, model: torch.nn.Module) -> None:
        self._placed = {}
        for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                       model.named_buffers(remove_duplicate=False)):
            block = self.blocks.block_of(name)
            if block is not None:
                for held in (t, *plain_tensors(t)):  # (a DTensor's local shard too)
                    self._placed[id(held)] = block

    def registering(self, tensor: torch.Tensor) -> None:
        self._func, self._args, self._registering = None, (), tensor

    # -- modules ---------------------------------------------------------------------------

    def enter_module(self, module: torch.nn.Module, args: Any) -> None:
        """A block's forward begins: what died before it (the input of the block before last, once that block
        returned) is freed before it, with the events before it, not with its first allocation."""
        tracker = self._tracker
        if self.recording is not None and tracker is not None and self.blocks.is_block(self._path(module)):
            tracker._settle()
        super().enter_module(module, args)

    def leave_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.recording is None or not self._stack:
            return
        path, start = self._stack.pop()
        end = next_sequence_nr()
        block = self._block_of_path(path)
        if block is not None and end > start and self.blocks.is_block(path):
            self._starts.append(start)
            self._spans.append((start, end, block))

    # -- tags ------------------------------------------------------------------------------

    def _block_of_path(self, path: str) -> int | None:
        """The block of a module path; None outside blocks and for a module no block holds as a child (made in
        a forward and named where it first ran, so perhaps in another block)."""
        if path not in self._path_block:
            self._path_block[path] = None if "<" in path else self.blocks.block_of(path)
        return self._path_block[path]

    def _context(self) -> int | None:
        """The block whose forward runs, else whose forward made the backward node that runs; None outside."""
        for path, _ in reversed(self._stack):
            block = self._block_of_path(path)
            if block is not None:
                return block
        node = current_autograd_node()
        if node is None:
            return None
        seq = node_sequence_nr(node)
        i = bisect_right(self._starts, seq) - 1
        if i >= 0:
            start, end, block = self._spans[i]
            if start <= seq < end:
                return block
        return None

    def _outside(self) -> bool:
        """No module's forward and no backward runs (an optimizer step, ``zero_grad``, the fit rule's own ops)."""
        return not self._stack and current_autograd_node() is None

    def _computed_from(self) -> int:
        """The one block of what the op computes this output from (per element for a foreach op), else NONE."""
        if self._registering is not None:
            return self._placed_block(self._registering)
        if self._func is None:
            return NONE
        if self._is_foreach(self._func):
            leaf = self.leaf
            inputs = [a[leaf] for a in self._args if isinstance(a, (list, tuple)) and len(a) > leaf]
        else:
            inputs = tree_flatten(self._args)[0]
        found = {self._tag_of(t) for t in inputs if isinstance(t, torch.Tensor)} - {NONE}
        return found.pop() if len(found) == 1 else NONE

    def _placed_block(self, t: torch.Tensor) -> int:
        """The block of a parameter or buffer of the model placed (NONE for any other tensor)."""
        return self._placed.get(id(t), NONE)

    def _is_foreach(self, func: Any) -> bool:
        if func not in self._foreach:
            name = str(func)
            self._foreach[func] = "_foreach_" in name or "_fused_" in name
        return self._foreach[func]

    def _tag_of(self, t: torch.Tensor) -> int:
        placed = self._placed_block(t)
        if placed != NONE:
            return placed
        tracker = self._tracker
        entry = tracker._live.get(id(t.untyped_storage())) if tracker is not None else None
        return NONE if entry is None else self._key_tag.get(entry.tkey, NONE)

    def tagged(self, with_next: bool = True) -> Tagged:
        """The recorded trace, its tags, and each allocation's category. An allocation made from nothing outside
        every block (a step counter, a scalar) goes with the event after it (``with_next``) or before it."""
        rec = self.recording
        assert rec is not None
        categories = {key: rec.categories.get(serial, "activations") if serial >= 0 else DEVICE
                      for key, serial in self._serial.items()}
        if not with_next:
            return Tagged(list(rec.trace), list(self.tags), categories)
        tags = list(self.tags_next)
        order = range(len(tags) - 1, -1, -1)
        near = next((tags[i] for i in order if tags[i] != _NEXT), NONE)  # (at an end: the other side)
        for i in order:
            if tags[i] == _NEXT:
                tags[i] = near
            near = tags[i]
        return Tagged(list(rec.trace), tags, categories)


def found_blocks(device: Any, workload: Workload) -> Blocks | None:
    """The identical blocks of ``workload``'s model where an estimate of ``device`` can replay them (its meta
    engine simulating a caching allocator); else None."""
    if getattr(device, "engine", None) != "meta" or not getattr(device, "simulates", False):
        return None
    return blocks_of(device, workload)


def replayed_trial(device: Any, workload: Workload, blocks: Blocks, batch: int, usable: int, *, source: str,
                   cuts: tuple[int, ...] = CUTS, **rule: Any) -> Trial | None:
    """The fit rule at ``batch`` of ``workload``'s whole model from its model cut to each of ``cuts`` blocks (3,
    whose pattern is taken, and the others, which it must rebuild; see the module); None where that is not
    exact (the caller evaluates the whole model)."""
    recorders: dict[int, BlockRecorder] = {}
    measured: dict[int, Any] = {}
    cut_device = copy.copy(device)  # the cut models' traces are not replayed through the allocator simulation
    cut_device.allocator = None
    for keep in cuts:
        recorder = BlockRecorder(blocks)
        try:
            with recorder:
                done = run_trial(cut_device, blocks.cut(workload, keep), batch, usable, source=source,
                                 capacity_guard=False, **rule)
        except AutotuneError as exc:  # the model cut short fails: the whole model is evaluated instead
            log.progress(f"{blocks} not replayed: the model cut short fails ({type(exc).__name__})")
            return None
        m = done.measurement
        if m is None or recorder.recording is None or getattr(cut_device, "engine", "meta") != "meta" or \
                m.unknown_reads:
            return None
        recorders[keep], measured[keep] = recorder, m
    for with_next in (True, False):
        tagged = {keep: recorder.tagged(with_next) for keep, recorder in recorders.items()}
        made = blocks_trace(tagged.pop(3), blocks.groups, tagged)
        if made is not None:
            break
    else:
        return None
    trace, categories = made
    return _trial(device, batch, usable, source, trace, categories, measured, blocks)


def _trial(device: Any, batch: int, usable: int, source: str, trace: list[Event], categories: dict[int, str],
           measured: dict[int, Any], blocks: Blocks) -> Trial:
    """The trial whose measurement is the 3-block one's with the whole model's trace, replayed, its live bytes,
    the notes' call counts at the whole model's blocks, and the seconds of every cut model's run."""
    two, three = measured[2], measured[3]
    tracked, breakdown, timeline = walk(trace, categories, getattr(device, "round_to", 1))
    notes = tuple(_scaled(a, b, blocks.groups) for a, b in zip(two.notes, three.notes))
    cut = "blocks" if blocks.period == 1 else f"groups of {blocks.period} blocks"
    notes += (f"{blocks} estimated through the model cut to 2, 3 and 4 {cut}: the 3-{cut[:-1]} allocation trace's "
              "pattern rebuilds the others to the byte",)
    m = device.replayed(replace(three, tracked_peak_bytes=tracked, breakdown=breakdown, timeline=timeline,
                                notes=notes, seconds=sum(done.seconds for done in measured.values())), trace)
    fits = m.peak_bytes <= usable
    why = None if fits else f"peak {format_bytes(m.peak_bytes)} is over the usable {format_bytes(usable)}"
    return Trial(batch=batch, source=source, peak_bytes=m.peak_bytes, fits=fits, seconds=m.seconds,
                 why=why, allocated_bytes=m.allocated_peak_bytes, retries=m.alloc_retries, measurement=m)


def _scaled(two: str, three: str, count: int) -> str:
    """A note counting calls, at ``count`` blocks from its counts at 2 and 3 (other notes as at 3)."""
    head2, _, tail2 = two.rpartition(" (")
    head3, _, tail3 = three.rpartition(" (")
    if head2 != head3 or not (tail2.endswith(" calls)") and tail3.endswith(" calls)")):
        return three
    n2, n3 = tail2.split(" ", 1)[0], tail3.split(" ", 1)[0]
    if not (n2.isdigit() and n3.isdigit()):
        return three
    return f"{head3} ({int(n2) + (count - 2) * (int(n3) - int(n2))} calls)"


def walk(trace: list[Event], categories: dict[int, str], round_to: int = 1
         ) -> tuple[int, dict[str, int], tuple[int, ...]]:
    """The live tensor bytes through ``trace`` (each allocation rounded up to ``round_to``, as the tracker
    counts; device memory no tensor holds left out): the peak, the bytes per category at it, and the live bytes
    after each event."""
    from ..devices.tracker import CATEGORIES

    live: dict[int, int] = {}
    current = peak = 0
    peak_at = -1
    timeline: list[int] = []
    for i, (key, nbytes, _) in enumerate(trace):
        if categories.get(key) == DEVICE:
            continue
        if nbytes >= 0:
            nbytes = -(-nbytes // round_to) * round_to
            live[key] = nbytes
            current += nbytes
            if current > peak:
                peak, peak_at = current, i
        else:
            current -= live.pop(key, 0)
        timeline.append(current)
    at_peak: dict[int, int] = {}
    for key, nbytes, _ in trace[:peak_at + 1]:
        if categories.get(key) == DEVICE:
            continue
        if nbytes >= 0:
            at_peak[key] = -(-nbytes // round_to) * round_to
        else:
            at_peak.pop(key, None)
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for key, nbytes in at_peak.items():
        breakdown[categories.get(key, "activations")] += nbytes
    return peak, breakdown, tuple(timeline)
