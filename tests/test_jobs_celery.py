"""Bulk jobs through a real redis-server and real `batchspec worker` processes: errors
file and counts, resume, a poison shard, cancellation, beat schedules, and `run` ==
`submit` (worker and Redis faults: test_faults.py)."""
from __future__ import annotations

import datetime as dt
import functools
import json
import os
import shutil
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchspec.cli import _register, cli
from batchspec.jobs.states import FINAL as TERMINAL
from batchspec.jobs.states import iso
from batchspec.jobs.store import JobStore
from tests.fixtures_redis import wait_until
from tests.jobdata import BAD_ROWS, GOOD_IDS, make_inputs, read_dir

_register()
SAME = ["id", "text", "token_ids", "finish_reason", "num_prompt_tokens", "domain", "draft"]


def batchspec(url: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "batchspec.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "BATCHSPEC_REDIS_URL": url})


def wait_job(store: JobStore, job_id: str, timeout: float = 240) -> dict:
    return wait_until(lambda: (j := store.get(job_id))["state"] in TERMINAL and j,
                      timeout, f"job {job_id} to end", 0.2)


def write_rows(path, prompts, max_tokens):
    pq.write_table(pa.table({"id": [f"{os.path.basename(path)[:-8]}{i}"
                                    for i in range(len(prompts))],
                             "prompt": prompts, "max_tokens": max_tokens}), path)
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_draft):
    return ["--model", tiny_llama, "--draft", f"default={tiny_draft}", "--draft", "code=ngram"]


@pytest.fixture(scope="module")
def worker(start_worker):
    return start_worker("main")


@pytest.fixture(scope="module")
def store(redis_server):
    return JobStore(redis_server)


@pytest.fixture(scope="module")
def submitted(worker, redis_server, inputs, models, tmp_path_factory):
    out = tmp_path_factory.mktemp("submitted") / "out"
    r = batchspec(redis_server, "submit", *inputs, "-o", out, *models, "--max-tokens", 6,
                  "--shard-size", 2, "--seed", 3, "--wait")
    assert r.returncode == 0, r.stderr + worker.tail()
    return out, r.stdout.strip().splitlines()[-1]


def test_submit_three_files_with_bad_rows(submitted, redis_server):
    out, job_id = submitted
    status = json.loads(batchspec(redis_server, "status", job_id, "--json").stdout)
    assert status["state"] == "completed_with_errors"
    outputs, errors = read_dir(out, "outputs"), read_dir(out, "errors")
    assert sorted(outputs.column("id").to_pylist()) == sorted(GOOD_IDS)  # each exactly once
    assert dict(zip(errors.column("id").to_pylist(),
                    errors.column("error_type").to_pylist(), strict=True)) == BAD_ROWS
    assert all(m for m in errors.column("message").to_pylist())
    assert (status["requests_completed"], status["requests_failed"]) == (len(outputs), len(errors))
    assert status["requests_total"] == 15
    assert (status["shards_completed"], status["shards_total"]) == (9, 9)
    assert status["tokens_generated"] == sum(outputs.column("num_output_tokens").to_pylist())
    doc = json.loads((out / "_job.json").read_text())
    assert doc["state"] == "completed_with_errors" and (out / "_SUCCESS").exists()
    assert doc["counts"]["requests_completed"] == status["requests_completed"]
    for key in ("created_at", "started_at", "finished_at"):   # as `batchspec run` writes them
        t = doc["timings"][key]
        assert t == iso(dt.datetime.fromisoformat(t)), t
    assert job_id in batchspec(redis_server, "jobs").stdout
    r = batchspec(redis_server, "cancel", job_id)
    assert r.returncode == 1 and "nothing to cancel" in r.stderr


def test_run_and_submit_give_identical_outputs(submitted, inputs, models, tmp_path):
    out, _ = submitted
    result = CliRunner().invoke(cli, ["run", *inputs, "-o", str(tmp_path / "local"), *models,
                                      "--max-tokens", "6", "--shard-size", "2", "--seed", "3"])
    assert result.exit_code == 0, result.output
    local, remote = read_dir(tmp_path / "local", "outputs"), read_dir(out, "outputs")
    assert local.select(SAME).sort_by("id").equals(remote.select(SAME).sort_by("id"))


