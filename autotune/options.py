"""Every default and every check of a user-facing option, once: the API and argparse both use it.

No torch here (``--help`` and the planner import it). Each check takes the
value as a user gives it (a size string such as "8GiB" or a number) and the
name to blame in its error: the library's parameter (``memory_budget``) by
default, the flag (``--memory-budget``) when the command line asks. It
returns the value normalised, or raises :class:`BadInput`.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args, overload

from .errors import BadInput, ProbeFileError, mention
from .units import parse_size

#: Fraction of capacity kept free: usable = capacity x (1 - margin).
MARGIN = 0.1
#: The probe never searches past this micro-batch unless told to.
MAX_BATCH = 65536
#: Optimizer steps ``autotune run`` trains.
STEPS = 20
#: Throughput measurements ``--tune`` makes.
TRIALS = 12
DEVICE = "auto"
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
#: How the ranks share the training: DDP (every rank holds the whole model) or FSDP (fully_shard).
Parallel = Literal["ddp", "fsdp"]
PARALLEL: tuple[str, ...] = get_args(Parallel)
DEFAULT_PARALLEL: Parallel = "ddp"
#: When FSDP synchronises gradients within an optimizer step: a reduce-scatter after every micro-step
#: (gradients accumulate in their shards), at the last micro-step only (unsharded gradients held between
#: micro-steps, one reduce-scatter a step), or "auto": the one that gives the larger micro-batch, "last" on a tie.
FsdpSync = Literal["auto", "every", "last"]
FSDP_SYNCS: tuple[str, ...] = get_args(FsdpSync)
DEFAULT_FSDP_SYNC: FsdpSync = "auto"
#: How ``autotune plan`` prints a plan: for people, as JSON, or as a framework's settings.
FORMATS = ("table", "json", "hf", "lightning", "deepspeed", "accelerate")
FRAMEWORKS = FORMATS[2:]
#: ``autotune serve``: seconds a probe may run before its worker is stopped (--probe-timeout).
PROBE_TIMEOUT_S = 600.0
#: ``autotune serve``: probe workers per CPU at most (--workers): each is a process that imports torch and probes
#: on the CPUs, so more only take memory and slow each other.
WORKERS_PER_CPU = 4
#: ``autotune serve``: seconds a client has to send a request whole, headers and body (--read-timeout).
READ_TIMEOUT_S = 20.0
#: Under torchrun: seconds a rank waits for the others before giving up.
DIST_TIMEOUT_S = 600.0
#: The largest effective batch a plan holds (samples per optimizer step).
MAX_TARGET_BATCH = 1_000_000_000
#: The most micro-batches a plan holds per optimizer step, over all ranks.
MAX_MICRO_BATCHES = 1_000_000
#: The most ranks a value per rank may name: every rank runs at least one micro-batch a step.
MAX_RANKS = MAX_MICRO_BATCHES
#: What a value per rank naming too many ranks is told to do instead.
RANKS_FIX = "a larger job of ranks alike: one device and {world_size}"
#: The workloads autotune ships (``--probe mlp``), and the one it plans for when given none.
BUILTIN_PROBES = ("mlp", "gpt", "convnet")
DEFAULT_PROBE = "gpt"
#: How the learning rate follows a ramped batch (``--lr-scaling``): see autotune.planning.ramp.
LrScaling = Literal["noise", "linear", "sqrt", "none"]
LR_SCALINGS: tuple[str, ...] = get_args(LrScaling)
DEFAULT_LR_SCALING: LrScaling = "noise"
#: The batch ramp: steps a phase runs at least before the batch may grow again, the most one change multiplies
#: the batch by, and the optimizer steps whose noise-scale estimates it decides from (the latest ones).
RAMP_MIN_STEPS = 10
RAMP_GROWTH = 2.0
RAMP_WINDOW = 20
RAMP_WINDOW_MOST = 1000  # a window forgets: the noise scale moves by orders of magnitude while one so long fills


@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """Where a probe spec's Workload comes from, read without importing anything."""

    name: str       # the module or file as the user named it ("mlp", "my_probe.py", "pkg.mod")
    module: str     # what to import: the name, or autotune.probes.<name> for a built-in one
    function: str   # the function that builds the Workload
    file: bool      # ``module`` is a path to a .py file (checked to exist)


