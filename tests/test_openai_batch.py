"""OpenAI Batch request files through `batchspec run` and `batchspec submit` (a real Redis
and a real worker): every good line answered once in OUT/openai/output.jsonl, the malformed
lines in OUT/openai/errors.jsonl with their line numbers, and the same tokens as the
Parquet job of the same requests."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchspec.cli import _register, cli
from batchspec.jobs.openai_batch import parse_row
from tests.jobdata import read_dir
from tests.openai_batch_data import BAD_LINES, NUM_GOOD, parquet_table, write_requests
from tests.test_jobs_celery import batchspec

_register()
SAME = ["id", "text", "token_ids", "finish_reason", "num_prompt_tokens", "num_output_tokens"]


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openai")
    rows = write_requests(folder / "requests.jsonl")
    pq.write_table(parquet_table(rows), folder / "requests.parquet")
    return folder


@pytest.fixture(scope="module")
def job_args(tiny_llama, tiny_draft):
    # a fixed k: the two jobs' sampled rows are compared token for token, and with adaptive
    # lengths (a job's default) which sample a seed gives depends on the lengths chosen
    return ["--model", tiny_llama, "--draft", f"default={tiny_draft}", "--shard-size", "16",
            "--seed", "5", "--max-tokens", "4", "--fixed-k"]


@pytest.fixture(scope="module")
def parquet_job(requests_file, job_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("parquet") / "out"
    r = CliRunner().invoke(cli, ["run", str(requests_file / "requests.parquet"), "-o", str(out),
                                 "-q", *job_args])
    assert r.exit_code == 0, r.output
    return read_dir(out, "outputs").select(SAME).sort_by("id")


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_openai_job(out, parquet_outputs):
    answers = read_jsonl(out / "openai" / "output.jsonl")
    errors = read_jsonl(out / "openai" / "errors.jsonl")
    ids = [a["custom_id"] for a in answers]
    assert sorted(ids) == sorted(f"request-{i + 1}" for i in range(NUM_GOOD))  # each once
    assert {e["error"]["line"]: e["error"]["code"] for e in errors} == BAD_LINES
    assert all(e["response"] is None and e["error"]["message"].startswith("line ")
               for e in errors)
    # The same tokens as the Parquet job of the same requests.
    outputs = read_dir(out, "outputs").select(SAME).sort_by("id")
    assert outputs.equals(parquet_outputs)
    texts = dict(zip(outputs.column("id").to_pylist(), outputs.column("text").to_pylist()))
    for a in answers:
        body = a["response"]["body"]
        chat = int(a["custom_id"].split("-")[1]) % 3 != 0
        assert a["response"]["status_code"] == 200 and a["error"] is None
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        choice = body["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == texts[a["custom_id"]]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert a["batchspec"]["drafted"] >= a["batchspec"]["accepted"] >= 0
    assert any(a["batchspec"]["drafted"] for a in answers)
    assert len({a["id"] for a in answers}) == len(answers)


def test_run_openai_batch_file(requests_file, job_args, parquet_job, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(requests_file / "requests.jsonl"), "-o", str(out),
                                 "-q", "--output-format", "openai", *job_args])
    assert r.exit_code == 0, r.output
    check_openai_job(out, parquet_job)
    assert f"{NUM_GOOD}/{NUM_GOOD + 2} requests done, 2 failed" in r.stderr
    assert "acceptance rate α 0." in r.stderr and f"outputs in {out}/outputs/" in r.stderr
    assert f"{out}/openai/output.jsonl" in r.stderr
    doc = json.loads((out / "_job.json").read_text())
    assert doc["state"] == "completed_with_errors"
    assert doc["counts"]["requests_failed"] == len(BAD_LINES)
    assert doc["openai_files"]["output"].endswith("openai/output.jsonl")


@pytest.mark.slow
def test_submit_openai_batch_file(requests_file, job_args, parquet_job, start_worker,
                                  redis_server, tmp_path):
    worker = start_worker("openai")
    out = tmp_path / "out"
    r = batchspec(redis_server, "submit", requests_file / "requests.jsonl", "-o", out,
                  "--output-format", "openai", "--wait", "-q", *job_args)
    assert r.returncode == 0, r.stderr + worker.tail()
    check_openai_job(out, parquet_job)
    # submit --wait ends like run: counts, α, where the outputs are.
    assert f"completed_with_errors: {NUM_GOOD}/{NUM_GOOD + 2} requests done" in r.stderr
    assert "acceptance rate α 0." in r.stderr and f"outputs in {out}/outputs/" in r.stderr
    assert f"{out}/openai/output.jsonl" in r.stderr
    job_id = r.stdout.strip().splitlines()[-1]
    status = batchspec(redis_server, "status", job_id)
    assert status.returncode == 0, status.stderr
    lines = dict(line.split(None, 1) for line in status.stdout.splitlines()
                 if line and not line.startswith(" ") and line.split()[0] in
                 ("state", "progress", "requests", "shards", "acceptance", "output"))
    assert lines["state"] == "completed_with_errors"
    assert "100.0%" in lines["progress"] and f"{NUM_GOOD + 2}/{NUM_GOOD + 2}" in lines["progress"]
    assert lines["requests"].startswith(f"{NUM_GOOD} done, 2 failed")
    assert lines["acceptance"].split()[-1].startswith("0.") and lines["output"] == str(out)


@pytest.mark.parametrize("line, error_type", [
    ("[1, 2]", "invalid_request"),
    ('{"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
     "invalid_request"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}',
     "invalid_request"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": 3}}', "invalid_prompt"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": []}}',
     "invalid_prompt"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": '
     '[{"role": "user", "content": [{"type": "image_url"}]}]}}', "invalid_prompt"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}}',
     "invalid_override"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "seed": 1.5}}',
     "invalid_override"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "stop": 3}}',
     "invalid_override"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", '
     '"max_tokens": 18446744073709551616}}', "invalid_override"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "seed": 1e30}}',
     "invalid_override"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x \\ud800"}}',
     "invalid_json"),
    ('{"custom_id": "\\udfff", "url": "/v1/completions", "body": {"prompt": "x"}}',
     "invalid_json"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "metadata": "c"}}',
     "invalid_request"),
    (b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x \xff"}}',
     "invalid_json"),
])
def test_malformed_lines_name_their_reason(line, error_type):
    row = parse_row(12, line, "requests")
    assert row["_error_type"] == error_type and row["_error"].startswith("line 12: ")
    assert row["_line"] == 12 and row["id"]


def test_lines_that_break_a_row_fail_alone(tmp_path, tiny_llama):
    """Lines whose values no row can hold (an integer past 64 bits, half a surrogate pair,
    bytes that are not UTF-8) used to fail their whole shard (or stop the job) and leave
    made-up ids in the error file; now each is an error line of its own and the rest run.
    A byte-order mark opens the file. Lines sharing a custom_id after a bad first one: each
    error at its own line, every line of both files with an id of its own."""
    ok = lambda cid, **body: json.dumps({"custom_id": cid, "method": "POST",  # noqa: E731
                                         "url": "/v1/completions",
                                         "body": {"prompt": "hi there", **body}})
    lines = [ok("a").encode(), ok("big", max_tokens=2**64).encode(),
             ok("half", prompt="x \ud800").encode(),
             ok("bytes").encode().replace(b"hi there", b"hi \xff"),
             json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/embeddings",
                         "body": {}}).encode(),
             ok("x").encode(), ok("y").encode(), ok("y").encode()]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["run", str(path), "-o", str(out), "-q", "--model", tiny_llama,
                                 "--max-tokens", "3", "--output-format", "openai"])
    assert r.exit_code == 0, r.output
    answers = read_jsonl(out / "openai" / "output.jsonl")
    errors = read_jsonl(out / "openai" / "errors.jsonl")
    assert [a["custom_id"] for a in answers] == ["a", "y"]
    assert [(e["custom_id"], e["error"]["line"], e["error"]["code"]) for e in errors] == [
        ("big", 2, "invalid_override"), (None, 3, "invalid_json"), (None, 4, "invalid_json"),
        ("x", 5, "unsupported_url"), ("x", 6, "duplicate_id"), ("y", 8, "duplicate_id")]
    assert all(e["error"]["message"].startswith(f"line {e['error']['line']}: ") for e in errors)
    assert len({line["id"] for line in answers + errors}) == len(answers) + len(errors)


def test_line_fields_map_onto_row_overrides():
    row = parse_row(1, json.dumps({
        "custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
            "max_tokens": 9, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9,
            "seed": 3, "stop": "END", "metadata": {"domain": "code"},
            "frequency_penalty": 0.1}}), "requests")
    assert row == {"id": "x", "messages": [{"role": "user", "content": "Hi there"}],
                   "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                   "stop": ["END"], "domain": "code", "_line": 1}


def test_request_file_shards_seek_to_their_first_line(tmp_path):
    """Each shard of a request file records where its first row starts (byte offset, line
    number), found in the one pass that counts the rows, and reads from there: the rows,
    their line numbers (in error messages) and their ids are those of reading the file from
    the top, blank and non-ASCII lines included; the position survives the job record."""
    from batchspec.jobs import openai_batch
    from batchspec.jobs.shards import Shard, plan_shards, read_shard
    path = tmp_path / "requests.jsonl"
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "m", "prompt": f"naïve {i} — ✓"}}) for i in range(11)]
    lines[4:4] = ["", "   "]                     # blank lines are not rows
    lines.insert(8, '{"custom_id": "cut"')       # malformed: a row with an error
    path.write_text("\n".join(lines) + "\n\n")
    shards = plan_shards([str(path)], 3)
    assert [s.num_rows for s in shards] == [3, 3, 3, 3] and shards[0].line_at == (0, 1)
    assert all(s.line_at[0] > 0 for s in shards[1:])
    whole = openai_batch.read_rows(str(path), 0, 12, shards[0].source).to_pylist()
    parts = [r for s in shards for r in read_shard(Shard.from_dict(s.to_dict())).to_pylist()]
    assert parts == whole and len(whole) == 12
    ids = [r["id"] for r in whole]
    assert ids == [f"r{i}" for i in range(6)] + ["requests:line9"] + [f"r{i}" for i in
                                                                       range(6, 11)]
