"""What the job and report commands print for a person: the status table, the jobs legend,
draft names in reports, and where report files went."""
from __future__ import annotations

from click.testing import CliRunner

from batchspec.jobs.display import ending, jobs_table, progress_bar, status_table
from batchspec.report.command import report
from tests.acceptance_records import make_record, write_job

JOB = {"job_id": "nightly-20261201-030000-abc123", "state": "running", "requests_total": 40,
       "requests_completed": 18, "requests_failed": 2, "requests_in_progress": 3,
       "shards_total": 4, "shards_completed": 2, "shards_failed": 1, "shards_cancelled": 0,
       "tokens_generated": 1234, "tokens_per_s": 88.5, "requests_per_s": 1.25,
       "output": "/data/out", "created_at": "2026-12-01T03:00:00.000+00:00",
       "started_at": "2026-12-01T03:00:01.000+00:00"}


def test_status_is_a_short_table():
    shards = {"00001": {"state": "failed", "error": "RuntimeError: CUDA error", "host": "gpu7",
                        "pid": 4242, "attempt": 3},
              "00003": {"state": "running", "host": "gpu2", "pid": 17, "attempt": 1}}
    text = status_table(JOB, 0.6543, shards)
    lines = text.splitlines()
    assert len(lines) <= 16 and all(len(line) <= 100 for line in lines)
    assert lines[1].split() == ["state", "running"]
    assert "20/40 requests (+3 in running shards)" in text and progress_bar(20, 40) in text
    assert "18 done, 2 failed" in text and "1.25 requests/s, 88.5 tokens/s" in text
    assert "acceptance α  0.654" in text
    assert "failed shards:\n  00001  RuntimeError: CUDA error  (host gpu7, pid 4242, attempt 3)" \
        in text
    assert "running shards:\n  00003 (host gpu2, pid 17, attempt 1)" in text
    assert "summary" not in text and "{" not in text


def test_status_before_any_shard_is_done():
    job = JOB | {"state": "queued", "requests_completed": 0, "requests_failed": 0,
                 "requests_in_progress": 0, "shards_completed": 0, "shards_failed": 0}
    job.pop("requests_per_s")
    text = status_table(job, None, {})
    assert "acceptance α  - (no shard done yet)" in text
    assert [line.split() for line in text.splitlines() if line.startswith("throughput")] == \
        [["throughput", "-"]]
    assert progress_bar(0, 40) in text and "failed shards" not in text


def test_a_job_ends_with_what_drafts_made_of_its_output():
    """The line `run` and `submit --wait` end with says how many of the tokens came from
    accepted drafts: where an adaptive engine decoded plainly, α rests on a few rounds."""
    def line(drafted, accepted, tokens=2304):
        summary = {"total_drafted": drafted, "total_accepted": accepted,
                   "acceptance_rate": accepted / drafted if drafted else None,
                   "tokens_generated": tokens, "tokens_per_s": 852.7}
        return ending("completed", completed=48, failed=0, total=48, shards_failed=0,
                      shards_total=1, summary=summary, output="/o").splitlines()[1]
    assert line(2114, 1646) == ("acceptance rate α 0.779 (1,646 of 2,114 drafted tokens "
                                "accepted); 2,304 tokens generated (71% from drafts), "
                                "852.7 tokens/s")
    assert "(0.1% from drafts)" in line(4, 2)
    assert "(0% from drafts)" in line(4, 0)
    assert line(0, 0) == "acceptance rate α n/a (nothing drafted); 2,304 tokens generated, " \
        "852.7 tokens/s"


def test_a_job_of_empty_inputs_points_at_no_outputs(tmp_path):
    """Inputs with no rows (a nightly folder with nothing new): the job completes, and its
    ending says so instead of pointing at outputs and a report that do not exist."""
    from batchspec.cli import _register, cli
    _register()
    (tmp_path / "empty.jsonl").write_text("")
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "empty.jsonl"), "-o",
                                 str(tmp_path / "out"), "-q"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == "completed: the inputs hold no rows; nothing to run"
    (tmp_path / "requests").mkdir()
    (tmp_path / "requests" / "a.jsonl").write_text("")
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "requests"), "-o", str(tmp_path / "o")])
    assert r.exit_code == 1 and "/*.jsonl'" in r.stderr