def probe_spec(spec: str | None) -> ProbeSpec:
    """A probe spec read and checked before anything is imported: a built-in name (mlp, gpt, convnet),
    a path to a ``.py`` file (which must exist), or ``package.module``; any of them optionally followed
    by ``:function`` to call instead of ``build``. None means the default probe."""
    spec = DEFAULT_PROBE if spec is None else str(spec).strip()
    name, function = spec, "build"
    if ":" in spec and not Path(spec).exists():
        name, function = spec.rsplit(":", 1)
        if not function.isidentifier():
            raise ProbeFileError(f"{function!r} after ':' is not a function name", field="probe", value=spec)
    if name in BUILTIN_PROBES:
        return ProbeSpec(name=name, module=f"autotune.probes.{name}", function=function, file=False)
    path = Path(name)
    if name.endswith(".py") or path.exists() or "/" in name or "\\" in name:
        if not path.is_file():
            raise ProbeFileError(f"probe file {name!r} does not exist (built-in probes: {', '.join(BUILTIN_PROBES)})",
                                 field="probe", choices=BUILTIN_PROBES)
        return ProbeSpec(name=name, module=name, function=function, file=True)
    return ProbeSpec(name=name, module=name, function=function, file=False)


def usable_bytes(capacity: int, margin: float) -> int:
    """Usable capacity = capacity x (1 - margin), in whole bytes: what "fits" is measured against."""
    return int(capacity * (1.0 - margin))


def whole(value: Any, name: str, *, least: int = 1, example: str = "", fix: str = "", text: bool = True,
          error: type[BadInput] = BadInput) -> int:
    """A whole number of at least ``least``: an int or any integer type (never a bool), and with ``text`` a
    string of digits. The one check of whole numbers: options, the fields of results (``text=False``), the
    planner (``error=PlanError``). The error names ``name`` and ends with ``, e.g. EXAMPLE`` or ``: FIX``."""
    number: int | None = value if type(value) is int else None
    try:
        if number is None and not isinstance(value, (bool, str)):
            number = operator.index(value)
        elif number is None and isinstance(value, str) and text:
            number = int(value.strip())
    except (TypeError, ValueError):
        pass
    if number is None or number < least:
        hint = fix or (f"e.g. {example}" if example else "")
        if number is None and isinstance(value, str) and not text:
            digits = value.strip()
            said = f", {digits}" if digits.isdigit() else (", " if hint.startswith("e.g.") else ": ") + hint if hint \
                else ""
            raise error("is a string, not a whole number", field=name, value=value, limit=least,
                        fix="give the number itself" + said)
        if number is None:
            raise error("is not a whole number", field=name, value=value, limit=least, fix=hint)
        raise error(f"must be at least {least}", field=name, value=number, limit=least, fix=hint)
    return number


@overload
def boolean(value: Any, name: str) -> bool: ...
@overload
def boolean(value: Any, name: str, *, none: bool) -> bool | None: ...
def boolean(value: Any, name: str, *, none: bool = False) -> bool | None:
    """True or False (with ``none``, also None): the one check of a yes-or-no option. Nothing else is taken for
    one, not 1, 'false' or 'yes', so that a string such as 'false' is never read as True."""
    if isinstance(value, bool) or (none and value is None):
        return value
    allowed = "True, False or None" if none else "True or False"
    raise BadInput(f"must be {allowed} (a bool, not {type(value).__name__})", field=name, value=value,
                   choices=(True, False, None) if none else (True, False))


def memory_budget(value: Any, name: str = "memory_budget") -> int | None:
    """Bytes, from a number or a size string ("512MiB", "80GiB"); None stays None."""
    if value is None:
        return None
    return parse_size(value, what=name)


