"""The README's main job, end to end: `batchspec run examples/prompts.parquet -o OUT` on the
bundled demo models, then `batchspec report` over its acceptance records — aggregates checked
against values computed independently from the Parquet files. The report runs over the job at a
fixed k (`--fixed-k`): by default a job adapts its draft lengths, and at this job's 48 rows on a
small CPU it decodes plainly and drafts little or nothing."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchspec.cli import _register, cli
from batchspec.report.analysis import analyze
from tests.conftest import ROOT

EXAMPLES = os.path.join(ROOT, "examples", "prompts.parquet")


def run_demo(tmp_path_factory, *extra):
    _register()
    out = str(tmp_path_factory.mktemp("demo") / "out")
    res = CliRunner().invoke(cli, ["run", EXAMPLES, "-o", out, "--quiet", *extra],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_demo(tmp_path_factory)


@pytest.fixture(scope="module")
def fixed_job(tmp_path_factory):
    return run_demo(tmp_path_factory, "--fixed-k")


def read(out, kind):
    return pq.read_table(os.path.join(out, kind)).to_pylist()


def test_demo_job_writes_every_row_once(job):
    rows = pq.read_table(EXAMPLES).to_pylist()
    outputs, records = read(job, "outputs"), read(job, "acceptance")
    assert sorted(o["id"] for o in outputs) == sorted(r["id"] for r in rows)
    assert sorted(r["request_id"] for r in records) == sorted(r["id"] for r in rows)
    assert os.path.exists(os.path.join(job, "_SUCCESS"))
    by_id = {r["id"]: r for r in rows}
    drafts = {r["request_id"]: r["draft"] for r in records}
    for o in outputs:
        assert o["num_output_tokens"] == len(o["token_ids"]) > 0
        assert o["domain"] == by_id[o["id"]].get("domain")
        assert o["draft"] == drafts[o["id"]]
        if o["domain"] in ("code", "docs"):  # per-domain drafts serve their domain
            assert o["draft"].endswith(f"draft-{o['domain']}")


def test_report_on_the_demo_job_matches_the_records(fixed_job, tmp_path):
    job = fixed_job
    records = read(job, "acceptance")
    drafted = sum(r["total_drafted"] for r in records)
    accepted = sum(r["total_accepted"] for r in records)
    tokens = sum(r["tokens_generated"] for r in records)
    assert drafted > 0
    r = analyze([job])
    assert r["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert r["summary"]["requests"] == len(records)
    job_doc = json.load(open(os.path.join(job, "_job.json")))
    assert job_doc["summary"]["acceptance_rate"] == pytest.approx(accepted / drafted)
    res = CliRunner().invoke(cli, ["report", job, "--json", str(tmp_path / "r.json"),
                                   "--html", str(tmp_path / "r.html")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.load(open(tmp_path / "r.json"))
    assert doc["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert tokens == sum(len(o["token_ids"]) for o in read(job, "outputs"))
    assert open(tmp_path / "r.html").read().count("<svg") >= 6