def test_a_prompt_too_long_is_an_error_row_without_the_tokenizers_warning(tmp_path):
    """The tokenizer's own warning about its model_max_length ("... will result in indexing
    errors") is not printed: the row goes to the errors file, which says what happened."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.cli import _register, cli
    _register()
    pq.write_table(pa.table({"prompt": ["word " * 3000]}),
                   tmp_path / "a.parquet")
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "word " * 3000}]]}),
                   tmp_path / "b.parquet")
    for name in ("a", "b"):
        r = CliRunner().invoke(cli, ["run", str(tmp_path / f"{name}.parquet"), "-o",
                                     str(tmp_path / name), "-q", "--max-tokens", "2"])
        assert r.exit_code == 0 and "0/1 requests done, 1 failed" in r.stderr, r.output
        assert "Token indices" not in r.output


def test_report_says_how_many_tokens_came_from_drafts(tmp_path):
    """An engine that decoded plainly in most rounds (adaptive lengths where drafts do not
    pay) leaves an α over a few rounds: the report's head says what drafts made."""
    mostly_plain = [make_record("r0", [(0, 0)] * 40 + [(4, 1)]),
                    make_record("r1", [(0, 0)] * 41)]
    r = CliRunner().invoke(report, [write_job(str(tmp_path / "job"), [mostly_plain])])
    assert r.exit_code == 0, r.output
    # 1 accepted draft of 1 + 40 + 2 and 1 + 41 tokens
    assert "tokens from accepted drafts             1.2%  (1 / 85 generated)" in r.stdout
    # predicted over the rounds that drafted (p = 1/2: one of 82 rounds makes 1.94 tokens),
    # one token in the others, as observed
    assert "1.01 observed, 1.01 predicted" in r.stdout


def test_jobs_list_has_a_legend():
    text = jobs_table([JOB])
    assert "3/4" in text and "18+2/40" in text
    assert "SHARDS: ended (done + failed) / total" in text
    assert "REQUESTS: done + failed / total" in text
    assert "(no jobs in this Redis)" in jobs_table([])


def test_report_shows_draft_names_and_says_where_it_wrote(tmp_path, monkeypatch):
    draft = "/home/someone/models/very/long/path/to/draft-code"
    recs = [make_record(f"r{i}", [(4, 2)], draft=draft) for i in range(3)]
    job = write_job(str(tmp_path / "job"), [recs])
    html = tmp_path / "r.html"
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(report, [job, "--html", "r.html", "--json", "r.json"])
    assert r.exit_code == 0, r.output
    assert "draft-code" in r.stdout and draft not in r.stdout
    assert f"wrote {html}" in r.stderr and f"wrote {tmp_path / 'r.json'}" in r.stderr
    assert draft in (tmp_path / "r.json").read_text()       # the records keep the path
    r = CliRunner().invoke(report, [job, "--html", str(tmp_path / "missing" / "r.html")])
    assert r.exit_code == 1 and "cannot write" in r.stderr and "Traceback" not in r.output


def test_help_and_the_commands_list_load_neither_torch_nor_polars():
    # `batchspec --help` (and `status`, `submit`, `report --help`) must not wait for torch,
    # transformers or polars: the command modules import them where a command needs them.
    import subprocess
    import sys
    code = ("import sys; from batchspec.cli import _register, cli; _register(); "
            "from click.testing import CliRunner; r = CliRunner().invoke(cli, ['--help']); "
            "assert r.exit_code == 0 and 'report' in r.output and 'bench' in r.output, r.output; "
            "print(sorted({'torch', 'transformers', 'polars'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_jobs_limit_and_a_bad_redis_port_are_one_line():
    """`jobs --limit 0` listed every job (and -1 all but one); a Redis URL with a port that is
    not a number said only "Port could not be cast to integer value"."""
    from batchspec.cli import _register, cli
    _register()
    r = CliRunner().invoke(cli, ["jobs", "--limit", "0"])
    assert r.exit_code == 2 and "--limit" in r.output
    for url in ("redis://127.0.0.1:abc/0", "redis://127.0.0.1:99999/0"):
        r = CliRunner().invoke(cli, ["jobs", "--broker", url])
        assert r.exit_code == 1 and f"invalid Redis URL {url}" in r.stderr, r.output
        assert "Traceback" not in r.output


def test_status_of_a_firing_that_was_never_submitted():
    """A beat firing that could not be submitted is a failed record without rows: its status
    says so and gives the reason, with no progress bar, counts or rates of nothing."""
    job = {"job_id": "nightly-20261201-030000-def456", "state": "failed", "requests_total": 0,
           "requests_completed": 0, "requests_failed": 0, "requests_in_progress": 0,
           "shards_total": 0, "shards_completed": 0, "shards_failed": 0,
           "shards_cancelled": 0, "tokens_generated": 0, "output": "/data/out",
           "error": "could not submit jobs/nightly.yaml: FileNotFoundError: in/*.parquet "
                    "matches no files",
           "created_at": "2026-12-01T03:00:00.000+00:00",
           "finished_at": "2026-12-01T03:00:00.000+00:00"}
    rows = {line.split()[0]: line.split(None, 1)[1] for line in
            status_table(job, None, {}).splitlines()}
    assert list(rows) == ["job", "state", "progress", "output", "error", "times"]
    assert rows["progress"] == "- (no row ran: see the error)"
    assert rows["error"].endswith("matches no files") and "100.0%" not in str(rows)
