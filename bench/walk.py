"""The path the workload takes through autotune on its way from ``autotune.plan`` to the plan.

    python bench/walk.py                              # estimate and cpu: no store, a cold store, a warm one
    python bench/walk.py --devices estimate --calls   # every traced call, in order, with its caller
    python bench/walk.py --no-keys --inside           # the workload alone, into the probe's every trial

Each scenario runs ``autotune.plan`` on the built-in ``mlp`` probe (the README's
``--target-batch 1021 --memory-budget 3MB``, a second or so) under ``sys.setprofile``:
without a store, with a new SQLite store in a temporary folder (cold: probed and
kept), and again on that store (warm: answered from it; on the cpu after one
confirm run). One untraced plan runs first, so that imports are done.

What is followed: every call of a function defined under autotune/ that is given
the workload: the Workload object, a ProbeRequest or PlanRequest (they name it
before it is loaded and carry it to every stage), or, in the store, its
fingerprint (the Fingerprint, and its digest: the key the store knows it by;
``--no-keys`` leaves the key out). Given means: as an argument or a variable the
function closes over, or one level inside one (an attribute of an argument
object, an item of a tuple, list or dict, a variable a function argument closes
over; the digest as itself, an item of a tuple or list or a closed-over
variable, not as a field of a record that notes it). A resumed generator is not
a new call.

How deep: the walk goes down the layers that hand the workload from stage to
stage (ROUTES: the package root, api, integrations, cli, serve, store). A call
into any other layer (the stages: probing, planning, training, workload,
devices, results, ...) counts, and what that call does inside is the stage's own
work (the probe's estimate evaluations and real runs, the fingerprint's trace on
the estimate), not the path, unless it calls back into a route (then that call
counts, as a climb). ``--inside`` follows into the stages too: its figures grow
with every evaluation and real run the probe makes, whatever the path.

What is counted, over the traced calls in order:

- stays: maximal runs of consecutive calls in one file;
- files: the distinct files;
- climbs: calls into a file of a higher layer than their caller's (the nearest
  frame under autotune/ above the call): a lower layer calling back a higher one;
- returns: stays in a file the walk had left before (stays - files);
- ups: steps from one stay to the next into a higher layer, the walk going back
  up whether by a callback or by going on above after a call below returned (a
  wider count than climbs, for comparison: every call that goes down and comes
  back makes one; not part of the acceptance).

Layers come from the package's own imports: a part (a top-level module or
folder of autotune/) that imports no other part is layer 0, any other one above
the highest part it imports (a circle between parts is an error); the package
root, whose names load the verbs lazily, from strings, is on top. The first
lines print the order found. ``ok``: the acceptance of the walk, at most 20
stays and 3 climbs (tests/test_walk.py holds it on the estimate).
"""

from __future__ import annotations

import argparse
import ast
import dis
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import autotune
from autotune.results.request import PlanRequest, ProbeRequest
from autotune.store.fingerprint import Fingerprint
from autotune.workload import Workload

PACKAGE = Path(autotune.__file__).resolve().parent
#: The layers whose calls are followed down: they hand the workload from one stage to the next.
ROUTES = frozenset({"__init__", "api", "integrations", "cli", "serve", "store"})
#: What "the workload" is, wherever it travels.
FOLLOW: tuple[type, ...] = (Workload, ProbeRequest, PlanRequest)
#: The acceptance of issue 30, point 2.
MAX_STAYS, MAX_CLIMBS = 20, 3
#: The README's small plan: the mlp probe, a 3 MB budget on the cpu; the estimate stands in for a 24 GiB GPU.
TARGET, PROBE = 1021, "mlp"
BUDGETS = {"cpu": "3MB", "estimate": "24GiB"}
#: How many items of a container, or attributes of an object, are looked at.
LOOK = 64

_GENERATOR = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


def part_of(path: Path) -> str:
    """The part of the package a file belongs to: its top folder, or its module's name (``__init__``: the root)."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_parts(path: Path) -> set[str]:
    """The parts of the package ``path`` imports (lazy and type-checking imports too; the root's version and
    lazy names aside, as the import-layer test has them)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1])  # what a relative import starts from: the module's package, or the package's own
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - (node.level - 1)] if node.level else []
            target = [*base, *(node.module.split(".") if node.module else [])]
            names = [target + [a.name] for a in node.names] if len(target) == 1 else [target]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for name in names:
            if name[0] == "autotune" and len(name) > 1 and ((PACKAGE / name[1]).is_dir()
                                                             or (PACKAGE / f"{name[1]}.py").exists()):
                found.add(name[1])
    return found


