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
from ..results.settings import Setting, flag_of, setting, settings_of
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
    return flag(setting("memory_budget").check, "--memory-budget")(text)  # type: ignore[arg-type]


def positive_int(name: str) -> Callable[[str], int]:
    return flag(options.whole, name)


def flag_keywords(declared: Setting) -> dict[str, Any]:
    """argparse's keywords for a setting's flag, from its declaration (its ``flag`` overrides last)."""
    kw: dict[str, Any] = {"default": declared.default, "help": declared.help}
    if "action" in declared.flag or declared.type is bool:
        kw["action"] = "store_true"
    elif declared.choices:
        kw["choices"] = declared.choices
    elif declared.check is not None:
        kw["type"] = flag(declared.check, flag_of(declared.name))
    if declared.metavar is not None and "action" not in kw:
        kw["metavar"] = declared.metavar
    kw.update(declared.flag)
    return {k: v for k, v in kw.items() if v is not None or k == "default"}


def add_settings(p: argparse.ArgumentParser | argparse._ArgumentGroup, verb: str, *,
                 only: tuple[str, ...] | None = None, into: dict[str, Any] | None = None,
                 declared: tuple[Setting, ...] | None = None) -> None:
    """The flags of ``verb``'s settings (:mod:`autotune.results.settings`; ``only`` those named), each added
    to ``p`` or to the group ``into`` names for it. A setting whose flags a module adds by hand is left out."""
    for s in settings_of(verb, "cli", declared):
        if "cli" in s.by_hand or (only is not None and s.name not in only):
            continue
        (into or {}).get(s.name, p).add_argument(flag_of(s.name), **flag_keywords(s))


def add_schedule_flags(p: argparse.ArgumentParser) -> None:
    """How the target batch may be split: ranks, a multiple every micro-batch keeps, equal sizes."""
    add_settings(p, "plan", only=("world_size", "multiple_of", "uniform", "uniform_ranks"))


def add_fsdp_sync(p: argparse.ArgumentParser) -> None:
    add_settings(p, "plan", only=("fsdp_sync",))


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
    add_settings(p, "probe", only=("memory_snapshot", "at"))


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
