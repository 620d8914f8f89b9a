"""``autotune store``: look inside a plan store (ls, show), prune it (rm, gc), and bring it up to date (migrate)."""

from __future__ import annotations

import argparse
import json
import unicodedata
from typing import Any

from .. import options
from ..errors import BadInput
from ..units import plural
from .common import Formatter, Parser, add_common, flag

EXAMPLES = """\
A plan store keeps probe results by fingerprint (what the answer depends on:
the workload's graph, the device, torch, the allocator settings, precision,
world size, margin), the plans made from them, and what real runs measured.
`autotune probe|plan|run --store URL` fill it; `autotune serve` shares it.
These commands never make a store: ls, show and gc --dry-run open it
read-only; migrate brings a store written by an earlier autotune up to date
(every entry kept), as any command that writes it does. An entry
that cannot be read back (a damaged row) is listed as damaged, answers no
probe (the next probe of it replaces it) and can be removed with rm.

examples:
  autotune store ls --store sqlite:///plans.db
  autotune store show --store sqlite:///plans.db                 # per device: estimate vs measured
  autotune store show 3fa9c2e1b7d0 --store sqlite:///plans.db    # one entry, its plans and measurements
  autotune store rm 3fa9c2e1b7d0 --store sqlite:///plans.db
  autotune store gc --older-than 30 --store sqlite:///plans.db   # also entries unused for 30 days
  autotune store migrate --store sqlite:///plans.db
  AUTOTUNE_STORE=sqlite:///plans.db autotune store ls --json
"""


def add_parser(sub) -> None:
    p = sub.add_parser("store", help="look inside a plan store (ls, show), prune it (rm, gc), bring it up to date "
                                     "(migrate)",
                       description=EXAMPLES, formatter_class=Formatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=Parser, required=True,
                               help="ls, show, rm, gc or migrate")
    ls = actions.add_parser("ls", help="every entry: fingerprint, workload, device, max micro-batch, when, hits",
                            formatter_class=Formatter)
    show = actions.add_parser("show", help="one entry in full, or per device how far estimates were from "
                                           "measurements", formatter_class=Formatter)
    show.add_argument("fingerprint", nargs="?", metavar="FINGERPRINT",
                      help="an entry's fingerprint, or its first digits (at least 6)")
    rm = actions.add_parser("rm", help="remove entries with their plans and measurements", formatter_class=Formatter)
    rm.add_argument("fingerprints", nargs="+", metavar="FINGERPRINT", help="fingerprints, or their first digits")
    gc = actions.add_parser("gc", help="remove invalidated entries and stale claims (and, with --older-than, what "
                                       "was not used for that long)", formatter_class=Formatter)
    gc.add_argument("--older-than", type=flag(_days, "--older-than"), default=None, metavar="DAYS",
                    help="also remove entries neither made nor served for DAYS days, and older measurements")
    gc.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing (the store is opened "
                                                           "read-only)")
    migrate = actions.add_parser("migrate", help="bring a store written by an earlier autotune up to date, every "
                                                 "entry kept", formatter_class=Formatter)
    for action in (ls, show, rm, gc, migrate):
        action.add_argument("--store", metavar="URL", default=None,
                            help="the store, e.g. sqlite:///plans.db (default: $AUTOTUNE_STORE)")
        add_common(action)
        action.set_defaults(handler=run)
    p.set_defaults(handler=run)


