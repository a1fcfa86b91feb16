"""`batchspec run`: a whole job in-process on tiny random models, through the CLI."""
from __future__ import annotations

import datetime as dt
import json
import os

import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchspec.cli import _register, cli
from batchspec.contract import ACCEPTANCE_SCHEMA
from batchspec.jobs.outputs import ERROR_SCHEMA, OUTPUT_SCHEMA
from batchspec.jobs.states import iso
from tests.jobdata import BAD_ROWS, GOOD_IDS, job_spec_of, make_inputs, read_dir

_register()


def run_cli(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def job_out(inputs, tiny_llama, tiny_draft, tmp_path_factory):
    out = tmp_path_factory.mktemp("job") / "out"
    result = run_cli("run", *inputs, "-o", out, "--model", tiny_llama,
                     "--draft", f"default={tiny_draft}", "--draft", "code=ngram",
                     "--max-tokens", 6, "--shard-size", 2, "--seed", 3)
    assert result.exit_code == 0, result.output
    return out, result


def test_run_writes_outputs_errors_acceptance(job_out):
    out, result = job_out
    doc = json.loads((out / "_job.json").read_text())
    assert result.stdout.strip().splitlines()[-1] == doc["job_id"]
    assert "completed_with_errors" in result.stderr
    outputs, errors, records = (read_dir(out, k) for k in ("outputs", "errors", "acceptance"))
    assert outputs.schema == OUTPUT_SCHEMA and errors.schema == ERROR_SCHEMA
    assert records.schema == ACCEPTANCE_SCHEMA
    assert sorted(outputs.column("id").to_pylist()) == sorted(GOOD_IDS)
    assert dict(zip(errors.column("id").to_pylist(),
                    errors.column("error_type").to_pylist(), strict=True)) == BAD_ROWS
    rows = outputs.to_pylist()
    for row in rows:
        assert 1 <= row["num_output_tokens"] == len(row["token_ids"]) <= 6
    assert next(r for r in rows if r["id"] == "bad-ok2")["num_output_tokens"] <= 3
    assert sorted(records.column("request_id").to_pylist()) == sorted(GOOD_IDS)
    assert set(records.column("job_id").to_pylist()) == {doc["job_id"]}
    assert set(records.column("shard").to_pylist()) <= {f"{i:05d}" for i in range(9)}
    assert doc["state"] == "completed_with_errors" and (out / "_SUCCESS").exists()
    assert doc["counts"] == {"shards_total": 9, "shards_completed": 9, "shards_failed": 0,
                             "shards_cancelled": 0, "requests_total": 15,
                             "requests_completed": 10, "requests_failed": 5}
    assert doc["summary"]["tokens_generated"] == sum(r["num_output_tokens"] for r in rows)
    assert doc["summary"]["total_drafted"] == sum(records.column("total_drafted").to_pylist())
    assert doc["spec"]["drafts"]["code"] == "ngram"
    # times written as the store writes them (to the millisecond), whichever path ran the job
    for key in ("started_at", "finished_at"):
        t = doc["timings"][key]
        assert t == iso(dt.datetime.fromisoformat(t)), t


def test_rerun_runs_only_missing_shards(job_out, inputs, tiny_llama, tiny_draft):
    out, _ = job_out
    before = read_dir(out, "outputs")
    missing = out / "outputs" / "part-00003.parquet"
    os.unlink(missing)
    stamps = {p: os.stat(out / "outputs" / p).st_mtime_ns for p in os.listdir(out / "outputs")}
    result = run_cli("run", *inputs, "-o", out, "--model", tiny_llama,
                     "--draft", f"default={tiny_draft}", "--draft", "code=ngram",
                     "--max-tokens", 6, "--shard-size", 2, "--seed", 3)
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "_job.json").read_text())
    assert doc["shards_run"] == ["00003"]
    assert all(os.stat(out / "outputs" / p).st_mtime_ns == t for p, t in stamps.items())
    after = read_dir(out, "outputs")
    key = ["id", "text", "token_ids", "finish_reason"]
    assert after.select(key).sort_by("id").equals(before.select(key).sort_by("id"))
    # A finished job re-run is reported, not run: _job.json stays byte for byte.
    job_json = (out / "_job.json").read_bytes()
    result = run_cli("run", *inputs, "-o", out, "--model", tiny_llama,
                     "--draft", f"default={tiny_draft}", "--draft", "code=ngram",
                     "--max-tokens", 6, "--shard-size", 2, "--seed", 3)
    assert result.exit_code == 0 and "already complete: job " in result.stderr
    assert result.stdout.strip() == doc["job_id"]
    assert (out / "_job.json").read_bytes() == job_json
    assert all(os.stat(out / "outputs" / p).st_mtime_ns == t for p, t in stamps.items())


