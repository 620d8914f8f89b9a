"""Memory reports from a real CPU probe, plan and run: files, plots, numbers, self-containment, bad input."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import re
import struct
from pathlib import Path

import pandas as pd
import pytest

from autotune import api as pipeline
from autotune.cli import main
from autotune.errors import BadInput, ResultFileError
from autotune.report import load_result, write_report
from autotune.serial import SCHEMA_VERSION, dumps
from autotune.units import format_bytes

from ..heavy import watch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_URI = re.compile(r'data:image/png;base64,([A-Za-z0-9+/=]+)')


# ---- fixtures: one real probe + plan, one real run, their reports ---------------------------------


@pytest.fixture(scope="session")
def plan():
    return pipeline.plan(1021, workload="mlp", device="cpu", memory_budget=3_000_000)


@pytest.fixture(scope="session")
def run_result(plan):
    return pipeline.run(plan=plan, device="cpu", steps=2)


@pytest.fixture(scope="session")
def reports(plan, run_result, tmp_path_factory):
    root = tmp_path_factory.mktemp("reports")
    return {"plan": write_report(plan, root / "plan"), "run": write_report(run_result, root / "run")}


# ---- reading reports back ----------------------------------------------------------------------


def html_rows(page: str, table_id: str) -> dict[str, str]:
    table = re.search(rf'<table class="kv" id="{table_id}">(.*?)</table>', page, re.S)
    assert table, f"no table {table_id}"
    rows = re.findall(r'<tr><th scope="row">(.*?)</th><td>(.*?)</td></tr>', table.group(1))
    return {html.unescape(k): html.unescape(v) for k, v in rows}


def md_unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def md_rows(text: str, section: str) -> dict[str, str]:
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \*\*(.*?)\*\* \| (.*) \|$", body, re.M)
    return {md_unescape(k): md_unescape(v) for k, v in rows}


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == PNG_SIGNATURE, "not a PNG signature"
    assert png[12:16] == b"IHDR", "first chunk is not IHDR"
    return struct.unpack(">II", png[16:24])


def read(folder: Path) -> tuple[str, str]:
    return (folder / "report.html").read_text(), (folder / "report.md").read_text()


def without_footer(md: str) -> str:
    return re.sub(r"^_Generated .*_$", "", md, flags=re.M)


def entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# ---- what a report holds -----------------------------------------------------------------------


@pytest.mark.slow
def test_report_folders_hold_every_file(reports):
    common = {"report.html", "report.md", "trials.csv", "peak_vs_batch.png", "memory_breakdown.png"}
    assert entries(reports["plan"]) == common | {"plan.json"}
    assert entries(reports["run"]) == common | {"result.json", "noise_scale.png"}


@pytest.mark.parametrize("which", ["plan", "run"])
def test_every_embedded_image_is_a_sensible_png_and_matches_its_file(reports, which):
    folder = reports[which]
    page, md = read(folder)
    embedded = [base64.b64decode(b64, validate=True) for b64 in DATA_URI.findall(page)]
    files = sorted(folder.glob("*.png"))
    assert len(embedded) == len(files) == {"plan": 2, "run": 3}[which]
    for png in embedded:
        width, height = png_size(png)
        assert width > 200 and height > 200, (width, height)
        assert len(png) < 200_000
    assert sorted(embedded) == sorted(p.read_bytes() for p in files)
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(linked) == sorted(p.name for p in files)


@pytest.mark.parametrize("which", ["plan", "run"])
def test_html_references_nothing_outside_itself(reports, which):
    page, _ = read(reports[which])
    rest = DATA_URI.sub("DATA", page)  # base64 may spell anything
    assert "http" not in rest.lower()
    for tag in ("<script", "<link", "<iframe", "<object", "<embed", "@import", "url("):
        assert tag not in rest.lower(), tag
    refs = re.findall(r'\b(?:src|href|srcset|action|poster)\s*=\s*"([^"]*)"', page, re.I)
    assert refs, "no references found at all: the check would be vacuous"
    ids = set(re.findall(r'\bid="([^"]+)"', page))
    for ref in refs:
        assert ref.startswith("data:image/png;base64,") or ref.startswith("#"), ref[:60]
        if ref.startswith("#"):
            assert ref[1:] in ids, f"in-page link {ref} has no target"


@pytest.mark.parametrize("which", ["plan", "run"])
def test_numbers_in_html_and_markdown_match_the_json(reports, which):
    folder = reports[which]
    data = json.loads((folder / ("plan.json" if which == "plan" else "result.json")).read_text())
    plan = data if which == "plan" else data["plan"]
    probe = plan["probe"]
    page, md = read(folder)
    for rows in (html_rows(page, "summary-table"), md_rows(md, "Summary")):
        assert rows["Max micro-batch"] == str(probe["max_micro_batch"])
        assert rows["Plan"] == plan["arithmetic"] == "1021 = 3 x 255 + 1 x 256 over 4 steps x 1 rank"
        assert rows["Micro-batch"] == str(plan["micro_batch"])
        assert rows["Accumulation steps"] == str(plan["accumulation_steps"])
        assert rows["Usable memory"].startswith(format_bytes(probe["usable_bytes"]) + " ")
        assert rows["Capacity"].startswith(format_bytes(probe["capacity_bytes"]) + " ")
        assert rows["Margin"] == f"{probe['margin'] * 100:g}%"
        assert rows["Peak at max micro-batch"].startswith(format_bytes(probe["peak_bytes"]) + " ")
        assert rows["Predicted peak"] == f"{format_bytes(plan['predicted_peak_bytes'])} at micro-batch 256"
        assert rows["Headroom"].startswith(format_bytes(plan["headroom_bytes"]) + " ")
        if which == "run":
            assert rows["Measured peak (run)"].startswith(format_bytes(data["peak_bytes"]) + ",")
            assert rows["Gradient relative error"] == f"{data['verification']['gradient_relative_error']:.2e}"
            assert rows["Verification"] == "PASSED"


def test_verification_section_matches_the_run(reports, run_result):
    page, md = read(reports["run"])
    v = run_result.verification.to_dict()
    for rows in (html_rows(page, "verification-table"), md_rows(md, "Verification")):
        assert rows["Gradient relative error"].startswith(f"{v['gradient_relative_error']:.2e} (limit ")
        assert rows["Measured vs predicted peak"].startswith(
            f"{format_bytes(run_result.peak_bytes)} measured vs "
            f"{format_bytes(run_result.predicted_peak_bytes)} predicted")
    for check in v["checks"]:
        assert html.escape(check["message"]) in page
        assert re.search(rf"^\| {re.escape(check['name'].replace('_', chr(92) + '_'))} \| ok \|", md, re.M)
    assert "Verification PASSED" in page and "Verification PASSED" in md


def test_trials_table_and_csv_match_the_probe(reports, plan):
    trials = plan.probe.trials
    csv = pd.read_csv(reports["plan"] / "trials.csv")
    assert csv["batch"].tolist() == [t.batch for t in trials]
    assert csv["peak_bytes"].tolist() == [t.peak_bytes for t in trials]
    real = plan.probe.real_runs
    assert csv["source"].tolist() == ["estimate"] * (len(trials) - real) + ["real"] * real
    page, md = read(reports["plan"])
    md_trials = md.split("\n## Trials\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (estimate|real) \| ([^|]+) \|", md_trials, re.M)
    assert [(int(b), s, p.strip()) for _, b, s, p in rows] == [
        (t.batch, t.source, format_bytes(t.peak_bytes)) for t in trials]
    for t in trials:
        assert f"<td>{format_bytes(t.peak_bytes)}</td>" in page


def test_result_json_is_the_full_result(reports, plan, run_result):
    assert json.loads((reports["plan"] / "plan.json").read_text()) == json.loads(dumps(plan.to_dict()))
    assert json.loads((reports["run"] / "result.json").read_text()) == json.loads(dumps(run_result.to_dict()))


def test_environment_names_torch_device_and_allocator(reports, run_result):
    page, md = read(reports["run"])
    for rows in (html_rows(page, "environment-table"), md_rows(md, "Environment")):
        assert rows["torch"] == run_result.device.torch
        assert rows["Device"].startswith("cpu")
        assert rows["Result"] == "confirmed by a real run"
        assert rows["Allocator settings"] == "n/a (not a CUDA device)" and "Driver" in rows


# ---- regeneration ------------------------------------------------------------------------------


def test_regenerating_from_plan_json_gives_the_same_report(reports, tmp_path, capsys):
    out = tmp_path / "again"
    assert main(["report", str(reports["plan"] / "plan.json"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page, md = read(out)
    old_page, old_md = read(reports["plan"])
    assert without_footer(md) == without_footer(old_md)
    assert html_rows(page, "summary-table") == html_rows(old_page, "summary-table")
    assert (out / "trials.csv").read_text() == (reports["plan"] / "trials.csv").read_text()
    assert json.loads((out / "plan.json").read_text()) == json.loads((reports["plan"] / "plan.json").read_text())


def test_report_json_output_lists_the_files(reports, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["report", str(reports["run"] / "result.json"), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"report": str(out), "files": sorted(entries(out))}
    assert isinstance(load_result(out / "result.json"), type(load_result(reports["run"] / "result.json")))


@pytest.mark.slow
def test_report_needs_no_torch(reports, tmp_path):
    code = ("from autotune.report import load_result, write_report\n"
            f"write_report(load_result({str(reports['run'] / 'result.json')!r}), {str(tmp_path / 'x')!r})\n")
    watched = watch(code)
    assert watched.returncode == 0, watched.stderr[-2000:]
    assert watched.loaded == {}, f"writing a report loaded {watched.chains()}"
    assert (tmp_path / "x" / "report.html").is_file()


# ---- optional sections -------------------------------------------------------------------------


@pytest.mark.slow
def test_throughput_plot_when_tuned(tmp_path):
    """The report of a real tune() run: every candidate measured, the baseline, the chosen plan."""
    from autotune.devices import get_device
    from autotune.training.timing import Timing
    from autotune.training.tune import tune
    from autotune.workload import load_workload

    tuned = tune(load_workload("mlp"), get_device("cpu", memory_budget=3_000_000), 1021, trials=3,
                 timing=Timing(min_steps=2, max_steps=3, budget_s=0.01))
    folder = write_report(tuned, tmp_path / "tuned")
    page, md = read(folder)
    assert png_size((folder / "throughput_vs_batch.png").read_bytes())[0] > 200
    assert len(DATA_URI.findall(page)) == 3 and "(throughput_vs_batch.png)" in md
    rows = re.findall(r"^\| (\d+) \| (\d+) \| defaults \| [^|]+ \| ([\d,.]+) \| [^|]+ \| ([^|]*) \| yes \| (yes)? ?\|",
                      md_unescape(md), re.M)
    assert sorted(int(b) for b, *_ in rows) == sorted(c.micro_batch for c in tuned.tuning.candidates)
    assert [int(b) for b, _, _, _, chosen in rows if chosen] == [tuned.micro_batch]
    assert any(versus.strip() == "baseline" for *_, versus, _ in rows)


@pytest.mark.parametrize("kept", [False, True])
def test_tuning_shows_the_baseline_and_the_ratio(plan, tmp_path, kept):
    """The untuned plan is the baseline row; the others carry their ratio to it, the fastest its head to head."""
    from autotune.results.tuning import Candidate, HeadToHead, Tuning

    def row(b, seconds, **extra):
        return Candidate(micro_batch=b, accumulation_steps=-(-1021 // b), samples_per_s=1021 / seconds,
                         seconds_per_step=seconds, spread=0.02, timed_steps=5, **extra)
    duel = HeadToHead(ratio=1.02, uncertainty=0.04, rounds=9) if kept else HeadToHead(ratio=1.18, uncertainty=0.03,
                                                                                       rounds=9)
    base = row(256, 0.118, baseline=True, vs_baseline=1.0)
    fast = row(128, 0.1, baseline=False, vs_baseline=1.18, head_to_head=duel)
    tuning = Tuning(candidates=(base, fast), baseline=base, fastest=fast, chosen=base if kept else fast,
                    ratio=duel.ratio, uncertainty=duel.uncertainty, kept_baseline=kept, trials=2, measured=2,
                    study_name="s", timing={"warmup": 1, "min_steps": 5, "max_steps": 50, "threshold": 0.05,
                                            "budget_s": 5.0})
    folder = write_report(dataclasses.replace(plan, tuning=tuning), tmp_path / "tuned")
    _, md = read(folder)
    text = md_unescape(md)
    assert re.search(r"^\| 256 \| 4 \| defaults \| .* \| baseline \| yes \| " + ("yes" if kept else "") + r" \|",
                     text, re.MULTILINE)
    cell = "1.18x; 1.02x ±0.04 head to head" if kept else "1.18x; 1.18x ±0.03 head to head"
    assert re.search(r"^\| 128 \| 8 \| defaults \| .* \| " + re.escape(cell) + r" \| yes \| " +
                     ("" if kept else "yes") + r" \|", text, re.MULTILINE)
    verdict = ("The fastest, micro-batch 128 x 8 steps, ran 1.02x the baseline (±0.04) head to head, so the "
               "untuned plan is kept." if kept else "Chosen: micro-batch 128 x 8 steps, 1.18x the baseline (±0.03) "
               "head to head.")
    assert verdict in text and "within 5% of the median or 5 s are spent" in text


def test_batchnorm_warning_and_failure_are_shown(run_result, tmp_path):
    v = run_result.verification
    grad = dataclasses.replace(v.checks[0], passed=False, value=0.0892, details={
        **v.checks[0].details, "running_statistics": ["1 (BatchNorm2d)", "4 (BatchNorm2d)"]})
    failed = dataclasses.replace(v, passed=False, gradient_relative_error=0.0892, checks=(grad, *v.checks[1:]))
    folder = write_report(dataclasses.replace(run_result, verification=failed), tmp_path / "bn")
    page, md = read(folder)
    for text in (page, md_unescape(md)):
        assert "BatchNorm: 2 layers normalise each micro-batch with its own statistics (1 (BatchNorm2d)" in text
        assert "Verification FAILED: gradient_equivalence" in text
    assert md_rows(md, "Summary")["Gradient relative error"] == "8.92e-02"


def test_plan_without_probe_has_no_memory_sections(tmp_path):
    from autotune.planning.planner import make_plan

    folder = write_report(make_plan(1000, 300, world_size=2), tmp_path / "bare")
    assert entries(folder) == {"report.html", "report.md", "plan.json"}
    assert md_rows(folder.joinpath("report.md").read_text(), "Summary")["Plan"] == "1000 = 250 x 2 steps x 2 ranks"


def test_probe_result_alone_makes_a_report(plan, tmp_path):
    folder = write_report(plan.probe, tmp_path / "probe")
    assert entries(folder) == {"report.html", "report.md", "trials.csv", "peak_vs_batch.png", "memory_breakdown.png",
                               "probe.json"}
    rows = md_rows(folder.joinpath("report.md").read_text(), "Summary")
    assert rows["Max micro-batch"] == str(plan.probe.max_micro_batch) and "Plan" not in rows
    assert type(load_result(folder / "probe.json")) is type(plan.probe)


def test_default_folder_is_under_reports_and_never_collides(plan, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = write_report(plan), write_report(plan)
    assert re.fullmatch(r"reports/mlp-\d{8}-\d{6}(-\d+)?", first.as_posix())
    assert first != second and (tmp_path / first / "report.html").is_file()
    assert entries(tmp_path / "reports") == {first.name, second.name}


# ---- bad input: one line, exit 2, nothing half-written ---------------------------------------------


def _cli_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autotune report: error: "), err
    return err


def _newer(reports, tmp_path: Path) -> Path:
    data = json.loads((reports["plan"] / "plan.json").read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("case, match", [
    ("not_autotune", "is not an autotune result"),
    ("not_json", "is not JSON"),
    ("newer", "newer than the"),
    ("older", "schema_version 1, older than the 2 this autotune reads: write it again with autotune plan --output"),
    ("missing", "does not exist"),
    ("invalid_plan", "not a valid Plan"),
])
def test_bad_result_files_are_one_line_errors(case, match, reports, tmp_path, capsys):
    src = tmp_path / f"{case}.json"
    if case == "not_autotune":
        src.write_text(json.dumps({"hello": "world", "schema_version": 1}))
    elif case == "not_json":
        src.write_text("{not json")
    elif case == "newer":
        src = _newer(reports, tmp_path)
    elif case == "older":
        data = json.loads((reports["plan"] / "plan.json").read_text())
        src.write_text(json.dumps({**data, "schema_version": 1}))
    elif case == "invalid_plan":
        src.write_text(json.dumps({"kind": "autotune.Plan", "schema_version": SCHEMA_VERSION, "target_batch": 4}))
    out = tmp_path / "out"
    before = entries(tmp_path)
    assert match in _cli_error(capsys, ["report", str(src), "--out", str(out)])
    assert entries(tmp_path) == before  # no report folder, no temporary folder


def test_load_result_raises_result_file_error(reports, tmp_path):
    with pytest.raises(ResultFileError, match="newer than the"):
        load_result(_newer(reports, tmp_path))
    with pytest.raises(ResultFileError, match="does not exist"):
        load_result(tmp_path / "nope.json")
    with pytest.raises(BadInput, match="not str"):
        write_report("plan.json", tmp_path / "x")


def test_output_folder_under_a_file_is_a_one_line_error(reports, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    before = entries(tmp_path)
    err = _cli_error(capsys, ["report", str(reports["plan"] / "plan.json"), "--out", str(blocker / "sub" / "rep")])
    assert "is a file, not a folder" in err
    assert entries(tmp_path) == before and blocker.read_text() == "not a folder"
    with pytest.raises(BadInput, match="not a folder"):
        write_report(load_result(reports["plan"] / "plan.json"), blocker)


def test_existing_folder_needs_force_and_is_replaced_whole(reports, tmp_path, capsys):
    src = str(reports["plan"] / "plan.json")
    out = tmp_path / "rep"
    assert main(["report", src, "--out", str(out)]) == 0
    (out / "stale.txt").write_text("from before")
    capsys.readouterr()
    assert "exists already: pass --force" in _cli_error(capsys, ["report", src, "--out", str(out)])
    assert (out / "stale.txt").is_file() and entries(tmp_path) == {"rep"}
    assert main(["report", src, "--out", str(out), "--force"]) == 0
    assert not (out / "stale.txt").exists() and (out / "report.html").is_file()
    assert entries(tmp_path) == {"rep"}  # no temporary or old folder left beside it


def test_force_never_replaces_a_folder_that_is_not_a_report(reports, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    err = _cli_error(capsys, ["report", str(reports["plan"] / "plan.json"), "--out", str(tmp_path / "mine"), "--force"])
    assert "is not a report folder" in err
    assert entries(tmp_path / "mine") == {"thesis.tex"}


@pytest.mark.parametrize("existing", [False, True])
def test_a_crash_while_writing_leaves_no_half_report(plan, tmp_path, monkeypatch, existing):
    out = tmp_path / "rep"
    if existing:
        write_report(plan, out)
        old = {name: (out / name).read_bytes() for name in entries(out)}

    def crash(report):
        raise RuntimeError("disk full")

    monkeypatch.setattr("autotune.report.markdown.render", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(plan, out, force=True)
    assert entries(tmp_path) == ({"rep"} if existing else set())
    if existing:
        assert {name: (out / name).read_bytes() for name in entries(out)} == old


def test_the_noise_scale_section_shows_the_runs_estimate(reports, run_result):
    page, md = read(reports["run"])
    est = run_result.noise_scale
    assert est is not None and est.steps == len(est.history) == run_result.steps
    assert "## Gradient noise scale" in md and "(noise_scale.png)" in md
    assert f"from {est.steps} optimizer steps" in md_unescape(md)


def test_a_model_by_name_is_named_in_the_summary_with_its_config_and_settings(tmp_path):
    from autotune.results.model import ModelSpec

    from ..workload.hf_configs import write_config

    folder = write_config(tmp_path / "llama", "llama")
    spec = ModelSpec(name=str(folder), seq_len=16, lora="r=4", dtype="bf16-mixed", gradient_checkpointing=True)
    probe = pipeline.probe(model=spec, device="estimate", memory_budget="1GiB", max_batch=4, store=False)
    report = write_report(probe, tmp_path / "report")
    page, md = read(report)
    assert probe.model is not None
    want = probe.model.report_line()
    assert md_rows(md, "Summary")["Model"] == want == html_rows(page, "summary-table")["Model"]
    assert want.startswith(f"llama (LlamaForCausalLM, causal-lm): {probe.model.total_parameters:,} parameters, ")
    for words in ("config from a local config.json", "seq_len 16", "LoRA r=4,alpha=32", "optimizer adamw",
                  "bf16-mixed (frozen weights in the config's dtype, fp32 adapters, autocast to bf16)",
                  "gradient checkpointing"):
        assert words in want, words
    assert load_result(report / "probe.json").model == probe.model