def per_rank(value: Any, name: str, *, most: int = MAX_RANKS, fix: str = RANKS_FIX) -> tuple[Any, ...]:
    """A value given once per rank: ``"a,b"``, ``"a*4,b*4"`` (4 ranks of each), a list or a tuple; a single value
    is a list of one. More than ``most`` ranks is refused (counted before any item is made), saying ``fix``."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str) and ("," in value or "*" in value):
        example = "8MiB,3MiB" if "budget" in name else "estimate:A100-80GB,estimate:T4-16GB"
        parts = []
        for part in value.split(","):
            text, star, count = part.strip().partition("*")
            if not text.strip():
                raise BadInput("has an empty item", field=name, value=value, fix=f"give one per rank, e.g. {example}")
            how_many = f"give how many ranks, e.g. {text.strip()}*4"
            if star and not count.strip().removeprefix("-").isdigit():
                raise BadInput(f"{mention(name)} count after '*' in {part.strip()!r} is not a whole number",
                               field=name, fix=how_many)
            if star and int(count) < 1:
                raise BadInput(f"{mention(name)} count after '*' in {part.strip()!r} must be at least 1", field=name,
                               limit=1, fix=how_many)
            parts.append((text.strip(), int(count) if star else 1))
        _most_ranks(sum(n for _, n in parts), name, most, fix)
        items = [text for text, n in parts for _ in range(n)]
    else:
        return (value,)
    if not items:
        raise BadInput(f"{mention(name)} is an empty list", field=name, limit=1, fix="give at least one")
    _most_ranks(len(items), name, most, fix)
    return tuple(items)


def _most_ranks(ranks: int, name: str, most: int, fix: str) -> None:
    if ranks > most:
        raise BadInput(f"{mention(name)} names {ranks:,} ranks: at most {most:,}", field=name, limit=most, fix=fix)


def memory_budgets(value: Any, name: str = "memory_budget", *, most: int = MAX_RANKS,
                   fix: str = RANKS_FIX) -> tuple[int | None, ...]:
    """Bytes per rank (see :func:`per_rank`, which takes ``most`` and ``fix``), each from a number or a size
    string; ``(None,)`` for None."""
    return tuple(memory_budget(v, name) for v in per_rank(value, name, most=most, fix=fix))


def _number(value: Any) -> float:
    """``value`` as a float; NaN for a bool or anything that is not a number."""
    try:
        return float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        return math.nan


def positive(value: Any, name: str, *, what: str = "a positive number") -> float:
    """A finite number above 0; the error says it must be ``what``."""
    number = _number(value)
    if not (number > 0 and math.isfinite(number)):
        raise BadInput(f"must be {what}", field=name, value=value, limit=0)
    return number


def margin(value: Any, name: str = "margin", *, text: bool = True) -> float:
    """A fraction in [0, 1): the share of capacity kept free; with ``text``, also as a string ("0.1")."""
    if isinstance(value, str) and not text:
        raise BadInput("is a string, not a number", field=name, value=value, limit=(0, 1),
                       fix="give the fraction itself, e.g. 0.1")
    number = _number(value)
    if not 0 <= number < 1:
        raise BadInput("must be a fraction in [0, 1)", field=name, value=value, limit=(0, 1),
                       fix="the share of memory kept free, e.g. 0.1")
    return number


def max_norm(value: Any, name: str = "max_norm") -> float | None:
    """A positive, finite gradient norm to clip to, or None for no clipping."""
    if value is None:
        return None
    return positive(value, name, what="a positive number, e.g. 1.0 (or no clipping at all)")


def choice(value: Any, choices: Sequence[str], name: str) -> str:
    if value not in choices:
        raise BadInput(f"must be one of {', '.join(choices)}", field=name, value=value, choices=choices)
    return str(value)


def precision(value: Any, name: str = "precision") -> Precision:
    return cast(Precision, choice(value, PRECISIONS, name))


def parallel(value: Any, name: str = "parallel") -> Parallel:
    return cast(Parallel, choice(value, PARALLEL, name))


def fsdp_sync(value: Any, name: str = "fsdp_sync") -> FsdpSync:
    return cast(FsdpSync, choice(value, FSDP_SYNCS, name))


def uniform(value: Any, name: str = "uniform") -> Literal[True, "force"] | None:
    """How a plan splits its target: None (or False) the fewest steps, True equal micro-batches within twice the
    fewest steps, "force" equal micro-batches however many steps they take."""
    if not (value is None or isinstance(value, bool) or value == "force"):
        raise BadInput("must be True, False, None or 'force'", field=name, value=value,
                       choices=(True, False, None, "force"))
    return None if value is None or value is False else cast(Literal[True, "force"], value)


def lr_scaling(value: Any, name: str = "lr_scaling") -> str:
    return choice(value, LR_SCALINGS, name)


def above_one(value: Any, name: str, *, example: str) -> float:
    """A finite number above 1: an int or a float, never text or a bool."""
    if isinstance(value, str):
        raise BadInput("is text, not a number", field=name, value=value, limit=1,
                       fix=f"give a number above 1, e.g. {example}")
    number = _number(value) if isinstance(value, (int, float)) else math.nan
    if not (number > 1 and math.isfinite(number)):
        raise BadInput("must be a number above 1", field=name, value=value, limit=1, fix=f"e.g. {example}")
    return number


def ramp_window(value: Any, name: str = "window") -> int:
    """The optimizer steps a batch ramp reads the noise scale over: 2 to :data:`RAMP_WINDOW_MOST`."""
    steps = whole(value, name, least=2, example=str(RAMP_WINDOW))
    if steps > RAMP_WINDOW_MOST:
        raise BadInput(f"must be at most {RAMP_WINDOW_MOST} steps", field=name, value=steps, limit=RAMP_WINDOW_MOST,
                       fix=f"the ramp reads the noise scale of the latest steps, which moves by orders of magnitude "
                           f"over a longer window, e.g. {RAMP_WINDOW}")
    return steps


def workers(value: Any, name: str) -> int:
    """A number of ``autotune serve`` workers: at least 1, at most :data:`WORKERS_PER_CPU` per CPU of this machine."""
    count = whole(value, name)
    cpus = os.cpu_count() or 1
    if count > WORKERS_PER_CPU * cpus:
        raise BadInput(f"is more than {WORKERS_PER_CPU * cpus}, {WORKERS_PER_CPU} per CPU ({cpus} here)", field=name,
                       value=count, limit=WORKERS_PER_CPU * cpus,
                       fix=f"each worker is a process that imports torch and probes on the CPUs; give at most "
                           f"{WORKERS_PER_CPU * cpus}")
    return count


def seconds(value: Any, name: str) -> float:
    return positive(value, name, what="a positive number of seconds")


def snapshot_path(value: Any, name: str = "memory_snapshot") -> str | None:
    """Where a memory snapshot goes: a file path (checked writable now, before any work), or None for no file
    (``True``: the timeline without a file; ``None``/``False``: no snapshot at all)."""
    if value is None or value is False or value is True:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise BadInput("is not a file path", field=name, value=value, fix="give one such as 'memory.pickle'")
    from .serial import check_writable

    check_writable(value, what=f"cannot write the {mention(name)} file {value}", example="memory.pickle", field=name)
    return str(value)


def text(value: Any, name: str) -> str:
    """A non-empty string (a device's or a probe's name)."""
    if not isinstance(value, str) or not value.strip():
        raise BadInput("must be a non-empty name", field=name, value=value)
    return value.strip()


#: The plan store every command and the API use when given none.
STORE_VARIABLE = "AUTOTUNE_STORE"


def store_from_environment() -> str | None:
    """``$AUTOTUNE_STORE``, when set to something."""
    return os.environ.get(STORE_VARIABLE, "").strip() or None


def torchrun_group(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(world size, rank) of the process group torchrun describes in the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; several ranks), which the commands join; None when not launched so."""
    env = os.environ if env is None else env
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = whole(env["WORLD_SIZE"], "WORLD_SIZE")
    return (world, whole(env["RANK"], "RANK", least=0)) if world > 1 else None
