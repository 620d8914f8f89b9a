"""A model's identical blocks: found once per probe, and the model cut to its first few of them.

A transformer's layers are one ``nn.ModuleList`` of blocks of one class. They
are *identical* here when every block and each of its submodules has the
first's class, parameter and buffer names, shapes, dtypes and ``requires_grad``,
hooks, methods set on the instance (a checkpointing wrapper), and plain
attributes (numbers, strings, flags), where an attribute may differ only as the
block's own index (``layer_idx``). Blocks may also repeat with a period: a
sliding-window layer then a full-attention one, a block checkpointed then one
not; each group of ``period`` blocks is then the unit that repeats. Blocks that
repeat no way (a hook on one block) are evaluated whole.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..errors import AutotuneError
from ..workload import Workload

MIN_BLOCKS = 6  # below this many repeated groups, cutting to 2, 3 and 4 of them saves too little
PERIODS = (1, 2, 3, 4)  # the blocks a repeated group may hold
_PLAIN = (bool, int, float, str, type(None))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@dataclass(frozen=True)
class Blocks:
    """The identical blocks of a model: the path of their ``nn.ModuleList`` in it, how many, their class, and
    how many blocks a repeated group holds (``period``)."""

    path: str
    count: int
    kind: str
    period: int = 1

    @property
    def groups(self) -> int:
        """How many times the group of ``period`` blocks repeats."""
        return self.count // self.period

    def __str__(self) -> str:
        each = "" if self.period == 1 else f", repeating every {self.period}"
        return f"{self.count} {self.kind} blocks{each}"

    def cut(self, workload: Workload, keep: int) -> Workload:
        """``workload`` whose model keeps its first ``keep`` groups of blocks."""
        return replace(workload, model=functools.partial(_cut_model, workload.make_model, self.path,
                                                         keep * self.period))

    def block_of(self, name: str) -> int | None:
        """The group of blocks a parameter, buffer or module named ``name`` (its path in the model) belongs to."""
        prefix = self.path + "."
        if not name.startswith(prefix):
            return None
        head = name[len(prefix):].split(".", 1)[0]
        return int(head) // self.period if head.isdigit() else None

    def is_block(self, name: str) -> bool:
        """Is ``name`` the path of one of the blocks themselves?"""
        return name.startswith(self.path + ".") and name[len(self.path) + 1:].isdigit()


def blocks_of(estimate: Any, workload: Workload) -> Blocks | None:
    """The identical blocks of ``workload``'s model, built on ``estimate`` (on ``meta``, as the GPU it stands in
    for where it stands in for one); None where they are not identical or the model cannot be built there."""
    try:
        with getattr(estimate, "standing_in", contextlib.nullcontext)(), torch.device("meta"):
            model = workload.make_model()
    except AutotuneError:  # (a factory that needs a real device: the whole model is evaluated)
        return None
    return identical_blocks(model)[0]


def _cut_model(factory: Callable[[], nn.Module], path: str, keep: int) -> nn.Module:
    model = factory()
    blocks = model.get_submodule(path)
    assert isinstance(blocks, nn.ModuleList)
    del blocks[keep:]
    return model


def identical_blocks(model: nn.Module) -> tuple[Blocks | None, str]:
    """The model's identical blocks (its ``nn.ModuleList`` holding the most parameters), or None and why not."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None, "the model has no nn.ModuleList of blocks"
    path, blocks = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    if len(blocks) < MIN_BLOCKS:
        return None, f"{len(blocks)} blocks are too few to replay"
    signatures = [_signature(block) for block in blocks]
    period = next((p for p in PERIODS if len(blocks) % p == 0 and len(blocks) // p >= MIN_BLOCKS and
                   all(_same(signatures[i % p], signatures[i], i % p, i) for i in range(len(blocks)))), None)
    if period is None:
        differs = next((i for i in range(len(blocks)) if not _same(signatures[0], signatures[i], 0, i)), 0)
        return None, f"block {differs} of {path} differs from block 0"
    found = Blocks(path, len(blocks), type(blocks[0]).__name__, period)
    inside = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if found.block_of(name) is not None}
    if any(id(p) in inside for name, p in model.named_parameters(remove_duplicate=False)
           if found.block_of(name) is None):
        return None, f"the blocks of {path} share parameters with the rest of the model"
    return found, ""


def _same(first: list[Any], other: list[Any], first_index: int, index: int) -> bool:
    """Block ``index`` is the twin of block ``first_index``: equal, but for plain integers that are each block's
    own index."""
    if len(first) != len(other):
        return False
    for a, b in zip(first, other):
        if a == b:
            continue
        if not (a[0] == b[0] and a[1] == first_index and b[1] == index and type(a[1]) is int and
                type(b[1]) is int):
            return False
    return True


def _callable_name(value: Any) -> str:
    """What a callable set on an instance runs (a bound method's or a partial's function)."""
    for attr in ("func", "__func__"):
        while hasattr(value, attr):
            value = getattr(value, attr)
    return getattr(value, "__qualname__", type(value).__name__)


def _signature(block: nn.Module) -> list[Any]:
    """What must be equal in two identical blocks (see the module)."""
    out: list[Any] = []
    for name, module in block.named_modules():
        out.append((name, type(module)))
        for pname, p in module.named_parameters(recurse=False):
            out.append((pname, (tuple(p.shape), p.dtype, p.requires_grad)))
        for bname, b in module.named_buffers(recurse=False):
            out.append((bname, (tuple(b.shape), b.dtype)))
        for hooks in _HOOKS:
            table = getattr(module, hooks, None) or {}
            out.append((hooks, tuple(getattr(h, "__qualname__", type(h).__name__) for h in table.values())))
        for key, value in sorted(vars(module).items()):
            if callable(value) and not isinstance(value, nn.Module):  # a method set on the instance (a wrapper)
                out.append((f"{name}.{key}", _callable_name(value)))
                continue
            if key.startswith("_") or not isinstance(value, (*_PLAIN, tuple)):
                continue
            if isinstance(value, tuple) and not all(isinstance(v, _PLAIN) for v in value):
                continue
            out.append((f"{name}.{key}", value))
    return out
