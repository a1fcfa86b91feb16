"""Fault campaign: jobs through real faults, N trials each, and a table of what happened.

    python scripts/fault_campaign.py --kill-trials 20 --redis-trials 10

Faults (docs/operations.md, "Faults"):
  kill -9      the whole process group of one of two workers (`os.killpg(SIGKILL)`, as a
               dead host), at a random time after submit; the other worker's periodic check
               re-queues the shard whose lease expired. Default lease settings unless
               BATCHSPEC_LEASE_* are set in the environment.
  redis        redis-server (appendonly yes, appendfsync everysec) stopped by SIGKILL or
               SIGTERM (alternating) at a random time, down 1-15 s, restarted on the same
               port and data directory.
Each trial's job must reach a final state; the table counts rows lost and written twice
(ids in OUT/outputs), jobs with _SUCCESS, and the time from the kill to the re-queue of the
shard the dead worker held ("recovery") and to the job's end; "mid-job" counts the trials
whose fault hit a job still running (the dead worker held a shard; Redis stopped while a
shard generated)."""
from __future__ import annotations

import collections
import datetime as dt
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import click
import pyarrow as pa
import pyarrow.parquet as pq
import redis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from batchspec.jobs.states import FINAL  # noqa: E402
from batchspec.jobs.store import JobStore  # noqa: E402
from tests.fixtures_redis import RedisServer, Worker, wait_until  # noqa: E402


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Campaign:
    def __init__(self, folder: str, model: str, rows: int, shard_size: int, max_tokens: int,
                 timeout: float):
        self.folder, self.model, self.timeout = folder, model, timeout
        self.rows, self.shard_size, self.max_tokens = rows, shard_size, max_tokens
        os.makedirs(f"{folder}/redis", exist_ok=True)
        self.redis = RedisServer(f"{folder}/redis").start()
        self.store = JobStore(self.redis.url)
        self.workers: dict[str, Worker] = {}
        self.starts = collections.Counter()
        self.trial = 0

    def start_worker(self, name: str) -> Worker:
        self.starts[name] += 1
        w = Worker(self.redis.url, f"{self.folder}/{name}-{self.starts[name]}.log", name)
        self.workers[name] = w.wait_ready(300)
        return w

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.redis.stop()

    def submit(self) -> tuple[str, str, list[str]]:
        self.trial += 1
        prefix = f"t{self.trial}-"
        ids = [f"{prefix}{i}" for i in range(self.rows)]
        path = f"{self.folder}/in-{self.trial}.parquet"
        pq.write_table(pa.table({"id": ids, "prompt": [f"row {i}" for i in range(self.rows)]}),
                       path)
        out = f"{self.folder}/out-{self.trial}"
        r = subprocess.run([sys.executable, "-m", "batchspec.cli", "submit", path, "-o", out,
                            "--model", self.model, "--max-tokens", str(self.max_tokens),
                            "--shard-size", str(self.shard_size), "--broker", self.redis.url],
                           capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise RuntimeError(f"submit failed: {r.stderr[-2000:]}")
        return r.stdout.strip().splitlines()[-1], out, ids

    def state(self, job_id: str) -> str | None:
        try:
            return (self.store.get(job_id) or {}).get("state")
        except redis.ConnectionError:
            return None

    def wait_final(self, job_id: str) -> str | None:
        try:
            return wait_until(lambda: (s := self.state(job_id)) in FINAL and s, self.timeout,
                              f"job {job_id}", 0.2)
        except AssertionError:
            return None

    def result(self, job_id: str, out: str, ids: list[str], state: str | None,
               t_fault: dt.datetime) -> dict:
        got = []
        if os.path.isdir(f"{out}/outputs"):
            for name in sorted(os.listdir(f"{out}/outputs")):
                if name.startswith("part-"):
                    got += pq.read_table(f"{out}/outputs/{name}", columns=["id"]).column(0) \
                        .to_pylist()
        counts = collections.Counter(got)
        job = self.store.get(job_id) or {}
        end = job.get("finished_at")
        return {"state": state or "stuck", "success": os.path.exists(f"{out}/_SUCCESS"),
                "lost": len(set(ids) - set(got)),
                "duplicated": sum(n - 1 for n in counts.values() if n > 1),
                "to_final_s": (dt.datetime.fromisoformat(end) - t_fault).total_seconds()
                if end else None}

    def held_by_victim(self, job_id: str) -> list[str]:
        """The job's running shards whose lease the victim's processes hold."""
        pids = self.workers["victim"].pids()
        info = self.store.shard_info(job_id)
        return [s for s, st in self.store.shard_states(job_id).items()
                if st == "running" and info.get(s, {}).get("pid") in pids]

    def kill_trial(self, rng: random.Random) -> dict:
        """kill -9 of the victim's process group at a random moment, 0-2 s after it has
        started a shard of the job (a fixed window after submitting missed the job in half
        the trials once a worker's models loaded in a few seconds)."""
        job_id, out, ids = self.submit()
        wait_until(lambda: self.held_by_victim(job_id) or self.state(job_id) in FINAL, 120,
                   "the victim running a shard", 0.02)
        time.sleep(rng.uniform(0.0, 2.0))
        victim = self.workers["victim"]
        held = self.held_by_victim(job_id)
        t_kill = now()
        victim.kill()
        state = self.wait_final(job_id)
        res = self.result(job_id, out, ids, state, t_kill)
        info = self.store.shard_info(job_id)
        requeued = [dt.datetime.fromisoformat(info[s]["requeued_at"]) for s in held
                    if "requeued_at" in info.get(s, {})]
        res["held"] = len(held)
        res["recovery_s"] = (max(requeued) - t_kill).total_seconds() \
            if held and len(requeued) == len(held) else None
        self.start_worker("victim")
        return res

    def redis_trial(self, rng: random.Random, sig: int) -> dict:
        """Redis stopped at a random time while a shard of the job generates."""
        job_id, out, ids = self.submit()
        wait_until(lambda: self.store.running_progress(job_id), 120, "a shard generating",
                   0.02)
        time.sleep(rng.uniform(0.0, 2.0))
        down = rng.uniform(1.0, 15.0)
        mid_job = self.state(job_id) not in FINAL
        t_kill = now()
        self.redis.kill(sig)
        time.sleep(down)
        self.redis.start()
        state = self.wait_final(job_id)
        res = self.result(job_id, out, ids, state, t_kill)
        res["down_s"], res["mid_job"] = down, mid_job
        return res


def median(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.1f}" if values else "-"


def table(rows: dict[str, list[dict]]) -> str:
    head = (f"{'fault':16} {'trials':>6} {'final':>6} {'_SUCCESS':>8} {'lost':>5} "
            f"{'dup':>4} {'mid-job':>6}  {'recovery s (median)':>19} {'to end s (median)':>17}"
            "  final states")
    lines = [head, "-" * len(head)]
    for name, res in rows.items():
        if not res:
            continue
        states = collections.Counter(r["state"] for r in res)
        lines.append(
            f"{name:16} {len(res):>6} {sum(r['state'] in FINAL for r in res):>6} "
            f"{sum(r['success'] for r in res):>8} {sum(r['lost'] for r in res):>5} "
            f"{sum(r['duplicated'] for r in res):>4} "
            f"{sum(r.get('held', 0) > 0 or r.get('mid_job', False) for r in res):>6}  "
            f"{median(r.get('recovery_s') for r in res):>19} "
            f"{median(r['to_final_s'] for r in res):>17}  "
            + ", ".join(f"{k} {v}" for k, v in sorted(states.items())))
    return "\n".join(lines)


@click.command()
@click.option("--kill-trials", default=20, show_default=True)
@click.option("--redis-trials", default=10, show_default=True,
              help="Alternating SIGKILL / SIGTERM.")
@click.option("--rows", default=12, show_default=True, help="Rows per job.")
@click.option("--shard-size", default=2, show_default=True)
@click.option("--max-tokens", default=40, show_default=True)
@click.option("--model", help="Target model directory [a random 19M-parameter Llama: "
                              "slow enough that shards are caught mid-generation].")
@click.option("--seed", default=0, show_default=True)
@click.option("--timeout", default=600.0, show_default=True,
              help="Seconds a job may take after its fault before it counts as stuck.")
def main(kill_trials, redis_trials, rows, shard_size, max_tokens, model, seed, timeout):
    rng = random.Random(seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop workers and Redis on the way
    lease = {k: v for k, v in os.environ.items() if k.startswith("BATCHSPEC_LEASE")
             or k == "BATCHSPEC_CHECK_INTERVAL"}
    print(f"lease settings: {lease or 'defaults'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="faults-") as folder:
        if model is None:
            from batchspec.tools.tiny import make_random_model
            model = make_random_model(f"{folder}/model", "llama", hidden_size=384,
                                      num_layers=8, num_heads=6, num_kv_heads=6, seed=2)
        c = Campaign(folder, model, rows, shard_size, max_tokens, timeout)
        results: dict[str, list[dict]] = {"kill -9 worker": [], "redis SIGKILL": [],
                                          "redis SIGTERM": []}
        try:
            c.start_worker("victim")
            c.start_worker("rescuer")
            for i in range(kill_trials):
                r = c.kill_trial(rng)
                results["kill -9 worker"].append(r)
                print(f"kill -9 trial {i + 1}: {r}", flush=True)
            for i in range(redis_trials):
                sig = signal.SIGKILL if i % 2 == 0 else signal.SIGTERM
                r = c.redis_trial(rng, sig)
                results[f"redis {signal.Signals(sig).name}"].append(r)
                print(f"redis {signal.Signals(sig).name} trial {i + 1}: {r}", flush=True)
        finally:
            c.close()
        print()
        print(table(results))


if __name__ == "__main__":
    main()