def test_output_dir_of_another_job_is_refused(job_out, inputs, tiny_llama):
    out, _ = job_out
    before = sorted(os.listdir(out / "outputs"))
    common = [*inputs, "-o", out, "--model", tiny_llama, "--seed", 3]
    result = run_cli("run", *common, "--max-tokens", 7, "--shard-size", 2)
    assert result.exit_code == 1 and "other max_tokens" in result.stderr
    result = run_cli("run", *common, "--max-tokens", 6, "--shard-size", 3)
    assert result.exit_code == 1 and "other inputs or shard size" in result.stderr
    assert sorted(os.listdir(out / "outputs")) == before and (out / "_SUCCESS").exists()


def test_plain_decoding_yaml_template_chat(tmp_path, tiny_llama):
    rows = pa.table({"question": ["What is two?", "Why?"], "context": ["Two is 2.", "No."]})
    import pyarrow.parquet as pq
    pq.write_table(rows, tmp_path / "rag.parquet")
    (tmp_path / "job.yaml").write_text(
        f"inputs: [{tmp_path / 'rag.parquet'}]\noutput: {tmp_path / 'out-{date}'}\n"
        f"model: {tiny_llama}\nmax_tokens: 50\nchat: true\n"
        "template: \"Context: {context}\\nQuestion: {question}\"\nschedule: '0 3 * * *'\n")
    result = run_cli("run", "--config", tmp_path / "job.yaml", "--max-tokens", 4)
    assert result.exit_code == 0, result.output
    [out] = [p for p in tmp_path.iterdir() if p.name.startswith("out-2")]
    records = read_dir(out, "acceptance").to_pylist()
    assert len(records) == 2 and all(r["acceptance_rate"] is None for r in records)
    assert all(r["draft"] is None and r["tokens_generated"] <= 4 for r in records)
    doc = json.loads((out / "_job.json").read_text())
    assert doc["state"] == "completed" and doc["summary"]["acceptance_rate"] is None
    assert doc["spec"]["max_tokens"] == 4 and doc["spec"]["chat"] is True


