"""What every subcommand shares: flags, errors as one line, progress on stderr, and how a command loads torch."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from typing import Any

from .. import options
from ..errors import BadInput
from .terms import CLI


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2, and a subcommand's own (see _Subcommands)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)

    def error(self, message: str):  # noqa: D401 - argparse API
        head, _, rest = message.partition(": ")
        if head.startswith("argument ") and rest.startswith(head.removeprefix("argument ").split("/")[0]):
            message = rest  # our own messages already name the flag
        sys.stderr.write(f"{rank_prefix()}{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


class _Subcommands(argparse._SubParsersAction):
    """argparse's subcommands, but arguments a subcommand does not know are its own error
    (``autotune probe: error: unrecognized arguments: --steps 3 (see autotune probe --help)``): argparse hands
    them up to the top-level parser, whose error names only ``autotune``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        unknown = vars(namespace).get(getattr(argparse, "_UNRECOGNIZED_ARGS_ATTR", "_unrecognized_args"))
        if unknown:
            self._name_parser_map[values[0]].error("unrecognized arguments: " + " ".join(unknown))


def import_torch(*, freeze: bool) -> None:
    """Import torch, Dynamo (which torch's optimizers load on first use) and autotune.api with the cyclic
    garbage collector paused, then as it was. The imports make some 300,000 objects that live as long as the
    process: collected while they are made, and walked again at every later full collection (autotune
    collects after each checked run and each out-of-memory error, and estimates make objects fast), they cost
    a small command about a fifth of its CPU time (``bench/cli_startup.py``).

    ``freeze``: then freeze (``gc.freeze()``) every object the process holds, so that the collector leaves
    them alone. Only the process's own command asks for it, before any workload exists: what is frozen is
    never collected."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401

        from ..compat import import_compiler

        import_compiler()

        from .. import api  # noqa: F401
    finally:
        if enabled:
            gc.enable()
    if freeze:
        gc.freeze()


def rank_prefix() -> str:
    """``[rank N] `` under torchrun (several ranks write to one terminal), else nothing."""
    under_torchrun = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    return f"[rank {os.environ['RANK']}] " if under_torchrun else ""


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Examples kept as written; defaults shown, except where there is none (the help then says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def flag(check: Callable[..., Any], name: str) -> Callable[[str], Any]:
    """An argparse ``type`` from an :mod:`autotune.options` check, its errors naming the flag."""

    def parse(text: str) -> Any:
        try:
            return check(text, name)
        except BadInput as exc:
            raise argparse.ArgumentTypeError(exc.say(CLI)) from None

    parse.__name__ = name
    return parse


def size_arg(text: str) -> int | tuple[int | None, ...] | None:
    """One size, or one per rank (``8MiB,3MiB``)."""
    sizes = flag(options.memory_budgets, "--memory-budget")(text)
    return sizes[0] if len(sizes) == 1 else sizes


def positive_int(name: str) -> Callable[[str], int]:
    return flag(options.whole, name)


def add_schedule_flags(p: argparse.ArgumentParser) -> None:
    """How the target batch may be split: ranks, a multiple every micro-batch keeps, equal sizes."""
    p.add_argument("--world-size", type=positive_int("--world-size"), default=None, metavar="W",
                   help="data-parallel ranks (default: the process group's, else $WORLD_SIZE, else 1)")
    p.add_argument("--multiple-of", type=positive_int("--multiple-of"), default=1, metavar="Q",
                   help="every micro-batch a multiple of Q (e.g. 8 for tensor cores)")
    p.add_argument("--uniform", action="store_true",
                   help="equal micro-batches, however many accumulation steps they take (fails only when the "
                        "target is not a multiple of the ranks x --multiple-of)")
    p.add_argument("--uniform-ranks", action="store_true",
                   help="ranks that differ (devices, memory held by others) all run the smallest rank's max "
                        "micro-batch and the same micro-steps, instead of each its own")


def add_fsdp_sync(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fsdp-sync", choices=options.FSDP_SYNCS, default=options.DEFAULT_FSDP_SYNC,
                   help="under fsdp, when gradients are reduce-scattered: every micro-step (accumulated in their "
                        "shards: least memory), at the last micro-step only (unsharded gradients held between "
                        "micro-steps: one reduce-scatter a step), or auto: the one with the larger max micro-batch, "
                        "last on a tie (default: %(default)s)")


def add_parallel(p: argparse.ArgumentParser, *, world_size: bool = False) -> None:
    """--parallel (and, where the schedule flags do not give it, --world-size)."""
    p.add_argument("--parallel", choices=options.PARALLEL, default=options.DEFAULT_PARALLEL,
                   help="how the ranks share the model: ddp (each holds all of it) or fsdp (fully_shard: each holds "
                        "its shard; the probe measures one rank of the world size)")
    add_fsdp_sync(p)
    if world_size:
        p.add_argument("--world-size", type=positive_int("--world-size"), default=None, metavar="W",
                       help="data-parallel ranks: fsdp shards over them, ddp holds its gradient buckets when "
                            "more than 1 (default: the process group's, else $WORLD_SIZE, else 1)")


def add_distributed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dist-timeout", type=flag(options.seconds, "--dist-timeout"), default=options.DIST_TIMEOUT_S,
                   metavar="SECONDS",
                   help="under torchrun: how long a rank waits for the others before giving up")


def add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", nargs="?", const="", default=None, metavar="DIR",
                   help="also write a memory report folder (HTML with plots, Markdown, CSV, JSON); "
                        "default folder reports/<probe>-<YYYYmmdd-HHMMSS>/")
    p.add_argument("--force", action="store_true", help="replace the --report folder if it exists")


def add_memory_snapshot(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-snapshot", metavar="FILE", default=None,
                   help="also write the fit rule's allocations at the chosen micro-batch as torch.cuda.memory."
                        "_snapshot() does (open it with python -m torch.cuda._memory_viz trace_plot FILE -o "
                        "out.html, or pytorch.org/memory_viz), and say where the peak comes from, what would lower "
                        "it most and which allocator settings fit more; on a GPU the real snapshot goes beside it "
                        "(FILE.real.pickle)")
    p.add_argument("--at", type=positive_int("--at"), default=None, metavar="N",
                   help="the micro-batch of --memory-snapshot (default: the chosen one)")


def check_memory_snapshot(args) -> None:
    """A bad --memory-snapshot file, or --at without it, fails before any work."""
    if getattr(args, "at", None) is not None and not getattr(args, "memory_snapshot", None):
        raise BadInput("--at N is the micro-batch of --memory-snapshot: add --memory-snapshot FILE, or drop --at")
    options.snapshot_path(getattr(args, "memory_snapshot", None), "--memory-snapshot")


def check_output(path: str | None) -> None:
    """Fail on an unusable --output file before any long work."""
    if path:
        from ..serial import check_writable

        check_writable(path, what=f"--output {path}")


def write_output(path: str | None, text: str) -> None:
    """Write the --output file, after the result is printed (a late failure loses nothing on screen)."""
    if path:
        from ..serial import write_atomic

        write_atomic(path, text, what=f"--output {path}")


def check_report(args) -> None:
    """Fail on an unusable --report folder before any long work."""
    if getattr(args, "report", None):
        from ..report import check_folder

        check_folder(args.report, force=args.force)


def write_report(args, result) -> None:
    """Write the --report folder and say where it is (stderr when stdout carries JSON)."""
    if getattr(args, "report", None) is None:
        return
    from ..report import write_report as write

    folder = write(result, args.report or None, force=args.force)
    print(f"report: {folder}", file=sys.stderr if args.json or getattr(args, "format", "table") != "table"
          else sys.stdout)


def add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="URL", default=None,
                   help="plan store shared by jobs: a probe made before is answered from it (a real device still "
                        "confirms it with one real run), a new one is kept, and what real runs measure is recorded; "
                        "sqlite:///plans.db or any SQLAlchemy URL (default: $AUTOTUNE_STORE, when set)")


def check_probe(args) -> None:
    """Fail on a --probe that names no built-in probe and a file that does not exist, before torch loads."""
    if getattr(args, "probe", None) is not None:
        options.probe_spec(args.probe)


def check_store(args) -> None:
    """Fail on an unusable --store (or $AUTOTUNE_STORE) before any long work."""
    url = args.store or options.store_from_environment()
    if url is not None:
        from ..dburl import check_storage

        check_storage(url, "--store" if args.store else "$AUTOTUNE_STORE", store=True)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr (warnings only)")
    p.add_argument("--verbose", "-v", action="store_true", help="more detail on stderr")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")


def add_device(p: argparse.ArgumentParser, *, probe_flags: bool = True) -> None:
    if probe_flags:
        p.add_argument("--probe", metavar="PROBE", default=None,
                       help="the workload: a built-in name (mlp, gpt, convnet, e.g. gpt:build_1b), a .py file, or "
                            "package.module[:function], exposing build() -> autotune.Workload (default: gpt)")
        from .model_flags import add_model_flags

        add_model_flags(p)
    p.add_argument("--device", default="auto",
                   help="auto (cuda:0 if there is a GPU, else cpu) | cpu | cuda | cuda:N | "
                        "estimate (fake tensors only; needs --memory-budget: the GPU you plan for) | "
                        "estimate:GPU (a GPU by name, e.g. estimate:H100-80GB; autotune devices --presets); "
                        "or one per rank: estimate:A100-80GB,estimate:T4-16GB (the world size is how many; "
                        "estimate:H100-80GB*4,estimate:A10G-24GB*4 for counts; under torchrun indexed by rank)")
    p.add_argument("--memory-budget", type=size_arg, metavar="SIZE", default=None,
                   help="device memory to plan for, e.g. 512MiB or 80GiB (cpu: default the available RAM; "
                        "cuda: caps the free memory; estimate: required; estimate:GPU: replaces its memory); "
                        "or one per rank, e.g. 8MiB,3MiB (under torchrun indexed by rank)")
    p.add_argument("--margin", type=flag(options.margin, "--margin"), default=options.MARGIN,
                   help="fraction of capacity kept free: usable = capacity x (1 - margin)")

