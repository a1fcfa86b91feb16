"""Jobs finish through real faults (docs/operations.md, "Faults"): a kill -9 of a whole
worker process group mid-shard, and a Redis SIGKILL + restart with AOF mid-job. Real
redis-server, real `batchspec worker` processes; the lease settings are shortened only
through their documented environment variables."""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import redis

from batchspec.jobs.states import FINAL
from batchspec.jobs.store import JobStore
from tests.fixtures_redis import RedisServer, wait_until
from tests.jobdata import read_dir
from tests.test_jobs_celery import batchspec, write_rows

# Leases of a few seconds instead of 30: the same code paths, a shorter wait.
FAST_LEASES = {"BATCHSPEC_LEASE_TTL": "3", "BATCHSPEC_LEASE_RENEW": "0.5",
               "BATCHSPEC_CHECK_INTERVAL": "1"}


def job_state(store: JobStore, job_id: str) -> str | None:
    try:
        return (store.get(job_id) or {}).get("state")
    except redis.ConnectionError:  # Redis restarting
        return None


def assert_each_row_once(out, ids: list[str]):
    got = read_dir(out, "outputs").column("id").to_pylist()
    dup = [i for i, n in collections.Counter(got).items() if n > 1]
    assert not dup, f"rows written twice: {dup}"
    assert sorted(got) == sorted(ids), f"rows lost: {sorted(set(ids) - set(got))}"


def submit_waiting(url: str, store: JobStore, tmp_path, slow_model, n: int, tokens: int):
    """`submit --wait` of n rows of `tokens` tokens in 2-row shards on the slow model, in the
    background: (the process, the job's id, its output dir)."""
    path = write_rows(tmp_path / "r.parquet", [f"row {i}" for i in range(n)], [tokens] * n)
    out = tmp_path / "out"
    waiting = subprocess.Popen(
        [sys.executable, "-m", "batchspec.cli", "submit", path, "-o", str(out), "--model",
         slow_model, "--shard-size", "2", "--wait", "-q", "--broker", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_id = wait_until(lambda: [j["job_id"] for j in store.recent(1)], 60, "the job")[0]
    except BaseException:
        waiting.kill()
        raise
    return waiting, job_id, out


def job_with_a_shard_on(store: JobStore, url: str, worker, name: str, slow_model, tmp_path):
    """Submit an 8-row job of 2-row shards (four rows of 150 tokens) on the slow model and
    wait until `worker` generates one of its shards: (job id, that shard, output dir)."""
    path = write_rows(tmp_path / f"{name}.parquet", [f"row {i}" for i in range(8)],
                      [150, 150, 150, 150, 8, 8, 8, 8])
    out = tmp_path / "out"
    job_id = batchspec(url, "submit", path, "-o", out, "--model", slow_model,
                       "--shard-size", 2).stdout.strip().splitlines()[-1]

    def generating():
        info = store.shard_info(job_id)
        return next((s for s in store.running_progress(job_id)
                     if info.get(s, {}).get("pid") in worker.pids()), None)
    shard = wait_until(generating, 180, f"{worker.name} to be generating a shard", 0.02)
    return job_id, shard, out


@pytest.mark.slow
def test_kill_9_of_a_worker_group_mid_shard(start_worker, redis_server, slow_model, tmp_path):
    url = redis_server.rsplit("/", 1)[0] + "/2"  # own database: only these two workers
    store = JobStore(url)
    victim = start_worker("victim", url=url, **FAST_LEASES)
    rescuer = start_worker("rescuer", url=url, **FAST_LEASES)
    job_id, shard, out = job_with_a_shard_on(store, url, victim, "k", slow_model, tmp_path)
    victim.kill()
    assert not (out / "outputs" / f"part-{shard}.parquet").exists()
    # The rescuer's periodic check sees the victim's lease expire and re-queues the shard.
    wait_until(lambda: job_state(store, job_id) in FINAL, 300, "the job to end", 0.2)
    job = store.get(job_id)
    assert job["state"] == "completed", rescuer.tail()
    assert_each_row_once(out, [f"k{i}" for i in range(8)])
    assert store.attempts(job_id, shard) == 2
    assert store.shard_info(job_id)[shard]["requeued_at"]
    assert (out / "_SUCCESS").exists()
    assert (job["requests_completed"], job["shards_completed"]) == (8, 4)


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["0", "1"])
def test_a_frozen_worker_waking_after_its_shard_ran_elsewhere_changes_nothing(
        start_worker, redis_server, slow_model, tmp_path, stream):
    """A worker host frozen past its lease (SIGSTOP to its whole process group: a paused VM,
    a host swapping): its shard is re-queued and run by another worker, and the job ends.
    When the frozen worker wakes (SIGCONT), its stale run changes nothing: each row once,
    the record's counts and OUT/_job.json as they were, and no shard shown in progress."""
    from batchspec.jobs.store import COUNTERS
    url = redis_server.rsplit("/", 1)[0] + "/11"  # own database: only these two workers
    store = JobStore(url)
    store.r.flushdb()
    victim = start_worker(f"frozen{stream}", url=url, BATCHSPEC_STREAM=stream, **FAST_LEASES)
    awake = start_worker(f"awake{stream}", url=url, BATCHSPEC_STREAM=stream, **FAST_LEASES)
    job_id, _, out = job_with_a_shard_on(store, url, victim, "f", slow_model, tmp_path)
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: job_state(store, job_id) in FINAL, 300, "the job to end", 0.2)
        before, summary = store.get(job_id), (out / "_job.json").read_text()
    finally:
        os.killpg(victim.proc.pid, signal.SIGCONT)
    wait_until(lambda: "no longer held" in victim.tail(20000), 60,
               "the woken worker to find its lease gone", 0.1)
    time.sleep(3)     # (what its stale run still writes, if anything)
    after = store.get(job_id)
    assert before["state"] == after["state"] == "completed", victim.tail()
    assert {c: after[c] for c in COUNTERS} == {c: before[c] for c in COUNTERS}
    assert store.running_progress(job_id) == {} and after["requests_in_progress"] == 0
    assert (out / "_job.json").read_text() == summary
    assert_each_row_once(out, [f"f{i}" for i in range(8)])
    victim.stop()     # (the module's next tests share database 11's queue with none)
    awake.stop()