@pytest.mark.parametrize("args,message", [
    (["missing.parquet"], "does not exist"),
    (["{a}", "--model", "/no/such/model"], "is not a directory"),
    (["{a}", "--draft", "code"], "DOMAIN=PATH"),
    (["{a}", "--shard-size", "0"], "shard_size must be >= 1"),
    (["{a}", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["{a}", "--device", "cuda:7"], "device 'cuda:7'"),
    (["{a}", "--template", "{nope}"], "lacks the column(s) ['nope']"),
])
def test_bad_input_fails_fast_with_a_clear_message(args, message, inputs, tiny_llama, tmp_path):
    args = [a.replace("{a}", inputs[0]) for a in args]
    if "--model" not in args:
        args += ["--model", tiny_llama]
    result = run_cli("run", *args, "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert message in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()       # nothing written, not even _plan.json


def test_unknown_yaml_setting(tmp_path, tiny_llama):
    (tmp_path / "job.yaml").write_text(f"model: {tiny_llama}\nmax_tokenz: 3\n")
    result = run_cli("run", "in.parquet", "-o", tmp_path, "--config", tmp_path / "job.yaml")
    assert result.exit_code == 1 and "max_tokenz" in result.stderr


@pytest.mark.parametrize("line,message", [
    ('max_tokens: "three"', "max_tokens must be an integer, got 'three'"),
    ("max_tokens: true", "max_tokens must be an integer, got True"),
    ("temperature: [1]", "temperature must be a number, got [1]"),
    ("temperature: null", "temperature must be a number, got None"),
    ('seed: "x"', "seed must be an integer, got 'x'"),
    ('top_k: "x"', "top_k must be an integer"),
    ("chat: 1", "chat must be true or false, got 1"),
    ("template: 3", "template must be text (or null), got 3"),
])
def test_a_yaml_setting_of_the_wrong_type_is_one_line(tmp_path, tiny_llama, line, message):
    """A job YAML can hold any type where a setting wants a number, a flag or text: one
    line naming the setting (it used to be a traceback from deep in the sampling checks, or
    a seed of "x" written to _job.json)."""
    (tmp_path / "job.yaml").write_text(f"model: {tiny_llama}\n{line}\n")
    result = run_cli("run", "in.parquet", "-o", tmp_path / "out", "--config",
                     tmp_path / "job.yaml")
    assert result.exit_code == 1 and message in result.stderr, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,columns", [
    ("nightly_summarization", {"id": ["d1", "d2"], "title": ["Rain", "Sun"],
                               "text": ["It rained all day.", "The sun was out."]}),
    ("rag_pregen", {"id": ["q1"], "question": ["Who wrote it?"],
                    "context": ["It was written by Ada."]}),
])
def test_job_definitions_run(name, columns, tmp_path, monkeypatch, tiny_llama):
    import datetime as dt

    import pyarrow.parquet as pq

    from batchspec.jobs.spec import load_yaml
    config = os.path.join(ROOT, "jobs", f"{name}.yaml")
    monkeypatch.chdir(tmp_path)
    values = load_yaml(config, dt.datetime.now(dt.UTC))
    folder = os.path.dirname(values["inputs"][0])
    os.makedirs(folder)
    pq.write_table(pa.table(columns), os.path.join(folder, "questions-1.parquet"))
    result = run_cli("run", "--config", config, "--model", tiny_llama, "--max-tokens", 4)
    assert result.exit_code == 0, result.output
    outputs = read_dir(tmp_path / values["output"], "outputs")
    assert sorted(outputs.column("id").to_pylist()) == sorted(columns["id"])


def test_yaml_dates_fill_output_and_suffix_seed(tmp_path):
    import datetime as dt

    from batchspec.jobs.spec import load_yaml
    config = tmp_path / "job.yaml"
    config.write_text("inputs: ['docs/{yesterday}/*.parquet']\noutput: out/{yesterday}\n"
                      "suffix_seed: out/{ago[2]}\ndrafts: {default: suffix}\n")
    values = load_yaml(str(config), dt.datetime(2026, 3, 1, 2, 30, tzinfo=dt.UTC))
    assert values["inputs"] == ["docs/2026-02-28/*.parquet"]
    assert values["output"] == "out/2026-02-28" and values["suffix_seed"] == "out/2026-02-27"


def test_a_broken_job_yaml_stops_beat_with_one_line(tmp_path):
    from batchspec.jobs.schedule import load_schedules
    (tmp_path / "x.yaml").write_text('schedule: "every 1m\ninputs: [\n')
    with pytest.raises(ValueError, match="x.yaml is not valid YAML"):
        load_schedules(str(tmp_path))


@pytest.mark.parametrize("args,message", [
    (["run", "in.parquet"], "a job needs an output directory (-o/--output)"),
    (["submit", "in.parquet"], "a job needs an output directory (-o/--output)"),
    (["run", "-o", "out"], "a job needs at least one input"),
])
def test_a_job_without_inputs_or_output_is_one_line(args, message, redis_server):
    """(a traceback from JobSpec's constructor, before)"""
    result = CliRunner().invoke(cli, [*args, *(["--broker", redis_server]
                                               if args[0] == "submit" else [])])
    assert result.exit_code == 1 and message in result.stderr, result.output
    assert "Traceback" not in result.output


