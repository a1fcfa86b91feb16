"""The streaming worker (`batchspec worker --stream`): one engine kept full across shard
tasks. Same outputs as `batchspec run`; a kill -9 of its process group with shards in flight
loses and duplicates nothing, and a warm shutdown gives them back at once; a shard whose
model cannot load is retried, then failed; cancel stops it."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from batchspec.cli import cli
from batchspec.jobs.states import FINAL
from batchspec.jobs.store import JobStore
from tests.fixtures_redis import wait_until
from tests.jobdata import read_dir
from tests.test_faults import FAST_LEASES, assert_each_row_once, job_state
from tests.test_jobs_celery import (
    SAME,
    batchspec,
    check_broken_model_fails_after_retries,
    wait_job,
    write_rows,
)

STREAM = {"BATCHSPEC_STREAM": "1", **FAST_LEASES}


@pytest.fixture(scope="module")
def stream_url(redis_server):
    return redis_server.rsplit("/", 1)[0] + "/5"  # own database: only streaming workers


def submit_two_in_flight(url, store, slow_model, path, out) -> str:
    """Submit 8 rows of 100 tokens in shards of 2 and return the job id once two shards
    are in flight at once: the second was handed over while the first generates."""
    stem = path.stem
    write_rows(path, [f"row {i}" for i in range(8)], [100] * 8)
    job_id = batchspec(url, "submit", path, "-o", out, "--model", slow_model,
                       "--shard-size", 2).stdout.strip().splitlines()[-1]
    wait_until(lambda: len(store.running_progress(job_id)) >= 2, 180,
               f"two shards of {stem} in flight", 0.02)
    return job_id


@pytest.mark.slow
def test_streaming_worker_gives_run_outputs(start_worker, stream_url, tiny_llama, tiny_draft,
                                            tmp_path):
    start_worker("stream", url=stream_url, **STREAM)
    store = JobStore(stream_url)
    path = write_rows(tmp_path / "s.parquet", [f"line {i}:" for i in range(24)],
                      [(i * 7) % 13 + 2 for i in range(24)])
    # a fixed k: sampled rows are compared token for token, and with adaptive lengths (a
    # job's default) which sample a seed gives depends on the lengths chosen
    opts = ["--model", tiny_llama, "--draft", f"default={tiny_draft}", "--shard-size", "4",
            "--seed", "5", "--temperature", "0.8", "--fixed-k"]
    r = batchspec(stream_url, "submit", path, "-o", tmp_path / "sub", *opts, "--wait")
    assert r.returncode == 0, r.stderr
    job = store.get(r.stdout.strip().splitlines()[-1])
    assert (job["state"], job["shards_completed"], job["requests_completed"]) == (
        "completed", 6, 24)
    result = CliRunner().invoke(cli, ["run", path, "-o", str(tmp_path / "run"), *opts])
    assert result.exit_code == 0, result.output
    local, remote = read_dir(tmp_path / "run", "outputs"), read_dir(tmp_path / "sub", "outputs")
    assert local.select(SAME).sort_by("id").equals(remote.select(SAME).sort_by("id"))


@pytest.mark.slow
def test_kill_9_of_a_streaming_worker(start_worker, stream_url, slow_model, tmp_path):
    store = JobStore(stream_url)
    victim = start_worker("stream-victim", url=stream_url, **STREAM)
    out = tmp_path / "out"
    job_id = submit_two_in_flight(stream_url, store, slow_model, tmp_path / "k.parquet", out)
    victim.kill()
    start_worker("stream-rescuer", url=stream_url, **STREAM)
    wait_until(lambda: job_state(store, job_id) in FINAL, 300, "the job to end", 0.2)
    assert store.get(job_id)["state"] == "completed"
    assert_each_row_once(out, [f"k{i}" for i in range(8)])
    # Shards in flight at the kill ran again, or were recorded from their outputs file (a
    # shard written just before the kill, its end not yet recorded); none ran a third time.
    attempts, info = {s: store.attempts(job_id, s) for s in store.shard_states(job_id)}, \
        store.shard_info(job_id)
    assert any(n == 2 or info[s].get("recovered") for s, n in attempts.items()), attempts
    assert max(attempts.values()) <= 2, attempts


@pytest.mark.slow
def test_cancel_stops_a_streaming_worker(start_worker, stream_url, slow_model, tmp_path):
    start_worker("stream-cancel", url=stream_url, **STREAM)
    store = JobStore(stream_url)
    path = write_rows(tmp_path / "c.parquet", [f"row {i}" for i in range(8)], [100] * 8)
    out = tmp_path / "out"
    job_id = batchspec(stream_url, "submit", path, "-o", out, "--model", slow_model,
                       "--shard-size", 1).stdout.strip().splitlines()[-1]
    wait_until(lambda: store.running_progress(job_id), 180, "a shard generating", 0.05)
    assert batchspec(stream_url, "cancel", job_id).returncode == 0
    job = wait_job(store, job_id)
    assert job["state"] == "cancelled"
    states = store.shard_states(job_id)
    assert "cancelled" in states.values() and len(states) == 8
    done = sorted(s for s, st in states.items() if st == "completed")
    written = sorted(p.name[5:10] for p in (out / "outputs").iterdir()) \
        if (out / "outputs").exists() else []
    assert written == done


@pytest.mark.slow
def test_warm_shutdown_of_a_streaming_worker_gives_its_shards_back(start_worker, redis_server,
                                                                   slow_model, tmp_path):
    url = redis_server.rsplit("/", 1)[0] + "/6"  # own database: only these workers
    store = JobStore(url)
    stopped = start_worker("stream-stopped", url=url, BATCHSPEC_STREAM="1")  # leases: 30 s
    out = tmp_path / "out"
    job_id = submit_two_in_flight(url, store, slow_model, tmp_path / "w.parquet", out)
    stopped.stop()  # SIGTERM to the process group: Celery's warm shutdown
    # Given back (queued, sent again) as the process ended, not left to their leases.
    states = store.shard_states(job_id)
    assert "running" not in states.values(), states
    assert "queued" in states.values(), states
    start_worker("stream-after", url=url, BATCHSPEC_STREAM="1")
    assert wait_job(store, job_id)["state"] == "completed"
    assert_each_row_once(out, [f"w{i}" for i in range(8)])


def test_a_shard_the_stream_cannot_load_is_retried_then_failed(start_worker, redis_server,
                                                              tiny_llama, tmp_path):
    url = redis_server.rsplit("/", 1)[0] + "/7"  # own database: only this worker
    start_worker("stream-broken", url=url, **STREAM)
    check_broken_model_fails_after_retries(url, JobStore(url), tiny_llama, tmp_path)