@pytest.mark.slow
@pytest.mark.parametrize("outage_s", [2])
def test_redis_sigkill_and_restart_mid_job(start_worker, tmp_path, slow_model, outage_s):
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    waiting = None
    try:
        worker = start_worker("through-restart", url=server.url, **FAST_LEASES)
        store = JobStore(server.url, retry_s=30)
        n = 12
        # `submit --wait` follows the job through the restart.
        waiting, job_id, out = submit_waiting(server.url, store, tmp_path, slow_model, n, 40)
        wait_until(lambda: "completed" in store.shard_states(job_id).values()
                   and store.running_progress(job_id), 240, "a shard done, one generating",
                   0.02)
        server.kill()
        time.sleep(outage_s)
        server.start()
        stdout, stderr = waiting.communicate(timeout=300)
        assert waiting.returncode == 0, stderr + worker.tail()
        assert stdout.strip().splitlines()[-1] == job_id and "completed" in stderr
        assert store.get(job_id)["state"] == "completed", worker.tail()
        assert (out / "_SUCCESS").exists()
        assert_each_row_once(out, [f"r{i}" for i in range(n)])
        doc = json.loads((out / "_job.json").read_text())
        assert doc["state"] == "completed" and doc["counts"]["requests_completed"] == n
    finally:
        if waiting is not None and waiting.poll() is None:
            waiting.kill()
        server.stop()


def test_a_shard_runs_under_one_lease(redis_server, tmp_path):
    """Start, duplicate delivery, expiry and the race between two noticers, on real Redis."""
    from batchspec.jobs.shards import Shard
    store = JobStore(redis_server.rsplit("/", 1)[0] + "/4")
    shard = Shard(0, str(tmp_path / "x.parquet"), "x", 0, 2)
    store.create("lease-job", {"output": str(tmp_path / "out")}, [shard])
    assert store.start_attempt("lease-job", "00000", "w1", ttl_s=30) == 1
    assert store.start_attempt("lease-job", "00000", "w2", ttl_s=30) == -1  # duplicate
    assert store.requeue("lease-job", "00000") is False  # lease alive
    assert store.renew_lease("lease-job", "00000", "w1", 0.2)
    assert not store.renew_lease("lease-job", "00000", "w2", 30)
    wait_until(lambda: not store.lease_holder("lease-job", "00000"), 10, "the lease to expire")
    assert [store.requeue("lease-job", "00000") for _ in range(2)] == [True, False]
    assert store.shard_states("lease-job") == {"00000": "queued"}
    assert not store.renew_lease("lease-job", "00000", "w1", 30)  # w1 lost it
    assert store.start_attempt("lease-job", "00000", "w2", ttl_s=30) == 2
    assert store.finish_shard("lease-job", "00000", "completed", 2) == 1
    assert store.lease_holder("lease-job", "00000") is None
    assert store.start_attempt("lease-job", "00000", "w3", ttl_s=30) == -2  # ended


def test_a_shard_ending_after_redis_lost_the_job_leaves_no_record(redis_server, tmp_path):
    """A Redis that lost a job's record (restarted without persistence) while a shard ran:
    the shard's end writes nothing (it used to leave a record of counters alone, no state,
    no output and no TTL, on which `status` failed), and a partial record left by an older
    version says to submit the job again."""
    from batchspec.jobs.shards import Shard
    url = redis_server.rsplit("/", 1)[0] + "/5"
    store = JobStore(url)
    shard = Shard(0, str(tmp_path / "x.parquet"), "x", 0, 2)
    store.create("lost-job", {"output": str(tmp_path / "out")}, [shard])
    assert store.start_attempt("lost-job", "00000", "w1", ttl_s=30) == 1
    store.r.flushdb()
    store.update_info("lost-job", "00000", outcome="completed")
    assert store.finish_shard("lost-job", "00000", "completed", 2, 0, 10) == -2
    assert store.r.keys("*") == []
    store.r.hset("batchspec:job:lost-job", mapping={"tokens_generated": 10})
    r = subprocess.run([sys.executable, "-m", "batchspec.cli", "status", "lost-job",
                        "--broker", url], capture_output=True, text=True)
    assert r.returncode == 1 and "submit the job again" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_throughput_counts_the_shards_that_ran(redis_server, tmp_path):
    """Shards found done (a resumed job's) count in the job's rows and tokens, not in its
    throughput: a resume that ran one shard of six reported 5.8x its tokens/s."""
    from batchspec.jobs.shards import Shard
    store = JobStore(redis_server.rsplit("/", 1)[0] + "/6")
    shards = [Shard(i, str(tmp_path / "x.parquet"), "x", 2 * i, 2) for i in range(2)]
    store.create("resumed", {"output": str(tmp_path / "out")}, shards)
    store.set_fields("resumed", started_at="2026-12-01T03:00:00+00:00",
                     finished_at="2026-12-01T03:00:10+00:00")
    store.finish_shard("resumed", "00000", "completed", 2, 0, 500, ran=False)
    store.finish_shard("resumed", "00001", "completed", 2, 0, 100)
    job = store.get("resumed")
    assert job["requests_completed"] == 4 and job["tokens_generated"] == 600
    assert job["tokens_per_s"] == 10.0 and job["requests_per_s"] == 0.2


def test_a_slow_step_keeps_its_lease(redis_server, tmp_path):
    """The lease is renewed from a thread: a step far longer than the TTL (here the main
    thread sleeping) never lets the shard look dead to reconcile()."""
    from batchspec.jobs.celery_app import use_broker
    from batchspec.jobs.lease import Lease
    from batchspec.jobs.shards import Shard
    from batchspec.jobs.tasks import reconcile
    url = redis_server.rsplit("/", 1)[0] + "/4"
    use_broker(url)  # reconcile() re-sends the shard's task there
    store = JobStore(url)
    shard = Shard(0, str(tmp_path / "x.parquet"), "x", 0, 2)
    store.create("slow-step", {"output": str(tmp_path / "out")}, [shard])
    assert store.start_attempt("slow-step", "00000", "w1", ttl_s=1) == 1
    with Lease(store, "slow-step", "00000", "w1", ttl=1, renew=0.2) as lease:
        for _ in range(4):
            time.sleep(1.0)  # one "engine step" of a whole TTL
            reconcile("slow-step", store)
            assert store.shard_states("slow-step") == {"00000": "running"}
        assert not lease.lost
    wait_until(lambda: not store.lease_holder("slow-step", "00000"), 10, "expiry")
    reconcile("slow-step", store)
    assert store.shard_states("slow-step") == {"00000": "queued"}
    assert store.r.llen("batchspec") == 1  # its task, sent once


