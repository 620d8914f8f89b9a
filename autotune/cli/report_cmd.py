"""``autotune report``: a memory report (HTML, Markdown, plots, CSV) from a saved result."""

from __future__ import annotations

import json

from .common import Formatter

EXAMPLES = """\
Regenerates a report folder from the JSON that autotune plan/run/probe wrote
with --output: report.html (self-contained, plots embedded), report.md with
its PNG plots, trials.csv, and the JSON itself. Needs no GPU and no torch.
The default folder is reports/<probe>-<YYYYmmdd-HHMMSS>/ under the current
folder; an existing folder is replaced only with --force.

examples:
  autotune plan --target-batch 1021 --probe mlp --device cpu --memory-budget 3MB --output plan.json
  autotune report plan.json
  autotune report result.json --out reports/example --force
  autotune report plan.json --json
"""


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="write a memory report (HTML, Markdown, CSV, JSON) from a saved result",
                       description=EXAMPLES, formatter_class=Formatter)
    p.add_argument("result", metavar="PLAN.json|RESULT.json",
                   help="a Plan, RunResult or ProbeResult JSON from autotune plan/run/probe --output")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="report folder (default: reports/<probe>-<YYYYmmdd-HHMMSS>/)")
    p.add_argument("--force", action="store_true", help="replace the report folder if it exists")
    p.add_argument("--json", action="store_true", help='print {"report": folder, "files": [...]} as JSON')
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.set_defaults(handler=run)


def run(args) -> int:
    from ..report import check_folder, report_files, result_from_dict, write_report
    from ..serial import read_json

    if args.out is not None:
        check_folder(args.out, force=args.force)
    data = read_json(args.result)
    result = result_from_dict(data, source=args.result)
    folder = write_report(result, args.out, force=args.force, source_json=data)
    if args.json:
        print(json.dumps({"report": str(folder), "files": report_files(folder)}, indent=2))
    else:
        print(folder)
    return 0
