"""A model's identical blocks: found once per probe, and the model cut to its first few of them.

A transformer's layers are one ``nn.ModuleList`` of blocks of one class. They
are *identical* here when every block and each of its submodules has the
first's class, parameter and buffer names, shapes, dtypes and ``requires_grad``,
hooks, and plain attributes (numbers, strings, flags), where an attribute may
differ only as the block's own index (``layer_idx``). A block that differs in
any of these (a sliding-window layer among full-attention ones, a hook on one
block) makes the model's blocks not identical, and it is evaluated whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..workload import Workload

MIN_BLOCKS = 6  # below this, cutting to 2 and 3 blocks saves too little
_PLAIN = (bool, int, float, str, type(None))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@dataclass(frozen=True)
class Blocks:
    """The identical blocks of a model: the path of their ``nn.ModuleList`` in it, how many, and their class."""

    path: str
    count: int
    kind: str

    def cut(self, workload: Workload, keep: int) -> Workload:
        """``workload`` whose model keeps its first ``keep`` blocks."""
        return replace(workload, model=functools.partial(_cut_model, workload.make_model, self.path, keep))

    def block_of(self, name: str) -> int | None:
        """The block a parameter, buffer or module named ``name`` (its path in the model) belongs to."""
        prefix = self.path + "."
        if not name.startswith(prefix):
            return None
        head = name[len(prefix):].split(".", 1)[0]
        return int(head) if head.isdigit() else None


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
    first = _signature(blocks[0])
    for i, block in enumerate(blocks):
        if not _same(first, _signature(block), i):
            return None, f"block {i} of {path} differs from block 0"
    found = Blocks(path, len(blocks), type(blocks[0]).__name__)
    inside = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if found.block_of(name) is not None}
    if any(id(p) in inside for name, p in model.named_parameters(remove_duplicate=False)
           if found.block_of(name) is None):
        return None, f"the blocks of {path} share parameters with the rest of the model"
    return found, ""


def _same(first: list[Any], other: list[Any], index: int) -> bool:
    """Block ``index`` is block 0's twin: equal, but for plain integers that are each block's own index."""
    if len(first) != len(other):
        return False
    for a, b in zip(first, other):
        if a == b:
            continue
        if not (a[0] == b[0] and a[1] == 0 and b[1] == index and type(a[1]) is int and type(b[1]) is int):
            return False
    return True


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
            if key.startswith("_") or not isinstance(value, (*_PLAIN, tuple)):
                continue
            if isinstance(value, tuple) and not all(isinstance(v, _PLAIN) for v in value):
                continue
            out.append((f"{name}.{key}", value))
    return out