@pytest.mark.slow
def test_lost_task_messages_are_sent_again(start_worker, redis_server, tiny_llama, tmp_path):
    """Queued shards whose task messages are gone (as after a Redis restart that lost the
    last second) are sent again by a worker's periodic check."""
    url = redis_server.rsplit("/", 1)[0] + "/3"
    store = JobStore(url)
    path = write_rows(tmp_path / "m.parquet", [f"row {i}" for i in range(4)], [3] * 4)
    out = tmp_path / "out"
    job_id = batchspec(url, "submit", path, "-o", out, "--model", tiny_llama,
                       "--shard-size", 2).stdout.strip().splitlines()[-1]
    assert store.r.delete("batchspec") == 1  # the queue, with both messages
    start_worker("finder", url=url, **FAST_LEASES)
    wait_until(lambda: job_state(store, job_id) in FINAL, 120, "the job to end", 0.2)
    assert store.get(job_id)["state"] == "completed"
    assert_each_row_once(out, [f"m{i}" for i in range(4)])


def test_a_firing_into_a_running_jobs_directory_is_refused(redis_server, tiny_llama,
                                                          tmp_path):
    """A beat firing whose output directory holds a job still running (last night's, say,
    where the YAML's output has no date in it) is not submitted: two jobs in one directory
    would run its shards twice over. It is recorded as a failed job naming the running one,
    as `submit` refuses it, and nothing is queued or written."""
    from batchspec.jobs.celery_app import use_broker
    from batchspec.jobs.shards import Shard
    from batchspec.jobs.tasks import submit_scheduled
    url = redis_server.rsplit("/", 1)[0] + "/8"  # own database: nothing else queues here
    use_broker(url)
    store = JobStore(url)
    store.r.flushdb()
    write_rows(tmp_path / "in.parquet", ["a", "b"], [3, 3])
    out = tmp_path / "out"
    store.create("nightly-last", {"output": str(out)},
                 [Shard(0, str(tmp_path / "in.parquet"), "in", 0, 2)])
    (tmp_path / "nightly.yaml").write_text(
        f"name: nightly\ninputs: [in.parquet]\noutput: out\nmodel: {tiny_llama}\n")
    job_id = submit_scheduled(str(tmp_path / "nightly.yaml"), str(tmp_path))
    job = store.get(job_id)
    assert job["state"] == "failed" and job["output"] == str(out)
    assert f"job nightly-last is still running in {out}" in job["error"]
    assert not out.exists()
    # once that job has ended, the next firing is submitted
    store.set_final("nightly-last", state="completed")
    job_id = submit_scheduled(str(tmp_path / "nightly.yaml"), str(tmp_path))
    assert store.get(job_id)["state"] == "queued"