def test_resubmit_runs_only_missing_shards(submitted, redis_server, inputs, models, store):
    out, _ = submitted
    os.unlink(out / "outputs" / "part-00004.parquet")
    stamps = {p: os.stat(out / "outputs" / p).st_mtime_ns for p in os.listdir(out / "outputs")}
    r = batchspec(redis_server, "submit", *inputs, "-o", out, *models, "--max-tokens", 6,
                  "--shard-size", 2, "--seed", 3, "--wait")
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[-1]
    info = store.shard_info(job_id)
    assert sorted(s for s, i in info.items() if not i.get("skipped")) == ["00004"]
    assert all(os.stat(out / "outputs" / p).st_mtime_ns == t for p, t in stamps.items())
    assert sorted(read_dir(out, "outputs").column("id").to_pylist()) == sorted(GOOD_IDS)
    job = store.get(job_id)
    assert (job["requests_completed"], job["requests_failed"]) == (10, 5)


def test_submit_through_sentinel(worker, redis_sentinel, store, tiny_llama, tmp_path):
    # Client side through Sentinel; the worker is on the same master, by its plain URL.
    path = write_rows(tmp_path / "s.parquet", ["hello", "world"], [3, 3])
    r = batchspec(redis_sentinel, "submit", path, "-o", tmp_path / "out", "--model",
                  tiny_llama, "--wait")
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[-1]
    assert store.get(job_id)["state"] == "completed"
    assert JobStore(redis_sentinel).get(job_id)["requests_completed"] == 2


def child_of(pid: int, parent: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1]) == parent


@pytest.mark.slow
def test_poison_shard_fails_after_max_attempts(worker, redis_server, store, slow_model, tmp_path):
    # Shard 00001 is long; the test kills the process running it every time it starts.
    path = write_rows(tmp_path / "p.parquet", ["one", "two", "three", "four", "five", "six"],
                      [4, 4, 600, 600, 4, 4])
    r = batchspec(redis_server, "submit", path, "-o", tmp_path / "out", "--model", slow_model,
                  "--shard-size", 2, "--max-attempts", 2)
    job_id = r.stdout.strip().splitlines()[-1]

    def running(attempt: int):
        info = store.shard_info(job_id).get("00001", {})
        return info.get("attempt") == attempt and not info.get("outcome") and info

    for attempt in (1, 2):
        info = wait_until(functools.partial(running, attempt), 300, f"attempt {attempt}", 0.02)
        assert child_of(info["pid"], worker.proc.pid)
        os.kill(info["pid"], signal.SIGKILL)
    job = wait_job(store, job_id)
    assert job["state"] == "completed_with_errors", worker.tail()
    assert store.shard_states(job_id) == {"00000": "completed", "00001": "failed",
                                          "00002": "completed"}
    assert store.attempts(job_id, "00001") == 3
    errors = pq.read_table(tmp_path / "out" / "errors" / "part-00001.parquet").to_pylist()
    assert [e["id"] for e in errors] == ["p2", "p3"]
    assert all(e["error_type"] == "shard_failed" and "2 attempts" in e["message"] for e in errors)
    assert sorted(read_dir(tmp_path / "out", "outputs").column("id").to_pylist()) == [
        "p0", "p1", "p4", "p5"]
    assert (job["shards_failed"], job["requests_failed"], job["requests_completed"]) == (1, 2, 4)
    status = json.loads(CliRunner().invoke(cli, ["status", job_id, "--json", "--broker",
                                                 redis_server]).stdout)
    assert status["shards"]["00001"]["state"] == "failed"
    assert "2 attempts" in status["shards"]["00001"]["error"]


def test_shard_that_raises_is_retried_then_failed(worker, redis_server, store, tiny_llama,
                                                  tmp_path):
    check_broken_model_fails_after_retries(redis_server, store, tiny_llama, tmp_path)


