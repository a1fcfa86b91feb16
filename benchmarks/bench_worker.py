"""The streaming worker against `batchspec run`: the same job (256 rows, 32-row shards, demo
family with its per-domain drafts, per-row max_tokens 8..96) through `batchspec run` (one
engine kept full across shards, in this process), through submit + one `batchspec worker
--stream`, and through submit + one plain worker (one shard per task: the batch drains at
every shard end). Side by side, fastest of N each; generated tokens/s and the ratio to run.

    python benchmarks/bench_worker.py [--rows 256] [--shard-size 32] [--repeats 2]

Each side runs the job once untimed first (a worker: on the same worker process), so that
neither model loading nor a fresh process's one-time costs at new batch shapes (1-3 s here)
are timed; a job's time runs from submit to its final state as seen in Redis."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")

from batchspec import LLM  # noqa: E402
from batchspec.jobs.celery_app import use_broker  # noqa: E402
from batchspec.jobs.runner import run_local  # noqa: E402
from batchspec.jobs.spec import JobSpec  # noqa: E402
from batchspec.jobs.states import FINAL  # noqa: E402
from batchspec.jobs.tasks import get_store, submit_job  # noqa: E402
from benchmarks.jobinput import write_mixed_job  # noqa: E402
from tests.fixtures_redis import RedisServer, Worker, wait_until  # noqa: E402


def tokens(out: str) -> int:
    folder = os.path.join(out, "outputs")
    return sum(sum(pq.read_table(os.path.join(folder, n), columns=["num_output_tokens"])
                   .column(0).to_pylist()) for n in os.listdir(folder))


def submit_and_wait(data: str, out: str, shard_size: int) -> float:
    store = get_store()
    t0 = time.perf_counter()
    job_id = submit_job(JobSpec(inputs=[data], output=out, shard_size=shard_size))
    wait_until(lambda: store.get(job_id)["state"] in FINAL, 3600, job_id, 0.05)
    elapsed = time.perf_counter() - t0
    assert store.get(job_id)["state"] == "completed", store.get(job_id)
    return elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_worker_")
    data = os.path.join(tmp, "in.parquet")
    write_mixed_job(data, args.rows)
    os.makedirs(os.path.join(tmp, "redis"))
    redis = RedisServer(os.path.join(tmp, "redis")).start()
    use_broker(redis.url)
    spec = JobSpec(inputs=[data], output=os.path.join(tmp, "x"), shard_size=args.shard_size)
    llm = LLM.from_config(spec.engine_config())
    run_local(JobSpec(inputs=[data], output=os.path.join(tmp, "warm-run"),
                      shard_size=args.shard_size), progress=False, llm=llm)
    seconds: dict[str, float] = {}
    count: dict[str, int] = {}
    try:
        for rep in range(args.repeats):
            for mode in ("run", "worker --stream", "worker"):
                out = os.path.join(tmp, f"{mode.replace(' ', '_')}-{rep}")
                if mode == "run":
                    t0 = time.perf_counter()
                    run_local(JobSpec(inputs=[data], output=out, shard_size=args.shard_size),
                              progress=False, llm=llm)
                    elapsed = time.perf_counter() - t0
                else:
                    env = {"BATCHSPEC_STREAM": "1" if "stream" in mode else ""}
                    w = Worker(redis.url, os.path.join(tmp, f"{mode[-6:]}-{rep}.log"),
                               f"bench{rep}{len(mode)}", env).wait_ready(300)
                    try:
                        submit_and_wait(data, os.path.join(tmp, f"warm-{mode}-{rep}"),
                                        args.shard_size)
                        elapsed = submit_and_wait(data, out, args.shard_size)
                    finally:
                        w.stop()
                count[mode] = tokens(out)
                seconds[mode] = min(seconds.get(mode, float("inf")), elapsed)
                print(f"{mode:16} repeat {rep}: {elapsed:6.1f} s, "
                      f"{count[mode] / elapsed:7.1f} tokens/s", flush=True)
    finally:
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{args.rows} rows, {args.shard_size}-row shards, best of {args.repeats}")
    base = count["run"] / seconds["run"]
    for mode in seconds:
        rate = count[mode] / seconds[mode]
        print(f"{mode:16} {seconds[mode]:6.1f} s {rate:8.1f} tokens/s  {rate / base:5.2f}x run")


if __name__ == "__main__":
    main()