def test_two_jobs_into_one_directory_at_once_run_as_one(redis_server, tmp_path):
    """The busy-output check and the job's record are one transaction: of jobs recorded
    into one output directory at the same instant (each past its early check, as two
    submits or a submit and a firing can be), exactly one is recorded, and each other
    is refused with the message naming it; a directory whose job has ended takes a new
    one."""
    import threading

    from batchspec.jobs.shards import Shard
    from batchspec.jobs.store import OutputBusy
    url = redis_server.rsplit("/", 1)[0] + "/9"  # own database
    JobStore(url).r.flushdb()
    out = str(tmp_path / "out")
    shard = Shard(0, str(tmp_path / "in.parquet"), "in", 0, 2)
    stores = [JobStore(url) for _ in range(8)]
    assert all(store.running_in(out) is None for store in stores)   # the early check
    start, outcome = threading.Barrier(len(stores)), {}

    def record(i):
        start.wait()
        try:
            stores[i].create(f"job-{i}", {"output": out}, [shard])
            outcome[i] = "recorded"
        except OutputBusy as e:
            outcome[i] = str(e)

    threads = [threading.Thread(target=record, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recorded = [i for i, v in outcome.items() if v == "recorded"]
    assert len(recorded) == 1, outcome
    winner = f"job-{recorded[0]}"
    assert stores[0].active_jobs() == [winner]
    for i, v in outcome.items():
        if i != recorded[0]:
            assert v.startswith(f"job {winner} is still running in {out}")
            assert not stores[0].exists(f"job-{i}")
    # another directory is free meanwhile, and this one once its job has ended
    stores[0].create("elsewhere", {"output": str(tmp_path / "other")}, [shard])
    stores[0].set_final(winner, state="completed")
    stores[1].create("next", {"output": out}, [shard])
    assert stores[0].running_in(out) == "next"


def test_overwrite_that_loses_the_directory_clears_nothing(redis_server, tmp_path, tiny_llama):
    """`submit --overwrite` clears the output directory only once its job holds it: a submit
    past its early check that then finds another job recorded there (started in between) is
    refused with nothing removed. Cleared first, it took the running job's outputs with it."""
    from batchspec.jobs.celery_app import use_broker
    from batchspec.jobs.shards import Shard
    from batchspec.jobs.spec import JobSpec
    from batchspec.jobs.store import OutputBusy
    from batchspec.jobs.tasks import submit_job
    url = redis_server.rsplit("/", 1)[0] + "/10"  # own database
    store = JobStore(url)
    store.r.flushdb()
    use_broker(url)
    out = tmp_path / "out"
    inputs = write_rows(tmp_path / "in.parquet", ["a b c", "d e f"], [4, 4])
    running = [out / "outputs" / "part-00000.parquet", out / "_plan.json"]
    for path in running:      # what the job running there has written so far
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"written by the running job")
    store.create("running", {"output": str(out)}, [Shard(0, inputs, "in", 0, 2)])
    spec = JobSpec(inputs=inputs, output=str(out), model=tiny_llama, max_tokens=4)
    with pytest.raises(OutputBusy, match="job running is still running in"):
        submit_job(spec, overwrite=True)
    assert all(path.read_bytes() == b"written by the running job" for path in running)
    assert store.active_jobs() == ["running"] and not store.exists(spec.job_id)
    # once that job has ended, the directory is cleared for the new one and recorded
    store.set_final("running", state="failed")
    job_id = submit_job(spec, overwrite=True)
    assert store.active_jobs() == [job_id]
    assert not running[0].exists()
    assert json.loads(running[1].read_text())["shards"]


def test_a_worker_whose_lease_went_to_another_writes_no_files(redis_server, tmp_path,
                                                              tiny_llama):
    """The files of a shard are written only by its lease holder, asked of Redis as they
    are due: a worker whose lease expired and went to another worker while it ran (a
    frozen host woken before its next renewal noticed) ends the shard aborted with nothing
    written, where it used to write over the files of the worker that holds the shard."""
    from batchspec import LLM
    from batchspec.jobs.lease import Lease
    from batchspec.jobs.runner import plan_job, run_shard
    from batchspec.jobs.spec import JobSpec
    url = redis_server.rsplit("/", 1)[0] + "/12"  # own database
    store = JobStore(url)
    store.r.flushdb()
    inputs = write_rows(tmp_path / "in.parquet", ["a b c", "d e f"], [4, 4])
    out = tmp_path / "out"
    spec = JobSpec(inputs=inputs, output=str(out), model=tiny_llama, max_tokens=4)
    shard = plan_job(spec)[0]
    store.create("j", spec.to_dict(), [shard])
    llm = LLM(tiny_llama, device="cpu")
    assert store.start_attempt("j", shard.id, "frozen", 0.2) == 1
    lease = Lease(store, "j", shard.id, "frozen", 0.2, 30)   # (its renewals: not started)
    time.sleep(0.3)                        # its lease expires; another worker takes over
    assert store.requeue("j", shard.id) and store.start_attempt("j", shard.id, "awake") == 2
    result = run_shard(spec, shard, llm, job_id="j", may_write=lease.held)
    assert result.status == "aborted" and lease.lost
    assert not (out / "outputs").exists() and not (out / "acceptance").exists()
    # the lease holder writes them
    held = Lease(store, "j", shard.id, "awake", 30, 10)
    assert run_shard(spec, shard, llm, job_id="j", may_write=held.held).status == "done"
    assert sorted(read_dir(out, "outputs").column("id").to_pylist()) == ["in0", "in1"]


def test_wait_says_what_to_do_when_redis_loses_the_job(redis_server, tmp_path, tiny_llama):
    """`submit --wait` following a job whose record Redis loses (a restart without
    persistence, a flush) ends with one line saying so and how to finish the job, exit 1,
    no traceback."""
    url = redis_server.rsplit("/", 1)[0] + "/13"  # own database: no worker serves it
    store = JobStore(url)
    store.r.flushdb()
    path = write_rows(tmp_path / "w.parquet", ["a b c", "d e f"], [4, 4])
    out = tmp_path / "out"
    waiting = subprocess.Popen(
        [sys.executable, "-m", "batchspec.cli", "submit", path, "-o", str(out), "--model",
         tiny_llama, "--wait", "-q", "--broker", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_id = wait_until(lambda: [j["job_id"] for j in store.recent(1)], 60, "the job")[0]
        store.r.flushdb()
        _, stderr = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 1 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"Error: job {job_id}'s record is gone from Redis (restarted without persistence, or "
        f"flushed?); the shards it finished stay in {out}: submit the job again with the "
        f"same inputs and -o to run the rest")


def test_a_job_without_a_summary_ends_with_alpha_from_its_files(redis_server, tmp_path,
                                                                tiny_llama, tiny_draft):
    """A job whose `_job.json` could not be written (a full disk) has no summary in its
    record: `submit --wait` ends with the α of its acceptance files, as `status` shows it,
    where it said 'n/a (nothing drafted)'."""
    from batchspec.jobs.commands import _alpha_so_far, _summary_so_far
    from batchspec.jobs.display import ending_of_record
    from batchspec.jobs.runner import plan_job, run_local
    from batchspec.jobs.spec import JobSpec
    url = redis_server.rsplit("/", 1)[0] + "/14"  # own database
    store = JobStore(url)
    store.r.flushdb()
    inputs = write_rows(tmp_path / "in.parquet", [f"a b c {i}" for i in range(6)], [8] * 6)
    spec = JobSpec(inputs=inputs, output=str(tmp_path / "out"), model=tiny_llama,
                   drafts={"default": tiny_draft}, max_tokens=8, adaptive_k=False)
    doc = run_local(spec, progress=False)
    assert doc["summary"]["total_drafted"]
    store.create("j", spec.to_dict(), plan_job(spec))
    store.set_final("j", state="failed", error="could not write _job.json: OSError")
    job = store.get("j")
    assert "summary" not in job
    alpha = _alpha_so_far(store, job)
    assert alpha == doc["summary"]["acceptance_rate"]
    job["summary"] = _summary_so_far(store, job)
    assert f"acceptance rate α {alpha:.3f} (" in ending_of_record(job)


def test_cancelling_a_job_no_worker_runs_ends_it(redis_server, tmp_path, tiny_llama):
    """`batchspec cancel` of a job whose shards no worker runs (its workers gone, or all
    busy elsewhere) ends them cancelled at once and the job with them, where it stayed
    `cancelling` until a worker took each shard's task; a running shard whose worker died
    ends cancelled once its lease expires, at the next check, not re-queued."""
    url = redis_server.rsplit("/", 1)[0] + "/15"  # own database: no worker serves it
    store = JobStore(url)
    store.r.flushdb()
    path = write_rows(tmp_path / "c.parquet", [f"row {i}" for i in range(4)], [4] * 4)
    out = tmp_path / "out"
    job_id = batchspec(url, "submit", path, "-o", out, "--model", tiny_llama,
                       "--shard-size", 1).stdout.strip().splitlines()[-1]
    shards = sorted(store.shard_states(job_id))
    # one shard was taken by a worker that then died: its lease (3 s) expires unrenewed
    assert store.start_attempt(job_id, shards[0], "dead-worker", 3) == 1
    r = batchspec(url, "cancel", job_id)
    assert r.returncode == 0 and r.stdout.strip() == "cancelling", r.stderr
    assert sorted(st for st in store.shard_states(job_id).values()) == \
        ["cancelled", "cancelled", "cancelled", "running"]
    wait_until(lambda: not store.leases_alive(job_id, shards[:1])[shards[0]], 10,
               "the dead worker's lease to expire", 0.1)
    r = batchspec(url, "status", job_id)
    assert r.returncode == 0 and store.get(job_id)["state"] == "cancelled", r.stdout
    assert set(store.shard_states(job_id).values()) == {"cancelled"}
    assert json.loads((out / "_job.json").read_text())["state"] == "cancelled"
    assert not store.active_jobs()
    r = batchspec(url, "cancel", job_id)
    assert r.returncode == 0 and r.stdout.strip() == "cancelled"


def test_a_finalizer_that_died_is_replaced(redis_server, tmp_path, tiny_llama):
    """A job whose every shard has ended but whose finalizer died (its worker killed while
    writing `_job.json`) stays `finalizing` while that claim is fresh; once it is 60 s old,
    the next check (here `batchspec status`) finalizes the job from its files."""
    from batchspec.jobs.runner import plan_job, run_local
    from batchspec.jobs.spec import JobSpec
    url = redis_server.rsplit("/", 1)[0] + "/14"  # own database
    store = JobStore(url)
    store.r.flushdb()
    inputs = write_rows(tmp_path / "in.parquet", [f"a b {i}" for i in range(4)], [4] * 4)
    out = tmp_path / "out"
    spec = JobSpec(inputs=inputs, output=str(out), model=tiny_llama, max_tokens=4,
                   shard_size=2)
    run_local(spec, progress=False)                 # the shards' files, as workers wrote them
    (out / "_job.json").unlink()
    (out / "_SUCCESS").unlink()
    shards = plan_job(spec)
    store.create("j", spec.to_dict(), shards)
    ended = [store.start_attempt("j", s.id, f"w{s.id}") and
             store.finish_shard("j", s.id, "completed", 2, 0, 8) for s in shards]
    assert ended == [0, 1] and store.get("j")["state"] == "finalizing"   # ... then it died
    assert batchspec(url, "status", "j").returncode == 0
    assert store.get("j")["state"] == "finalizing" and not (out / "_job.json").exists()
    store.set_fields("j", finalizing_since=store.now().timestamp() - 61)
    assert batchspec(url, "status", "j").returncode == 0
    assert store.get("j")["state"] == "completed" and (out / "_SUCCESS").exists()
    assert json.loads((out / "_job.json").read_text())["counts"]["requests_completed"] == 4


def test_beat_removes_a_damaged_schedule_file_in_one_line(redis_server, tmp_path):
    """A schedule file left damaged (beat killed while writing it) is removed with one line
    on stderr and beat starts; no traceback (Celery removes it too, logging one)."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "n.yaml").write_text(
        "name: n\nschedule: every 1h\ninputs: [in/*.parquet]\noutput: out/{date}\n")
    (tmp_path / "celerybeat-schedule").write_bytes(bytes(range(256)) * 12)
    log = tmp_path / "beat.log"
    with open(log, "wb") as f:
        beat = subprocess.Popen([sys.executable, "-m", "batchspec.cli", "beat", "--broker",
                                 redis_server.rsplit("/", 1)[0] + "/15"], cwd=tmp_path,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: b"beat: Starting" in log.read_bytes(), 60, "beat to start", 0.1)
    finally:
        os.killpg(beat.pid, signal.SIGTERM)
        beat.wait(30)
    text = log.read_text()
    assert "the schedule file celerybeat-schedule was damaged (ValueError: not a database " \
           "file); removed: each schedule's next run counts from now" in text
    assert "Traceback" not in text and "corrupted" not in text


@pytest.mark.parametrize("refusal", ["full", "replica", "clients"])
def test_a_redis_that_refuses_writes_fails_submit_in_one_line(redis_server, tmp_path,
                                                               tiny_llama, refusal):
    """A Redis at its maxmemory (noeviction, as docs/operations.md recommends), a read-only
    replica, or one at its maxclients refuses the job's record (or the connection): `submit`
    says which in one line and what to do, exit 1, and writes nothing to OUT. At maxclients
    it used to say Redis could not be reached and to start redis-server."""
    url = redis_server.rsplit("/", 1)[0] + "/13"
    client = redis.Redis.from_url(url)
    path = write_rows(tmp_path / "m.parquet", ["a b c"], [4])
    out = tmp_path / "out"
    old = client.config_get("maxmemory")["maxmemory"]
    old_clients = client.config_get("maxclients")["maxclients"]
    if refusal == "full":
        client.config_set("maxmemory", 1)          # every write now exceeds it
    elif refusal == "replica":
        client.execute_command("REPLICAOF", "127.0.0.1", "1")   # a master never reached
    else:                                          # no connection beyond those open now
        client.config_set("maxclients", len(client.client_list()))
    try:
        r = batchspec(url, "submit", path, "-o", out, "--model", tiny_llama)
    finally:
        client.config_set("maxclients", old_clients)
        client.config_set("maxmemory", old)
        client.execute_command("REPLICAOF", "NO", "ONE")
    line = {"full": f"Error: Redis at {url} is full (used memory > maxmemory) and refuses "
                    f"writes",
            "replica": f"Error: Redis at {url} is a read-only replica: point --broker",
            "clients": f"Error: Redis at {url} has as many clients as its maxclients allows "
                       f"and refuses more: raise its maxclients"}[refusal]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert any(ln.startswith(line) for ln in r.stderr.splitlines()), r.stderr
    assert not out.exists(), r.stderr


def test_a_submit_killed_while_preparing_its_directory_ends_failed(redis_server, tmp_path,
                                                                   tiny_llama):
    """A job is recorded before its output directory is cleared (`--overwrite`) and claimed,
    and stays `preparing` until then: no check sends its shards' tasks, which would run on
    the old job's files. One whose submit was killed in between ends failed after
    PREPARE_TIMEOUT_S, with the old files untouched and the directory free again; a submit
    that finishes leaves no trace of it."""
    from batchspec.jobs.celery_app import QUEUE
    from batchspec.jobs.runner import plan_job
    from batchspec.jobs.spec import JobSpec
    from batchspec.jobs.tasks import PREPARE_TIMEOUT_S
    url = redis_server.rsplit("/", 1)[0] + "/14"  # own database: no worker serves it
    store = JobStore(url)
    store.r.flushdb()
    inputs = write_rows(tmp_path / "in.parquet", ["a b c", "d e f"], [4, 4])
    out = tmp_path / "out"
    (out / "outputs").mkdir(parents=True)
    old = out / "outputs" / "part-00000.parquet"
    old.write_bytes(b"the old job's outputs")
    spec = JobSpec(inputs=inputs, output=str(out), model=tiny_llama, max_tokens=4)
    # what a `submit --overwrite` killed right after recording its job leaves
    store.create("killed", spec.to_dict(), plan_job(spec), preparing=True)
    # checks a check interval apart, each of which would send the tasks no message carries
    checks = subprocess.run(
        [sys.executable, "-c", "import sys, time\nfrom batchspec.jobs.tasks import reconcile\n"
         "for _ in range(3):\n    print(reconcile('killed'))\n    time.sleep(0.05)"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "BATCHSPEC_REDIS_URL": url, "BATCHSPEC_CHECK_INTERVAL": "0.01"})
    assert checks.stdout.split() == ["queued"] * 3, checks.stderr
    assert store.r.llen(QUEUE) == 0
    store.r.hset("batchspec:job:killed", "preparing_since",
                 store.now().timestamp() - PREPARE_TIMEOUT_S - 1)
    r = batchspec(url, "status", "killed")
    assert r.returncode == 0 and store.get("killed")["state"] == "failed", r.stdout
    assert "its submit stopped before the output directory was ready" in r.stdout
    assert store.r.llen(QUEUE) == 0 and not store.active_jobs()
    assert old.read_bytes() == b"the old job's outputs"
    # the same submit, finished this time
    r = batchspec(url, "submit", inputs, "-o", out, "--model", tiny_llama, "--max-tokens", 4,
                  "--overwrite")
    job_id = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0 and store.preparing_for(job_id) is None, r.stderr
    assert store.r.llen(QUEUE) == 1 and store.get(job_id)["state"] == "queued"
    assert not old.exists() and (out / "_plan.json").exists()


FAKETIME = shutil.which("faketime")


@pytest.mark.skipif(FAKETIME is None, reason="needs faketime (make install-test installs it)")
def test_hosts_whose_clocks_disagree_agree_on_a_jobs_times(redis_server, tmp_path, tiny_llama):
    """Every time the job store keeps or measures comes from Redis' clock: `batchspec status`
    run on a host whose clock is 5 minutes ahead or behind (libfaketime) leaves a job that
    is still being prepared, or being finalized, to the process doing it, and shows a running
    job's tokens/s as any host does. Before, the host ahead ended the preparing job failed
    and took the finalization over, and the host behind showed 6e13 tokens/s."""
    from batchspec.jobs.runner import plan_job
    from batchspec.jobs.spec import JobSpec
    url = redis_server.rsplit("/", 1)[0] + "/14"  # own database: no worker serves it
    store = JobStore(url)
    store.r.flushdb()

    def status_from(offset: str, job_id: str) -> dict:
        r = subprocess.run([FAKETIME, offset, sys.executable, "-m", "batchspec.cli", "status",
                            job_id, "--json"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "BATCHSPEC_REDIS_URL": url,
                                "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    inputs = write_rows(tmp_path / "in.parquet", ["a b c", "d e f"], [4, 4])
    spec = JobSpec(inputs=inputs, output=str(tmp_path / "out"), model=tiny_llama,
                   max_tokens=4, shard_size=1)
    # a job its submitter is still preparing (clearing and claiming its directory)
    store.create("preparing", spec.to_dict(), plan_job(spec), preparing=True)
    for offset in ("+5 minutes", "-5 minutes"):
        assert status_from(offset, "preparing")["state"] == "queued"
    assert store.preparing_for("preparing") < 60
    # a job whose last shard ended just now: its finalizer is at work
    spec.output = str(tmp_path / "out2")
    shards = plan_job(spec)
    store.create("finalizing", spec.to_dict(), shards)
    assert [store.start_attempt("finalizing", s.id, "w") and
            store.finish_shard("finalizing", s.id, "completed", 1, 0, 4)
            for s in shards] == [0, 1]
    for offset in ("+5 minutes", "-5 minutes"):
        assert status_from(offset, "finalizing")["state"] == "finalizing"
    assert not store.claim_finalize("finalizing")       # a live claim holds for 60 s
    # a running job, 1000 tokens in about 1 s
    spec.output = str(tmp_path / "out3")
    shards = plan_job(spec)
    store.create("running", spec.to_dict(), shards)
    assert store.start_attempt("running", shards[0].id, "w") == 1
    store.progress("running", shards[0].id, "w", 0, 1000)
    time.sleep(1.0)
    for offset in ("+5 minutes", "-5 minutes"):
        assert 300 < status_from(offset, "running")["tokens_per_s"] < 1000


@pytest.mark.slow
def test_a_job_goes_on_through_a_sentinel_failover(slow_model, tmp_path):
    """Redis with a replica and a Sentinel, the worker and the CLI pointed at the Sentinel
    (docs/operations.md, "Many hosts against one Redis"): the master is killed (SIGKILL)
    while a shard generates, the Sentinel promotes the replica, and the job completes on it
    with every row once."""
    from tests.fixtures_redis import REDIS_SERVER, Worker, free_port
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    master = RedisServer(tmp_path / "a").start()
    replica = RedisServer(tmp_path / "b", args=("--replicaof", "127.0.0.1",
                                                str(master.port))).start()
    port, folder = free_port(), tmp_path / "s"
    folder.mkdir()
    (folder / "sentinel.conf").write_text(
        f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
        f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds mymaster 1000\n"
        "sentinel failover-timeout mymaster 5000\n")
    sentinel = subprocess.Popen([REDIS_SERVER, str(folder / "sentinel.conf"), "--sentinel"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    probe = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)

    def master_port() -> int | None:
        try:
            found = probe.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")
        except redis.ConnectionError:
            return None
        return int(found[1]) if found else None
    url = f"sentinel://127.0.0.1:{port}/0"
    worker = None
    try:
        wait_until(lambda: master_port() == master.port, 30, "the Sentinel to know the master")
        in_sync = redis.Redis(port=replica.port, decode_responses=True)
        wait_until(lambda: in_sync.info("replication")["master_link_status"] == "up", 30,
                   "the replica to be in sync")
        worker = Worker(url, str(tmp_path / "w.log"), "w").wait_ready()
        store = JobStore(url, retry_s=60)
        job_id, _, out = job_with_a_shard_on(store, url, worker, "f", slow_model, tmp_path)
        master.kill(signal.SIGKILL)
        wait_until(lambda: master_port() == replica.port, 60, "the Sentinel to promote the "
                   "replica")
        state = wait_until(lambda: (s := job_state(store, job_id)) in FINAL and s, 300,
                           "the job to end", 0.5)
        assert state == "completed", worker.tail()
        assert_each_row_once(out, [f"f{i}" for i in range(8)])
        assert (out / "_SUCCESS").exists()
    finally:
        if worker is not None:
            worker.stop()
        sentinel.terminate()
        sentinel.wait(10)
        replica.stop()
        master.stop()


@pytest.mark.slow
def test_a_worker_cut_off_from_redis_writes_nothing_once_its_lease_expired(slow_model,
                                                                           tmp_path):
    """A worker whose path to Redis alone is cut (its connections refused, while Redis
    serves the others) generates on; its lease expires and another worker runs the shard.
    It then waits for Redis before writing the shard's files, and once its path is back,
    finds the lease gone and writes nothing: the shard's files are written once, by the
    worker that holds it. It used to write them too (a lease it could not ask about counted
    as held), before or after that worker wrote its own."""
    import threading

    from tests.fixtures_redis import TcpProxy, Worker
    (tmp_path / "r").mkdir()
    server = RedisServer(tmp_path / "r").start()
    proxy = TcpProxy(server.port).start()
    store = JobStore(server.url)
    leases = {"BATCHSPEC_LEASE_TTL": "2", "BATCHSPEC_LEASE_RENEW": "0.5",
              "BATCHSPEC_CHECK_INTERVAL": "1"}
    workers = [Worker(proxy.url, str(tmp_path / "victim.log"), "victim", leases).wait_ready()]
    try:
        path = write_rows(tmp_path / "c.parquet", [f"row {i}" for i in range(4)], [1500] * 4)
        out = tmp_path / "out"
        job_id = batchspec(server.url, "submit", path, "-o", out, "--model", slow_model,
                           "--shard-size", 2).stdout.strip().splitlines()[-1]
        victim = workers[0]

        def generating():
            info = store.shard_info(job_id)
            return next((s for s in store.running_progress(job_id)
                         if info.get(s, {}).get("pid") in victim.pids()), None)
        shard = wait_until(generating, 180, "the victim to generate a shard", 0.02)
        target = out / "outputs" / f"part-{shard}.parquet"
        writes, watching = set(), threading.Event()

        def watch():            # each write renames a new file into place: a new inode
            while not watching.is_set():
                try:
                    writes.add(target.stat().st_ino)
                except FileNotFoundError:
                    pass
                time.sleep(0.01)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        proxy.kill()                                         # the victim is cut off
        workers += [Worker(server.url, str(tmp_path / f"w{i}.log"), f"w{i}", leases)
                    .wait_ready() for i in (1, 2)]
        state = wait_until(lambda: (s := job_state(store, job_id)) in FINAL and s, 300,
                           "the job to end", 0.2)
        assert state == "completed", workers[1].tail()
        wait_until(lambda: "could not ask for the lease" in victim.tail(20000), 120,
                   "the victim to finish generating its shard", 0.2)
        time.sleep(1.0)
        proxy.start()                                        # its path to Redis is back
        ended = wait_until(lambda: re.search(r"run_shard\[.*\] succeeded in .*: '(\w+)'",
                                             victim.tail(20000)), 120,
                           "the victim's task to end", 0.2)
        watching.set()
        watcher.join(10)
        assert len(writes) == 1, f"{shard}'s files were written {len(writes)} times"
        assert ended.group(1) == "lease_lost", victim.tail()
        assert_each_row_once(out, [f"c{i}" for i in range(4)])
        assert json.loads((out / "_job.json").read_text())["state"] == "completed"
    finally:
        for w in workers:
            w.stop()
        proxy.kill()
        server.stop()


@pytest.mark.slow
def test_a_beat_firing_that_cannot_reach_redis_is_sent_once_it_can(tmp_path):
    """Beat's path to Redis is cut from just before a firing to just after (its connections
    refused): the firing is sent once the path is back. Beat moves a schedule to its next
    run before sending, so such a firing used to be lost (with a traceback in the log): a
    Redis restart at the hour of a nightly job, and no job that night."""
    from batchspec.jobs.celery_app import QUEUE
    from tests.fixtures_redis import TcpProxy
    (tmp_path / "r").mkdir()
    (tmp_path / "jobs").mkdir()
    server = RedisServer(tmp_path / "r").start()
    proxy = TcpProxy(server.port).start()
    (tmp_path / "jobs" / "n.yaml").write_text(
        "name: n\nschedule: every 20s\ninputs: [in/*.parquet]\noutput: out/{now:%H%M%S}\n")
    client = redis.Redis(port=server.port)
    log = tmp_path / "beat.log"
    with open(log, "wb") as f:
        beat = subprocess.Popen([sys.executable, "-m", "batchspec.cli", "beat", "--broker",
                                 proxy.url, "--jobs", tmp_path / "jobs"], cwd=tmp_path,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: client.llen(QUEUE) == 1, 60, "the first firing", 0.05)
        first = time.monotonic()
        time.sleep(max(0.0, first + 18 - time.monotonic()))    # 2 s before the next one
        proxy.kill()
        time.sleep(10)                                          # it fell due 8 s ago
        assert client.llen(QUEUE) == 1
        proxy.start()
        wait_until(lambda: client.llen(QUEUE) == 2, 10, "the firing to be sent", 0.05)
        assert time.monotonic() - first < 38                    # not the one after it
    finally:
        os.killpg(beat.pid, signal.SIGTERM)
        beat.wait(30)
        proxy.kill()
        server.stop()
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_submit_wait_says_once_that_it_lost_redis_and_stops_after_a_minute(redis_server,
                                                                           tmp_path,
                                                                           tiny_llama):
    """`submit --wait` whose path to Redis is cut (its connections refused): one line when
    Redis is lost and one when it is back, and after REDIS_WAIT_S without it, one line
    saying the job goes on and how to follow it (exit 1, no traceback). It printed a
    warning every 5 s, then said to start redis-server, as if nothing had been submitted."""
    from batchspec.jobs.commands import REDIS_WAIT_S
    from tests.fixtures_redis import TcpProxy
    url = redis_server.rsplit("/", 1)[0] + "/12"      # own database: no worker serves it
    JobStore(url).r.flushdb()
    proxy = TcpProxy(int(redis_server.rsplit(":", 1)[1].split("/")[0])).start()
    path = write_rows(tmp_path / "w.parquet", ["a b c"], [4])
    waiting = subprocess.Popen(
        [sys.executable, "-m", "batchspec.cli", "submit", path, "-o", tmp_path / "out",
         "--model", tiny_llama, "--wait", "-q"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "BATCHSPEC_REDIS_URL": proxy.url.rsplit("/", 1)[0] + "/12"})
    try:
        wait_until(lambda: JobStore(url).recent(1), 60, "the job to be submitted", 0.1)
        time.sleep(1.0)
        proxy.kill()
        time.sleep(8)
        proxy.start()
        time.sleep(3)
        proxy.kill()
        cut = time.monotonic()
        _, err = waiting.communicate(timeout=REDIS_WAIT_S + 60)
        assert time.monotonic() - cut > REDIS_WAIT_S
    finally:
        waiting.kill()
        proxy.kill()
    job_id = JobStore(url).recent(1)[0]["job_id"]
    masked = proxy.url.rsplit("/", 1)[0] + "/12"
    lines = err.strip().splitlines()
    assert waiting.returncode == 1 and "Traceback" not in err, err
    # a cut may land while a poll awaits its reply: that connection is lost, not refused
    lost = (rf"lost Redis at {re.escape(masked)} \(connection (refused|lost)\); waiting for "
            rf"it \(job {job_id} goes on in the workers\)")
    assert len(lines) == 5, err
    assert re.fullmatch(lost, lines[1]) and re.fullmatch(lost, lines[3]), err
    assert [lines[0], lines[2], lines[4]] == [
        f"submitted {job_id}", "Redis is back",
        f"Error: Redis at {masked} unreachable for over {REDIS_WAIT_S} s: stopped following "
        f"job {job_id}, which goes on in the workers; follow it with batchspec status "
        f"{job_id} once Redis is back"], err


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_shard_generates_on_while_its_workers_path_to_redis_hangs(slow_model, tmp_path):
    """A worker's path to Redis hangs (packets go nowhere: the proxy in between is stopped
    with SIGSTOP) while its shard generates: the shard goes on generating (its process
    keeps using the CPU), and the job completes once the path is back. The engine's loop
    asked Redis itself whether the job was cancelled and reported progress, and waited on
    the hung connection: the process stood still (0.0 CPU seconds over 4 s)."""
    from tests.fixtures_redis import TcpProxy, Worker
    (tmp_path / "r").mkdir()
    server = RedisServer(tmp_path / "r").start()
    proxy = TcpProxy(server.port).start()
    store = JobStore(server.url)
    worker = Worker(proxy.url, str(tmp_path / "w.log"), "w").wait_ready()
    try:
        path = write_rows(tmp_path / "h.parquet", ["row 0", "row 1"], [1500, 1500])
        job_id = batchspec(server.url, "submit", path, "-o", tmp_path / "out", "--model",
                           slow_model).stdout.strip().splitlines()[-1]
        shard = wait_until(lambda: next(iter(store.running_progress(job_id)), None), 180,
                           "the shard to generate", 0.02)
        pid = int(store.shard_info(job_id)[shard]["pid"])
        time.sleep(1.0)
        proxy.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.0)                 # (whatever was on the wire is waited out)
            before = cpu_seconds(pid)
            time.sleep(4.0)
            used = cpu_seconds(pid) - before
        finally:
            proxy.proc.send_signal(signal.SIGCONT)
        assert used > 1.0, f"the shard's process used {used:.1f} CPU s in 4 s"
        state = wait_until(lambda: (s := job_state(store, job_id)) in FINAL and s, 300,
                           "the job to end", 0.2)
        assert state == "completed", worker.tail()
    finally:
        worker.stop()
        proxy.kill()
        server.stop()


@pytest.mark.parametrize("stream", ["0", "1"])
def test_a_redis_full_for_a_while_mid_job_holds_the_job_up_but_it_ends(start_worker, tmp_path,
                                                                        slow_model, stream):
    """Redis reaches its maxmemory (noeviction) while a shard generates, and refuses writes
    until memory is raised again. The worker's consumer, refused a write (a message's
    acknowledgement, or its delivery), reconnects as after a lost connection; it used to
    exit, and the job stayed `running` with no worker. `status` meanwhile says why in one
    line; once Redis takes writes again the job completes, every row once."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    waiting = None
    try:
        worker = start_worker(f"full-redis{stream}", url=server.url, BATCHSPEC_STREAM=stream,
                              **FAST_LEASES)
        store = JobStore(server.url, retry_s=30)
        client = redis.Redis.from_url(server.url)
        n = 8
        waiting, job_id, out = submit_waiting(server.url, store, tmp_path, slow_model, n, 24)
        wait_until(lambda: store.running_progress(job_id), 240, "a shard generating", 0.02)
        client.config_set("maxmemory", 1)          # every write now exceeds it
        try:
            # until the worker's consumer has been refused a write (the shard's end, or the
            # next message's delivery)
            wait_until(lambda: "maxmemory" in worker.tail(20000), 120,
                       "the worker to be refused a write")
            time.sleep(4)   # past the lease's TTL: `status` tries to re-queue the shard
            st = batchspec(server.url, "status", job_id)
        finally:
            client.config_set("maxmemory", 0)
        assert st.returncode == 0 and "Traceback" not in st.stderr, st.stderr
        said = [ln for ln in st.stderr.splitlines() if ln.strip()]
        assert said == [f"could not bring job {job_id} forward: Redis at {server.url} is full "
                        f"(used memory > maxmemory) and refuses writes: raise its maxmemory, or "
                        f"free memory there (ended jobs' records expire after "
                        f"BATCHSPEC_JOB_TTL_DAYS)"], st.stderr
        stdout, stderr = waiting.communicate(timeout=240)
        assert waiting.returncode == 0, stderr + worker.tail()
        # (`submit --wait` says it once at most, if one of its checks met the full Redis)
        assert stderr.count("could not bring job") <= 1 and "Traceback" not in stderr, stderr
        assert worker.proc.poll() is None, worker.tail()
        assert store.get(job_id)["state"] == "completed"
        assert_each_row_once(out, [f"r{i}" for i in range(n)])
    finally:
        if waiting is not None and waiting.poll() is None:
            waiting.kill()
        server.stop()