def test_schedules_parse():
    import datetime as dt

    from batchspec.jobs.schedule import parse_schedule
    assert parse_schedule("every 2s") == dt.timedelta(seconds=2)
    cron = parse_schedule("30 2 * * *")
    assert cron.hour == {2} and cron.minute == {30}
    for bad in ("every 2 weeks", "30 2 * *", "61 * * * *"):
        with pytest.raises(ValueError, match="schedule"):
            parse_schedule(bad)


def test_shards_overlap_in_the_batch_and_outputs_do_not_change(inputs, tiny_llama, tmp_path):
    """run_local queues the next shard once the current one is admitted, so steps run rows
    of several shards together; every row's output equals a shard-by-shard run's."""
    from batchspec import LLM
    from batchspec.jobs.runner import run_local, run_shard, start_job
    from batchspec.jobs.spec import JobSpec

    def spec(out):
        return JobSpec(inputs=inputs, output=str(out), model=tiny_llama, max_tokens=6,
                       shard_size=2, seed=3)

    llm = LLM(tiny_llama, device="cpu", max_num_seqs=8)
    mixed_steps = []
    step = llm.engine.step

    def watched_step():
        shards = {s.request_id[:1] for s in llm.engine.scheduler.running}
        mixed_steps.append(len(shards) > 1)
        return step()

    llm.engine.step = watched_step
    doc = run_local(spec(tmp_path / "overlap"), progress=False, llm=llm)
    assert doc["state"] == "completed_with_errors" and any(mixed_steps)
    llm.engine.step = step
    one_by_one = spec(tmp_path / "serial")
    for shard in start_job(one_by_one):
        run_shard(one_by_one, shard, llm, job_id="serial")
    a, b = (read_dir(tmp_path / d, "outputs").to_pylist() for d in ("overlap", "serial"))
    key = lambda r: r["id"]  # noqa: E731
    assert [(r["id"], r["token_ids"]) for r in sorted(a, key=key)] == \
        [(r["id"], r["token_ids"]) for r in sorted(b, key=key)]
    assert len(a) == len(GOOD_IDS)


def test_jobs_adapt_draft_lengths_unless_told(tmp_path, tiny_llama, tiny_draft, monkeypatch):
    """A job chooses each row's draft length per step by default (at the batch sizes jobs run
    at, a fixed k loses to plain decoding: docs/benchmarks.md, thirty-sixth round):
    `--fixed-k`, `adaptive_k: false` in a job file and BATCHSPEC_ADAPTIVE_K=0 keep k fixed.
    The engine a job loads (tasks.get_llm) measures its step costs only where it adapts."""
    import yaml

    from batchspec.jobs import tasks
    shard = tmp_path / "in.parquet"
    args = [shard, "-o", tmp_path / "out", "--model", tiny_llama, "--draft",
            f"default={tiny_draft}"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"inputs": [str(shard)], "output": str(tmp_path / "out"),
                                   "model": tiny_llama, "adaptive_k": False}))
    for extra, env, want in (([], None, True), (["--fixed-k"], None, False),
                             (["--adaptive-k"], None, True), ([], "0", False),
                             (["--config", job], None, False),
                             (["--config", job, "--adaptive-k"], None, True)):
        if env is None:
            monkeypatch.delenv("BATCHSPEC_ADAPTIVE_K", raising=False)
        else:
            monkeypatch.setenv("BATCHSPEC_ADAPTIVE_K", env)
        assert job_spec_of(args + extra).engine_config().adaptive_k is want, (extra, env)
    monkeypatch.delenv("BATCHSPEC_ADAPTIVE_K", raising=False)
    for extra, measured in (([], True), (["--fixed-k"], False)):
        llm = tasks.get_llm(job_spec_of(args + extra))
        assert (llm.engine.policy.costs is not None) is measured, extra
