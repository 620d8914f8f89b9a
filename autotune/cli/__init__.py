"""The ``autotune`` command: devices, probe, plan, run, report, store, serve.

Owns: argument parsing, the human and JSON output, exit codes, progress on stderr. May import:
every layer below it (the work goes through autotune.api), and torch only when a command needs it.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import NoReturn

from ..errors import AutotuneError
from . import devices_cmd, plan_cmd, probe_cmd, report_cmd, run_cmd, serve_cmd, store_cmd
from .common import Formatter, Parser, rank_prefix
from .progress import progress_on_stderr
from .terms import CLI

DESCRIPTION = """\
Find the largest micro-batch that fits your device, plan gradient accumulation
that keeps the effective batch exact, run the plan and prove it correct.

examples:
  autotune devices
  autotune plan --target-batch 1024
  autotune plan --target-batch 1024 --device estimate --memory-budget 80GiB --probe gpt:build_1b
  autotune plan --target-batch 4096 --parallel fsdp --world-size 64 --device estimate --memory-budget 80GiB \
      --probe gpt:build_1b
  autotune probe --probe mlp --device cpu --memory-budget 64MiB --json
  autotune plan --target-batch 1024 --device estimate --memory-budget 80GiB --store sqlite:///plans.db
  autotune serve --store sqlite:///plans.db

exit codes: 0 done, 1 the work failed (e.g. a verification check), 2 bad input,
  141 the reader of the output left early (autotune plan | head -1)

environment:
  AUTOTUNE_ESTIMATE_ENGINE=meta|fake   how estimates run: on meta tensors (default;
                                       falls back to fake where it must) or under
                                       FakeTensorMode from the start
  AUTOTUNE_STORE=URL                   the plan store probe, plan, run, store and serve
                                       use when --store is not given
  PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF
                                       the caching allocator's settings, which estimates
                                       for a GPU simulate: the first one set, as torch
                                       reads them
"""

PIPE_CLOSED_EXIT = 141  # 128 + SIGPIPE: the status a shell shows for a tool stopped by a closed pipe

COMMANDS = {"devices": devices_cmd, "probe": probe_cmd, "plan": plan_cmd, "run": run_cmd, "report": report_cmd,
            "store": store_cmd, "serve": serve_cmd}


def build_parser() -> Parser:
    parser = Parser(prog="autotune", description=DESCRIPTION, formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"autotune {__import__('autotune').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``autotune`` command on ``argv``; its exit code. Without ``argv`` it reads this process's command
    line and takes the process as its own (``autotune``, ``python -m autotune``): it may then freeze what
    its imports made (``common.import_torch``)."""
    code = _main(argv)
    if rank_prefix():
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
    args.own_process = argv is None
    debug = getattr(args, "debug", False)
    where = rank_prefix()
    quiet = (getattr(args, "quiet", False) or getattr(args, "json", False)
             or getattr(args, "format", "table") != "table" or os.environ.get("RANK", "0") != "0")
    try:
        with progress_on_stderr(quiet=quiet, verbose=getattr(args, "verbose", False)):
            code = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:  # the reader left (`autotune plan | head -1`): stop quietly, as Unix tools do
        _discard_output()
        return PIPE_CLOSED_EXIT
    except AutotuneError as exc:
        if debug:
            traceback.print_exc()
        _say(f"{where}autotune {args.command}: error: {exc.say(CLI)}")
        return exc.exit_code
    except KeyboardInterrupt:
        _say(f"{where}autotune {args.command}: interrupted")
        return 130
    except MemoryError:  # the host's memory, outside what the probe bounds (an import, the user's own code)
        if debug:
            traceback.print_exc()
        _say(f"{where}autotune {args.command}: error: {_out_of_host_memory()}")
        return 1
    except Exception as exc:  # a bug of ours: say so plainly
        if debug:
            traceback.print_exc()
        else:
            _say(f"{where}autotune {args.command}: internal error: {type(exc).__name__}: {exc} "
                 "(rerun with --debug for the traceback)")
        return 1


def _out_of_host_memory() -> str:
    """What a MemoryError means to the user: the host's memory, with what this process may still have."""
    from ..devices.host import ram_bytes
    from ..units import format_bytes

    total, available = ram_bytes()
    return (f"the host ran out of memory for this process ({format_bytes(available)} of {format_bytes(total)} "
            "available to it): raise its limit (ulimit -v, the memory cgroup's memory.max) or lower --max-batch")


def _say(line: str) -> None:
    """One line on stderr in one write, so that the lines of ranks sharing a terminal never run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _discard_output() -> None:
    """Point stdout (and stderr, when its reader is gone too) at /dev/null, so that the interpreter's
    final flush of what is still buffered neither fails nor prints a warning (Python's documented recipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # replaced by a test harness or a library caller
            continue
        if stream is sys.stdout or _reader_gone(fd):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)


def _reader_gone(fd: int) -> bool:
    """True when ``fd`` is a pipe or socket whose reading end is closed."""
    import select

    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))


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