def test_a_shards_files_removed_from_out_mid_job_fail_the_job_saying_so(
        start_worker, redis_server, slow_model, tmp_path):
    """A completed shard's files are removed from OUT while the job runs (a clean-up of the
    directory, say): the job ends `failed`, naming the shard and what to do, with no
    `_SUCCESS`. It used to end `completed` with `_SUCCESS`, two of its eight rows in no file
    and nothing saying so. Submitted again, the job runs that shard alone and completes."""
    url = redis_server.rsplit("/", 1)[0] + "/7"  # own database: only this worker
    store = JobStore(url)
    store.r.flushdb()
    worker = start_worker("cleaned", url=url, **FAST_LEASES)
    job_id, _, out = job_with_a_shard_on(store, url, worker, "g", slow_model, tmp_path)
    done = wait_until(lambda: [s for s, st in store.shard_states(job_id).items()
                               if st == "completed"], 120, "a shard to complete", 0.02)[0]
    for kind in ("outputs", "acceptance", "errors"):
        (out / kind / f"part-{done}.parquet").unlink()
    wait_until(lambda: job_state(store, job_id) in FINAL, 300, "the job to end", 0.2)
    job = store.get(job_id)
    error = (f"the files of shard {done} are gone from {out} (removed while the job ran?): "
             f"their 2 requests have no output; run or submit the job again with the same "
             f"inputs and -o to run them")
    assert (job["state"], job.get("error")) == ("failed", error), worker.tail()
    assert not (out / "_SUCCESS").exists()
    doc = json.loads((out / "_job.json").read_text())
    assert (doc["state"], doc["missing_shards"]) == ("failed", [done])
    again = batchspec(url, "submit", tmp_path / "g.parquet", "-o", out, "--model", slow_model,
                      "--shard-size", 2, "--wait", "-q")
    assert again.returncode == 0, again.stderr + worker.tail()
    assert_each_row_once(out, [f"g{i}" for i in range(8)])
    assert (out / "_SUCCESS").exists()
    info = store.shard_info(again.stdout.strip().splitlines()[-1])
    assert sorted(s for s, i in info.items() if not i.get("skipped")) == [done]
