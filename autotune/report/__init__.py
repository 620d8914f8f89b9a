"""Memory reports: a folder a person reads and shares, made from a Plan or RunResult (or ProbeResult).

    from autotune.report import load_result, write_report
    folder = write_report(plan)                              # reports/<probe>-<YYYYmmdd-HHMMSS>/
    folder = write_report(load_result("plan.json"), "reports/mine", force=True)

The folder holds report.html (self-contained), report.md with its PNG plots,
trials.csv and the result's JSON (plan.json, result.json or probe.json);
reports/README.md describes every file and the JSON schema. Reports need only
the JSON: nothing here imports torch.

Owns: the report folder, its tables, plots and text. May import: the foundation, results, the
planner's pure arithmetic (the batch ramp's reading), and pandas and matplotlib on demand (never the
stages that train or probe).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import BadInput, ResultFileError
from ..serial import dumps, open_envelope, read_json
from .folder import check_folder, default_folder, write_folder

__all__ = ["check_folder", "default_folder", "load_result", "report_files", "result_from_dict", "write_report"]


def load_result(path: str | os.PathLike) -> Any:
    """The Plan, RunResult or ProbeResult in a JSON file written by autotune, chosen by its ``kind``.

    Raises ResultFileError (a BadInput) for a missing file, a file that is not
    an autotune result, or one with a newer ``schema_version``.
    """
    return result_from_dict(read_json(path), source=str(path))


def result_from_dict(data: Any, *, source: str = "data") -> Any:
    """The Plan, RunResult or ProbeResult that parsed JSON holds, chosen by its ``kind``."""
    kind, _ = open_envelope(data, source=source)
    if kind == "RunResult":
        from ..results.run import RunResult

        return RunResult.from_dict(data, source=source)
    if kind == "Plan":
        from ..results.plan import Plan

        return Plan.from_dict(data, source=source)
    from ..results.probe import ProbeResult

    return ProbeResult.from_dict(data, source=source)


def write_report(result: Any, out_dir: str | os.PathLike | None = None, *, force: bool = False,
                 source_json: str | bytes | dict[str, Any] | None = None) -> Path:
    """Write the report folder for ``result`` (a Plan, RunResult or ProbeResult); returns its path.

    ``out_dir`` defaults to ``reports/<probe>-<YYYYmmdd-HHMMSS>/`` under the
    current folder. Everything is written into a temporary sibling folder and
    renamed into place, so there is a whole report or none. An existing folder
    is replaced (as a whole) only with ``force=True``. ``source_json`` is the
    JSON to store as plan.json/result.json when it exists already (the file
    a report is regenerated from); by default ``result.to_dict()``.
    Raises BadInput for a folder that cannot be written or exists already.
    """
    from . import content, html, markdown, tables
    from .subject import Subject

    subject = Subject.of(result)
    path = Path(out_dir) if out_dir is not None else default_folder(subject.name)
    check_folder(path, force=force)
    text = _json_text(result, source_json)

    def fill(tmp: Path) -> None:
        report = content.build(result)
        for image in report.images:
            (tmp / image.file).write_bytes(image.png)
        (tmp / "report.html").write_text(html.render(report), encoding="utf-8")
        (tmp / "report.md").write_text(markdown.render(report), encoding="utf-8")
        if subject.probe is not None:
            tables.trials_frame(subject.probe.trials).to_csv(tmp / "trials.csv", index=False)
        (tmp / subject.json_name).write_text(text, encoding="utf-8")

    return write_folder(path, fill, force=force)


def _json_text(result: Any, source_json: str | bytes | dict[str, Any] | None) -> str:
    if source_json is None:
        return dumps(result.to_dict())
    if isinstance(source_json, dict):
        return dumps(source_json)
    text = source_json.decode("utf-8") if isinstance(source_json, bytes) else str(source_json)
    try:
        json.loads(text)
    except ValueError as exc:
        raise ResultFileError(f"source_json is not JSON ({exc})") from None
    return text


def report_files(folder: str | os.PathLike) -> list[str]:
    """The files of a report folder, sorted."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"{folder} is not a report folder")
    return sorted(p.name for p in folder.iterdir() if p.is_file())