def layers() -> dict[str, int]:
    """Each part's layer, from the imports: 0 for a part that imports no other, else one above the highest part
    it imports. ValueError when two parts import each other (then there is no order)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if "probes" in path.relative_to(PACKAGE).parts:
            continue
        here = part_of(path)
        graph.setdefault(here, set()).update(_imported_parts(path) - {here, "__init__"})
    rank: dict[str, int] = {}

    def rank_of(part: str, seen: tuple[str, ...] = ()) -> int:
        if part in seen:
            raise ValueError(f"the parts {' -> '.join((*seen, part))} import each other: no layer order")
        if part not in rank:
            rank[part] = 1 + max((rank_of(p, (*seen, part)) for p in graph.get(part, ())), default=-1)
        return rank[part]

    for part in graph:
        rank_of(part)
    rank["__init__"] = max(rank.values()) + 1  # the package root: its names load the verbs lazily, from strings
    return rank


def layer_order(rank: dict[str, int]) -> str:
    """The layers as one line, lowest first."""
    by = [sorted(p for p in rank if rank[p] == r) for r in range(max(rank.values()) + 1)]
    return " < ".join("/".join(ps) for ps in by if ps)


# ---- the tracer -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One traced call: the file (relative to the package) and function, and the file of the caller."""

    file: str
    function: str
    caller: str | None


def _held(value: Any, follow: tuple[type, ...], keys: set[str]) -> bool:
    """Is ``value`` the workload or its key, or does it hold one of them one level down (an attribute, an
    item, a variable a function closes over)? A key counts as itself, an item of a tuple or list or a
    variable a function closes over, never as a value of a record that notes it (a result's
    ``fingerprint``, a row)."""
    if isinstance(value, follow) or (isinstance(value, str) and value in keys):
        return True
    if value is None or isinstance(value, (str, bytes, int, float, bool, type, types.ModuleType)):
        return False
    if isinstance(value, (tuple, list, set, frozenset, types.FunctionType)):
        items = list(value)[:LOOK] if not isinstance(value, types.FunctionType) else \
            [c.cell_contents for c in (value.__closure__ or ()) if _filled(c)]
        return any(isinstance(v, follow) or (isinstance(v, str) and v in keys) for v in items)
    if isinstance(value, dict):
        inside = list(value.values())[:LOOK]
    else:
        attrs = getattr(value, "__dict__", None)
        inside = list(attrs.values())[:LOOK] if isinstance(attrs, dict) else \
            [getattr(value, s, None) for s in getattr(type(value), "__slots__", ())][:LOOK]
    return any(isinstance(v, follow) for v in inside)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


@dataclass
class Walk:
    """``sys.setprofile``'s callback that records the calls given the workload (see the module); use as
    ``with walk.tracing(): ...``, then read ``walk.calls``."""

    follow: tuple[type, ...] = FOLLOW
    keys: bool = True
    inside: bool = False
    calls: list[Call] = field(default_factory=list)
    _digests: set[str] = field(default_factory=set)
    _parts: dict[types.CodeType, str | None] = field(default_factory=dict)
    _starts: dict[types.CodeType, int] = field(default_factory=dict)
    _depth: int = 0
    _stage: int | None = None  # the depth of the stage the walk is inside, if any

    @contextmanager
    def tracing(self) -> Iterator[Walk]:
        before = sys.getprofile()
        sys.setprofile(self._event)
        try:
            yield self
        finally:
            sys.setprofile(before)

    def _part(self, code: types.CodeType) -> str | None:
        if code not in self._parts:
            path = Path(code.co_filename)
            inside = path.is_absolute() and PACKAGE in path.resolve().parents
            self._parts[code] = part_of(path.resolve()) if inside else None
        return self._parts[code]

    def _event(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "return":
            if self.keys and isinstance(arg, Fingerprint):
                self._digests.add(arg.digest)
            if self._stage == self._depth:
                self._stage = None
            self._depth -= 1
            return
        if event != "call":
            return
        self._depth += 1
        code = frame.f_code
        part = self._part(code)
        if part is None or (self._stage is not None and part not in ROUTES):
            return
        if self._stage is None and part not in ROUTES and not self.inside:
            self._stage = self._depth
        if not self._resumed(frame) and self._given(frame):
            self.calls.append(Call(self._name(code), code.co_name, self._caller(frame)))

    def _resumed(self, frame: types.FrameType) -> bool:
        """A generator resumed, not called."""
        code = frame.f_code
        if not code.co_flags & _GENERATOR:
            return False
        if code not in self._starts:
            self._starts[code] = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), -1)
        return frame.f_lasti > self._starts[code]

    def _given(self, frame: types.FrameType) -> bool:
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
        here = frame.f_locals
        follow = (*self.follow, Fingerprint) if self.keys else self.follow
        return any(_held(here.get(name), follow, self._digests)
                   for name in (*code.co_varnames[:count], *code.co_freevars))

    def _caller(self, frame: types.FrameType) -> str | None:
        up = frame.f_back
        while up is not None and self._part(up.f_code) is None:
            up = up.f_back
        return self._name(up.f_code) if up is not None else None

    @staticmethod
    def _name(code: types.CodeType) -> str:
        return Path(code.co_filename).resolve().relative_to(PACKAGE).as_posix()


