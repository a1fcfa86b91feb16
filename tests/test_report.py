"""`batchspec report` through the click group: terminal summary, JSON, HTML charts, and the
clear outcomes for plain-only, empty and wrong inputs."""
from __future__ import annotations

import json
import os
import re

import pytest
from click.testing import CliRunner

from batchspec.cli import _register, cli
from tests.acceptance_records import make_record, plain_record, synthetic_records, write_job

CHART_TITLES = {"chart-position": "α by output position",
                "chart-depth": "α by depth in the draft window",
                "chart-by-domain": "α by domain", "chart-by-draft": "α by draft",
                "chart-by-temperature": "α by temperature",
                "chart-distribution": "Per-request α distribution"}


@pytest.fixture(scope="module", autouse=True)
def registered():
    _register()


def run(*args):
    return CliRunner().invoke(cli, ["report", *map(str, args)], catch_exceptions=False)


def charts_in(html: str) -> dict[str, str]:
    return dict(re.findall(r'<svg id="([^"]+)"[^>]*>\s*<title>([^<]*)</title>', html))


def test_report_json_html_and_text(tmp_path):
    a = synthetic_records(120, seed=2, job_id="a")
    b = synthetic_records(80, seed=3, job_id="b")
    job_a = write_job(str(tmp_path / "a"), [a])
    job_b = write_job(str(tmp_path / "b"), [b[:40], b[40:]])
    res = run(job_a, job_b, "--json", tmp_path / "r.json", "--html", tmp_path / "r.html")
    assert res.exit_code == 0, res.output

    alpha = (sum(r["total_accepted"] for r in a + b) / sum(r["total_drafted"] for r in a + b))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert next(iter(doc)) == "acceptance_rate" and doc["acceptance_rate"] == pytest.approx(alpha)
    assert doc["summary"]["requests"] == 200 and doc["files"] == 3
    assert set(doc["by"]) == {"domain", "draft", "temperature"}
    assert sum(g["requests"] for g in doc["by"]["domain"]) == 200
    assert f"{alpha:.3f}  (" in res.output and "α by temperature" in res.output

    html = (tmp_path / "r.html").read_text()
    assert charts_in(html) == CHART_TITLES
    assert html.count("<svg") == len(CHART_TITLES)
    # Self-contained: nothing to fetch, nothing to run.
    assert "<script" not in html and "src=" not in html and "href=" not in html


def test_by_option_chooses_breakdowns(tmp_path):
    recs = synthetic_records(50, job_id="j") + [make_record("no-domain", [(2, 1)], domain=None)]
    job = write_job(str(tmp_path / "j"), [recs])
    res = run(job, "--by", "job,k", "--json", tmp_path / "r.json", "--html", tmp_path / "r.html")
    assert res.exit_code == 0, res.output
    assert set(json.loads((tmp_path / "r.json").read_text())["by"]) == {"job", "k"}
    assert {"chart-by-job", "chart-by-k"} <= set(charts_in((tmp_path / "r.html").read_text()))
    res = run(job, "--by", "domain,draft")
    domain_table = res.output.split("α by domain")[1].split("α by draft")[0]
    draft_table = res.output.split("α by draft")[1].split("α by output position")[0]
    assert "(none)" in domain_table and "(plain)" not in domain_table
    assert "(plain)" in draft_table and "(none)" not in draft_table
    res = run(job, "--by", "colour")
    assert res.exit_code == 2 and "cannot break down by ['colour']" in res.output


def test_plain_only_job_reports_no_speculation(tmp_path):
    job = write_job(str(tmp_path / "plain"), [[plain_record(f"r{i}", 10) for i in range(5)]])
    res = run(job, "--json", tmp_path / "r.json", "--html", tmp_path / "r.html")
    assert res.exit_code == 0, res.output
    assert "No speculation" in res.output
    assert json.loads((tmp_path / "r.json").read_text())["acceptance_rate"] is None
    html = (tmp_path / "r.html").read_text()
    assert charts_in(html) == CHART_TITLES and "no speculative data" in html


def test_empty_shard_reports_no_records(tmp_path):
    job = write_job(str(tmp_path / "empty"), [[]])
    res = run(job, "--html", tmp_path / "r.html")
    assert res.exit_code == 0, res.output
    assert "No acceptance records" in res.output and "0 (0 speculative)" in res.output
    assert os.path.getsize(tmp_path / "r.html") > 0


def test_path_without_acceptance_files_is_a_usage_error(tmp_path):
    (tmp_path / "outputs").mkdir()
    res = run(tmp_path)
    assert res.exit_code == 2
    assert "no acceptance/ directory" in res.output and "OUT/acceptance/part-*.parquet" in res.output
    assert run(tmp_path / "nowhere").exit_code == 2


def test_a_job_file_without_records_is_named_or_skipped(tmp_path):
    """An outputs file named for a report is a usage error that names it (it was a
    traceback from Polars); one a glob matches beside the acceptance files is skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    job = write_job(str(tmp_path / "job"), [synthetic_records(20)])
    os.makedirs(tmp_path / "job" / "outputs")
    outputs = tmp_path / "job" / "outputs" / "part-00000.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["x"]}), outputs)
    res = run(outputs)
    assert res.exit_code == 2 and "holds no acceptance records" in res.output
    assert str(outputs) in res.output and "Traceback" not in res.output
    res = run(f"{job}/*/part-*.parquet")
    assert res.exit_code == 0, res.output
    assert "20 (" in res.output


def test_what_a_report_cannot_use_is_one_line(tmp_path):
    """A text file, a damaged acceptance file, a breakdown by a measured column, a negative
    --outliers and a store whose package is missing: one line each (an empty report, two
    Polars tracebacks, a blame on --by and an ImportError's traceback, before). A job whose
    inputs held no rows reports no records instead of "no acceptance/ directory"."""
    (tmp_path / "notes.txt").write_text("hi")
    res = run(tmp_path / "notes.txt")
    assert res.exit_code == 2 and "not a Parquet file" in res.output
    job = write_job(str(tmp_path / "job"), [synthetic_records(10), synthetic_records(10, 1)])
    part = tmp_path / "job" / "acceptance" / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[:300])
    res = CliRunner().invoke(cli, ["report", job])
    assert res.exit_code == 1 and f"{part} cannot be read" in res.output, res.output
    assert "Traceback" not in res.output
    good = write_job(str(tmp_path / "good"), [synthetic_records(10)])
    res = run(good, "--by", "total_drafted")
    assert res.exit_code == 2 and "a breakdown measures it" in res.output
    res = run(good, "--outliers", "-3")
    assert res.exit_code == 2 and "--outliers" in res.output and "--by" not in res.output
    import importlib.util
    if importlib.util.find_spec("s3fs") is None:
        res = CliRunner().invoke(cli, ["report", "s3://bucket/x"])
        assert res.exit_code == 1 and "s3fs" in res.output and "Traceback" not in res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "_job.json").write_text("{}")
    res = run(empty)
    assert res.exit_code == 0 and "the jobs wrote no shard" in res.output
