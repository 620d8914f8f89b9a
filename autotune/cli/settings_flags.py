"""``autotune plan --search-settings [--allow bf16-mixed,lora]``: the flags of a settings search, and its table.

See :mod:`autotune.probing.settings` for what is searched and :mod:`autotune.planning.settings_search` for the
time model.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..errors import BadInput

if TYPE_CHECKING:
    from ..results.plan import Plan


def lines(plan: Plan) -> list[str]:
    """The ranked table of a plan made by a settings search (none for any other plan)."""
    from ..planning.settings_search import table

    return table(list(plan.settings)) if plan.settings else []


def say_notes(plan: Plan, fmt: str) -> None:
    """On stderr: what of the chosen setting the framework's JSON (on stdout) does not hold."""
    import sys

    from ..planning.setting_exports import setting_notes

    for note in setting_notes(plan, fmt):
        print(note, file=sys.stderr)


def add_run_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--settings", metavar="FILE|best", default=None,
                   help="train under a setting a settings search chose: best (search now, with --target-batch) "
                        "or FILE, a plan from autotune plan --search-settings --output FILE; checkpointing wraps "
                        "the chosen blocks, FSDP shards, bf16-mixed autocasts, and verification holds under it")


def for_run(args: argparse.Namespace) -> None:
    """``--settings``: best searches now (``args.search_settings``), FILE is the plan to run (it must hold a
    chosen setting)."""
    args.search_settings = args.settings == "best"
    if args.settings is None or args.search_settings:
        if args.search_settings and args.target_batch is None:
            raise BadInput("--settings best searches the settings for a target batch: add --target-batch N, or "
                           "give --settings FILE (a plan from autotune plan --search-settings --output FILE)")
        return
    if args.plan is not None:
        raise BadInput(f"--settings {args.settings} and --plan {args.plan} each name the plan to run: give one")
    from ..api import load_plan

    if load_plan(args.settings).setting is None:
        raise BadInput(f"--settings {args.settings}: this plan holds no chosen setting: make it with autotune plan "
                       "--search-settings --output FILE, or run it with --plan")
    args.plan = args.settings