# ---- what the walk comes to -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """The walk's counts (see the module) and its stays: (file, functions in order, whether a climb called
    one of them)."""

    calls: int
    stays: int
    files: int
    climbs: int
    returns: int
    ups: int
    path: tuple[tuple[str, tuple[str, ...], bool], ...]

    @property
    def ok(self) -> bool:
        return self.stays <= MAX_STAYS and self.climbs <= MAX_CLIMBS


def layer_of(file: str, rank: dict[str, int]) -> int:
    return rank[file.split("/")[0] if "/" in file else file.removesuffix(".py")]


def figures(calls: list[Call], rank: dict[str, int]) -> Figures:
    """Stays, files, climbs and returns of a walk (see the module), with its path."""
    path: list[tuple[str, list[str], bool]] = []
    climbs = 0
    for call in calls:
        climb = call.caller is not None and layer_of(call.file, rank) > layer_of(call.caller, rank)
        climbs += climb
        if path and path[-1][0] == call.file:
            if call.function not in path[-1][1]:
                path[-1][1].append(call.function)
            path[-1] = (call.file, path[-1][1], path[-1][2] or climb)
        else:
            path.append((call.file, [call.function], climb))
    files = len({f for f, _, _ in path})
    ups = sum(layer_of(b[0], rank) > layer_of(a[0], rank) for a, b in zip(path, path[1:]))
    return Figures(calls=len(calls), stays=len(path), files=files, climbs=climbs, returns=len(path) - files,
                   ups=ups, path=tuple((f, tuple(fs), c) for f, fs, c in path))


def shown(path: tuple[tuple[str, tuple[str, ...], bool], ...]) -> str:
    """The path in one line: ``file(functions)`` per stay, ``^`` before a stay a climb called into, ``*`` after
    a file the walk had left before."""
    seen: set[str] = set()
    out = []
    for file, functions, climb in path:
        out.append(f"{'^' if climb else ''}{file}{'*' if file in seen else ''}({', '.join(functions)})")
        seen.add(file)
    return " > ".join(out)


def walk(run: Callable[[], object], *, keys: bool = True, inside: bool = False) -> tuple[list[Call], float]:
    """The calls ``run()`` makes that are given the workload (and, with ``keys``, its fingerprint), and its
    seconds. ``inside``: into the stages' own work too."""
    tracer = Walk(keys=keys, inside=inside)
    start = time.perf_counter()
    with tracer.tracing():
        run()
    return tracer.calls, time.perf_counter() - start


def scenarios(device: str, folder: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, plan) without a store, with a new store, and again on that store."""
    url = f"sqlite:///{folder / f'walk-{device}.db'}"

    def plan(store: str | bool) -> Callable[[], object]:
        return lambda: autotune.plan(TARGET, probe=PROBE, device=device, memory_budget=BUDGETS[device],
                                     store=store)

    yield f"{device}, no store", plan(False)
    yield f"{device}, cold store", plan(url)
    yield f"{device}, warm store", plan(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=["estimate", "cpu"], choices=("estimate", "cpu"),
                        help="the devices to plan for (default: both)")
    parser.add_argument("--calls", action="store_true", help="also list every traced call with its caller")
    parser.add_argument("--no-keys", dest="keys", action="store_false",
                        help="follow the workload and its requests only, not its fingerprint in the store")
    parser.add_argument("--inside", action="store_true",
                        help="follow the workload into the stages' own work too (the probe's every estimate "
                             "evaluation and real run, the fingerprint's trace)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import machine

    print(machine())
    rank = layers()
    print(f"# layers, from the imports, lowest first: {layer_order(rank)}")
    print(f"# autotune.plan({TARGET}, probe={PROBE!r}, device=D, memory_budget=BUDGETS[D], store=...) with "
          f"BUDGETS = {BUDGETS}; "
          f"acceptance: stays <= {MAX_STAYS}, climbs <= {MAX_CLIMBS}")
    for device in args.devices:  # imports done
        autotune.plan(TARGET, probe=PROBE, device=device, memory_budget=BUDGETS[device], store=False)
    rows, paths = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for device in args.devices:
            for label, run in scenarios(device, Path(tmp)):
                calls, seconds = walk(run, keys=args.keys, inside=args.inside)
                got = figures(calls, rank)
                rows.append((label, got, seconds))
                paths.append((label, got, calls))
    print(f"\n{'scenario':<22}{'calls':>6}{'stays':>7}{'files':>7}{'climbs':>8}{'returns':>9}{'ups':>5}"
          f"{'traced s':>10}  ok")
    for label, got, seconds in rows:
        print(f"{label:<22}{got.calls:>6}{got.stays:>7}{got.files:>7}{got.climbs:>8}{got.returns:>9}{got.ups:>5}"
              f"{seconds:>10.2f}  {'yes' if got.ok else 'NO'}")
    for label, got, calls in paths:
        print(f"\n{label}: {shown(got.path)}")
        if args.calls:
            for call in calls:
                print(f"    {call.file}:{call.function}  <- {call.caller}")
    return 0 if all(got.ok for _, got, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
