"""The ``autotune`` command: devices, probe, plan, run, report."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import NoReturn

from ..errors import AutotuneError
from . import devices_cmd, plan_cmd, probe_cmd
from .common import Formatter, Parser

DESCRIPTION = """\
Find the largest micro-batch that fits your device, plan gradient accumulation
that keeps the effective batch exact, run the plan and prove it correct.

examples:
  autotune devices
  autotune plan --target-batch 1024
  autotune plan --target-batch 1024 --device estimate --memory-budget 80GiB --probe gpt:build_1b
  autotune probe --probe mlp --device cpu --memory-budget 64MiB --json

environment:
  AUTOTUNE_ESTIMATE_ENGINE=meta|fake   how estimates run: on meta tensors (default;
                                       falls back to fake where it must) or under
                                       FakeTensorMode from the start
"""

COMMANDS = {"devices": devices_cmd, "probe": probe_cmd, "plan": plan_cmd}


def _optional_commands() -> None:
    for name, module in (("run", "run_cmd"), ("report", "report_cmd")):
        try:
            COMMANDS[name] = __import__(f"{__name__}.{module}", fromlist=[module])
        except ImportError:
            pass


def build_parser() -> Parser:
    _optional_commands()
    parser = Parser(prog="autotune", description=DESCRIPTION, formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"autotune {__import__('autotune').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if _under_torchrun():
        _end_without_finalizing(code)
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    debug = getattr(args, "debug", False)
    where = f"[rank {os.environ['RANK']}] " if _under_torchrun() else ""
    try:
        return int(args.handler(args) or 0)
    except AutotuneError as exc:
        if debug:
            traceback.print_exc()
        print(f"{where}autotune {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{where}autotune {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours: say so plainly
        if debug:
            traceback.print_exc()
        else:
            print(f"{where}autotune {args.command}: internal error: {type(exc).__name__}: {exc} "
                  f"(rerun with --debug for the traceback)", file=sys.stderr)
        return 1


def _under_torchrun() -> bool:
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _end_without_finalizing(code: int) -> NoReturn:
    """End a torchrun rank with ``code`` once its output is out, without finalizing the interpreter.

    Files the command wrote are closed by now; this flushes the logs and the
    standard streams and ends the process. Finalizing instead would end any
    thread a communication library left behind at its next request for the GIL,
    and a C++ thread ended that way aborts the whole process (SIGABRT) after the
    work succeeded.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written
            pass
    os._exit(code)