def check_broken_model_fails_after_retries(url, store, tiny_llama, tmp_path):
    """A job whose model cannot load on the workers of `url` (a malformed tokenizer.json:
    submit checks the config and the weights' headers, not the tokenizer): its shard is
    retried, then failed, its rows in the errors file."""
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_llama, broken)
    (broken / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": ')
    path = write_rows(tmp_path / "e.parquet", ["a", "b"], [3, 3])
    r = batchspec(url, "submit", path, "-o", tmp_path / "out", "--model", broken,
                  "--max-attempts", 2, "--wait")
    assert r.returncode == 1
    job_id = r.stdout.strip().splitlines()[-1]
    assert store.get(job_id)["state"] == "failed"
    assert store.attempts(job_id, "00000") == 2
    errors = read_dir(tmp_path / "out", "errors").to_pylist()
    assert [(e["id"], e["error_type"]) for e in errors] == [("e0", "shard_failed"),
                                                          ("e1", "shard_failed")]
    assert not (tmp_path / "out" / "_SUCCESS").exists()


@pytest.mark.slow
def test_cancel_stops_the_job(worker, redis_server, store, slow_model, tmp_path):
    path = write_rows(tmp_path / "c.parquet", [f"row {i}" for i in range(8)], [120] * 8)
    out = tmp_path / "out"
    r = batchspec(redis_server, "submit", path, "-o", out, "--model", slow_model,
                  "--shard-size", 1)
    job_id = r.stdout.strip().splitlines()[-1]
    wait_until(lambda: "completed" in store.shard_states(job_id).values(), 120,
               "a first shard to complete", 0.05)
    # a second job into the running job's directory is refused, naming the first
    again = batchspec(redis_server, "submit", path, "-o", out, "--model", slow_model,
                      "--shard-size", 1)
    assert again.returncode == 1 and f"job {job_id} is still running in {out}" in again.stderr
    # Ctrl-C on `submit --wait` stops the waiting, not the job, and says how to follow it
    # (SIGINT as a terminal sends it: a suite started in the background of a non-interactive
    # shell passes SIGINT on ignored, and Python then leaves it so)
    waiting = subprocess.Popen(
        [sys.executable, "-m", "batchspec.cli", "submit", str(path), "-o", str(tmp_path / "o2"),
         "--model", slow_model, "--wait", "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "BATCHSPEC_REDIS_URL": redis_server},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_until(lambda: any(j["output"] == str(tmp_path / "o2") for j in store.recent(5)), 60,
               "the second job to be submitted", 0.1)
    waiting.send_signal(signal.SIGINT)
    _, err = waiting.communicate(timeout=60)
    second = next(j["job_id"] for j in store.recent(5) if j["output"] == str(tmp_path / "o2"))
    assert waiting.returncode == 1 and f"batchspec cancel {second}" in err, err
    assert "Traceback" not in err and store.get(second)["state"] not in TERMINAL
    assert batchspec(redis_server, "cancel", second).returncode == 0
    # cancelled while a shard of it runs, the job is `cancelling` until that shard stops
    # (with none running, between two shards, cancel would end it at once: `cancelled`).
    # The cancel comes as a shard starts, not at any point of one: a shard caught running
    # near its end could finish before the cancel reached Redis.
    running = {s for s, st in store.shard_states(job_id).items() if st == "running"}
    wait_until(lambda: any(st == "running" and s not in running
                           for s, st in store.shard_states(job_id).items()), 60,
               "a shard of the first job to start", 0.01)
    r = CliRunner().invoke(cli, ["cancel", job_id, "--broker", redis_server])
    cancelled_at = dt.datetime.now(dt.UTC)
    assert r.exit_code == 0 and r.stdout.strip() == "cancelling", r.output
    job = wait_job(store, job_id)
    assert job["state"] == "cancelled"
    states, info = store.shard_states(job_id), store.shard_info(job_id)
    done = sorted(s for s, st in states.items() if st == "completed")
    assert done and "cancelled" in states.values() and len(states) == 8
    assert sorted(p[5:10] for p in os.listdir(out / "outputs")) == done
    assert len(read_dir(out, "outputs")) == len(done)  # finished shards stay valid
    for i in info.values():
        if "started_at" in i:
            assert dt.datetime.fromisoformat(i["started_at"]) < cancelled_at
    assert not (out / "_SUCCESS").exists()
    assert json.loads((out / "_job.json").read_text())["state"] == "cancelled"
    r = batchspec(redis_server, "cancel", job_id)  # idempotent
    assert r.returncode == 0 and r.stdout.strip() == "cancelled"


# Ctrl-C as `submit` sends the job's first task, landing in code that Python compiled with
# eval (as the namedtuples of the modules Celery imports at its first send are): without
# SIGINT held while the job is recorded and its tasks sent, the command printed its message
# and Python then ended it by SIGINT (status -2), or a RuntimeError came out with a traceback.
SEND_WITH_CTRL_C = """
import os
import sys
import batchspec.jobs.tasks as tasks
from batchspec.cli import main
send = tasks.run_shard_task.apply_async
sent = []
def apply_async(*args, **kwargs):
    if not sent:
        eval("__import__('os').kill(__import__('os').getpid(), 2)")
        if os.environ.get("CTRL_C_TWICE"):    # the second from the caller's own code
            os.kill(os.getpid(), 2)
    sent.append(args)
    return send(*args, **kwargs)
tasks.run_shard_task.apply_async = apply_async
sys.argv[0] = "batchspec"
main()
"""


@pytest.mark.parametrize("twice", [False, True])
def test_ctrl_c_while_submitting_leaves_the_job_recorded(redis_server, tiny_llama, tmp_path,
                                                         twice):
    """Once: held until the task being sent has gone. Twice: not held any longer (a Redis
    that hangs would hold it for its socket timeouts); the job stays recorded either way."""
    url = redis_server.rsplit("/", 1)[0] + "/12"   # (no worker takes its tasks there)
    path = write_rows(tmp_path / "i.parquet", [f"row {i}" for i in range(3)], [4] * 3)
    out = tmp_path / "out"
    (tmp_path / "send_with_ctrl_c.py").write_text(SEND_WITH_CTRL_C)
    r = subprocess.run(
        [sys.executable, "-m", "send_with_ctrl_c", "submit", path, "-o", str(out),
         "--model", tiny_llama, "--shard-size", "1", "--wait", "-q"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "BATCHSPEC_REDIS_URL": url,
             "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
             **({"CTRL_C_TWICE": "1"} if twice else {})},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    store = JobStore(url)
    job_id = next(j["job_id"] for j in store.recent(20) if j["output"] == str(out))
    sent = [m for m in store.r.lrange("batchspec", 0, -1) if job_id in m]
    try:
        assert r.returncode == 1 and f"batchspec cancel {job_id}" in r.stderr, \
            (r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "Ctrl-C again to stop at once" in r.stderr
        # the job goes on: recorded, its output prepared, the task being sent sent whole
        # (twice: stopped before it); the workers' periodic check sends those not sent
        assert store.get(job_id)["state"] == "queued"
        assert len(sent) == (0 if twice else 1)
    finally:   # (nothing of it left to a later test of this database)
        for m in sent:
            store.r.lrem("batchspec", 0, m)
        assert batchspec(url, "cancel", job_id).returncode == 0


@pytest.mark.slow
def test_beat_schedule_submits_and_completes_a_job(worker, redis_server, store, inputs,
                                                   tiny_llama, tmp_path):
    # The YAML's paths are relative: they resolve against beat's directory, not the
    # worker's (which runs elsewhere; a firing failed there with "matches no files").
    (tmp_path / "jobs").mkdir()
    (tmp_path / "data").mkdir()
    shutil.copy(inputs[0], tmp_path / "data" / "in.parquet")
    (tmp_path / "jobs" / "quick.yaml").write_text(
        "name: beat-quick\nschedule: every 2s\ninputs: [data/in.parquet]\n"
        f"output: out/{{date}}/{{now:%H%M%S%f}}\nmodel: {tiny_llama}\n"
        "max_tokens: 3\nshard_size: 10\n")
    # a firing whose inputs are missing tonight: a failed job that says why
    (tmp_path / "jobs" / "missing.yaml").write_text(
        "name: beat-missing\nschedule: every 2s\ninputs: ['data/{date}/*.parquet']\n"
        f"output: out/missing/{{now:%H%M%S%f}}\nmodel: {tiny_llama}\n")
    assert os.getcwd() != str(tmp_path)
    with open(tmp_path / "beat.log", "wb") as log:
        beat = subprocess.Popen(
            [sys.executable, "-m", "batchspec.cli", "beat", "--jobs", "jobs",
             "--schedule-file", tmp_path / "beat-schedule", "--broker", redis_server],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
        try:
            job = wait_until(lambda: next((j for j in store.recent(20) if j["job_id"]
                                           .startswith("beat-quick") and j["state"] in TERMINAL),
                                          None), 120, "a scheduled job to end", 0.2)
        finally:
            os.killpg(beat.pid, signal.SIGTERM)
            beat.wait(30)
    assert job["state"] == "completed", (tmp_path / "beat.log").read_text()[-2000:]
    missing = wait_until(lambda: next((j for j in store.recent(50) if j["job_id"]
                                       .startswith("beat-missing")), None), 60,
                         "the firing with no inputs to be recorded", 0.2)
    assert missing["state"] == "failed" and "matches no files" in missing["error"]
    assert missing["output"].startswith(f"{tmp_path}/out/missing/")
    status = batchspec(redis_server, "status", missing["job_id"])
    assert status.returncode == 0 and "matches no files" in status.stdout, status.stderr
    out = job["output"]
    assert out.startswith(f"{tmp_path}/out/{dt.datetime.now(dt.UTC).date()}/")
    assert os.path.exists(os.path.join(out, "_SUCCESS"))
    assert len(read_dir(out, "outputs")) == 5
    for j in store.recent(20):  # later firings finish before the module's worker stops
        if j["job_id"].startswith("beat-quick"):
            wait_job(store, j["job_id"])