def _days(text: str, name: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days >= 0:
        raise BadInput(f"{name} {text} must be a number of days >= 0, e.g. 30")
    return days


def run(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from ..store import open_store

    url = args.store or options.store_from_environment()
    if not url:
        raise BadInput("autotune store needs --store URL (or $AUTOTUNE_STORE), e.g. --store sqlite:///plans.db")
    name = "--store" if args.store else "$AUTOTUNE_STORE"
    reads = args.action in ("ls", "show") or (args.action == "gc" and args.dry_run)
    store = open_store(url, name=name, mode="read" if reads else "write")
    try:
        data, text = ACTIONS[args.action](store, args)
    except OperationalError as exc:  # rm or gc on a store this process may read but not write
        if "readonly" not in str(exc):
            raise
        raise BadInput(f"{name} {store.shown!r} is read-only here, and autotune store {args.action} needs to write "
                       "it: run it as a user who may") from None
    print(json.dumps(data, indent=2) if args.json else printable(text))
    return 0


#: Unicode categories a terminal may act on instead of showing: controls (ESC, BEL, C1 such as CSI),
#: format characters (bidirectional overrides) and line and paragraph separators.
_UNSHOWN = frozenset(("Cc", "Cf", "Zl", "Zp"))


def printable(text: str) -> str:
    """``text`` as it may reach a terminal: characters it would act on (except newlines) written as escapes,
    ``\\x1b``, so that text from a store's rows (device names and notes that clients of ``autotune serve``
    sent) cannot move the cursor, recolour, retitle or write the clipboard. JSON escapes them itself."""
    return "".join(ch if ch == "\n" or unicodedata.category(ch) not in _UNSHOWN
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _ls(store: Any, args: argparse.Namespace) -> tuple[Any, str]:
    from ..store.schema import when
    from .probe_cmd import text_table

    entries = store.entries()
    rows = [(e.short, str(e.workload), str(e.device), str(e.max_micro_batch), str(e.limited_by), when(e.created_at),
             str(e.hits), status(e)) for e in entries]
    text = text_table(("fingerprint", "workload", "device", "max micro-batch", "limited by", "measured", "hits",
                       "status"), rows) if rows else f"{store.shown} holds no entries"
    damaged = [e for e in entries if e.damage is not None]
    if damaged:
        text += (f"\n{len(damaged)} damaged {'entry' if len(damaged) == 1 else 'entries'} (cannot be read back; each "
                 f"is probed again when next asked for): autotune store show FINGERPRINT says why, autotune store rm "
                 f"{' '.join(e.short for e in damaged)} removes {'it' if len(damaged) == 1 else 'them'}")
    return [e.to_dict() for e in entries], text


def status(entry: Any) -> str:
    """An entry's status in a listing: served, invalidated or damaged."""
    if entry.damage is not None:
        return "damaged"
    return "served" if entry.valid else "invalidated"


def _show(store: Any, args: argparse.Namespace) -> tuple[Any, str]:
    if args.fingerprint is None:
        counts, table = store.counts(), store.accuracy()
        damaged = sum(e.damage is not None for e in store.entries())
        text = (f"{store.shown}: {plural(counts['entries'], 'entry', 'entries')}"
                f"{f' ({damaged} damaged)' if damaged else ''}, {plural(counts['plans'], 'plan')}, "
                f"{plural(counts['measurements'], 'measurement')}\n" + accuracy_text(table))
        counts["damaged"] = damaged
        return {"store": store.shown, **counts, "accuracy": table}, text
    entry = store.find(args.fingerprint)
    return _entry(store, entry)


def _entry(store: Any, entry: Any) -> tuple[Any, str]:
    from ..results.plan import Plan
    from ..store.schema import when
    from ..units import format_bytes
    from .probe_cmd import text_table

    plans = store.plans(entry.fingerprint)
    observed = store.observations(entry.fingerprint)
    lines = [f"fingerprint {entry.fingerprint}",
             f"measured {when(entry.created_at)} on {entry.device}; served {plural(entry.hits, 'time')}"
             + (f", last {when(entry.last_hit_at)}" if entry.last_hit_at else "")]
    if entry.damage is not None:
        lines.append(f"damaged: {entry.damage}; it is probed again and replaced when next asked for, or remove it "
                     f"with autotune store rm {entry.short}")
    else:
        lines.append(entry.probe().summary())
    if not entry.valid:
        lines.append(f"invalidated {when(entry.invalidated_at)}: {entry.invalid_reason}")
    lines.append("fingerprint parts:")
    lines += [f"  {k}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(entry.components.items())]
    if plans:
        lines.append("plans made from it:")
        lines += [f"  {_arithmetic(Plan, p)}" for p in plans]
    if observed:
        lines.append("measurements:")
        rows = [(when(o.recorded_at), o.source, o.device, str(o.batch),
                 "OOM" if o.oom else format_bytes(o.peak_reserved_bytes),
                 format_bytes(o.peak_allocated_bytes) if o.peak_allocated_bytes is not None else "-",
                 format_bytes(o.estimated_peak_bytes) if o.estimated_peak_bytes is not None else "-",
                 f"{o.error:+.1%}" if o.error is not None else "-", o.note or "") for o in observed]
        lines.append(text_table(("recorded", "source", "device", "batch", "reserved", "allocated", "estimated",
                                 "error", "note"), rows))
        lines.append(accuracy_text(store.accuracy(entry.fingerprint)))
    data = {**entry.to_dict(probe=True), "plans": plans, "measurements": [o.to_dict() for o in observed]}
    return data, "\n".join(lines)


def _arithmetic(plan_type: Any, data: dict[str, Any]) -> str:
    try:
        return plan_type.from_dict(data, source="the store").arithmetic
    except BadInput as exc:  # a plan row changed outside autotune
        return f"(a damaged plan: {exc})"


def accuracy_text(table: list[dict[str, Any]]) -> str:
    """Per device: measurements, OOMs, and how far the estimates were from them."""
    from .probe_cmd import text_table

    if not table:
        return "no real runs measured yet: autotune probe, plan or run on a real device with --store records them"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1%}"

    rows = [(a["device"], str(a["measurements"]), str(a["ooms"]), str(a["compared"]), pct(a["mean_error"]),
             "-" if a["mean_abs_error"] is None else f"{a['mean_abs_error']:.1%}", pct(a["worst_error"]),
             pct(a["allocated_mean_error"])) for a in table]
    return ("measured vs estimated peak, per device (error = (measured - estimated) / estimated):\n"
            + text_table(("device", "runs", "OOMs", "compared", "mean error", "mean |error|", "worst",
                          "allocated mean error"), rows))


def _rm(store: Any, args: argparse.Namespace) -> tuple[Any, str]:
    entries = list({e.fingerprint: e for e in map(store.find, args.fingerprints)}.values())  # each once
    gone = store.remove([e.fingerprint for e in entries])
    return {"removed": [e.fingerprint for e in entries]}, \
        f"removed {plural(gone, 'entry', 'entries')}: {', '.join(e.short for e in entries)}"


def _gc(store: Any, args: argparse.Namespace) -> tuple[Any, str]:
    older = None if args.older_than is None else args.older_than * 86400.0
    counts = store.gc(older_than_s=older, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    return counts, f"{verb} " + ", ".join(plural(n, _ONE[what], what) for what, n in counts.items())


#: What gc counts, one of each.
_ONE = {"entries": "entry", "plans": "plan", "measurements": "measurement", "claims": "claim"}


def _migrate(store: Any, _args: argparse.Namespace) -> tuple[Any, str]:
    """The store was brought up to date when it was opened to write it: say from which layout."""
    from ..store.schema import STORE_SCHEMA

    before = store.migrated_from
    text = f"{store.shown} is at layout {STORE_SCHEMA} already: nothing to do" if before is None else \
        f"{store.shown}: brought from layout {before} to {STORE_SCHEMA}, every entry kept"
    return {"store": store.shown, "from_layout": before or STORE_SCHEMA, "layout": STORE_SCHEMA}, text


ACTIONS = {"ls": _ls, "show": _show, "rm": _rm, "gc": _gc, "migrate": _migrate}
