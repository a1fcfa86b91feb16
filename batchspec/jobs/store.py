"""Job records in Redis: state, timestamps, shard plan, per-shard state and attempts, counts.

Keys (prefix `batchspec:`):
  jobs                 sorted set job_id -> created time (for `batchspec jobs`)
  job:ID               hash: state, spec, output, timestamps, *_total / *_completed / ...
  job:ID:plan          hash shard -> shard JSON (tasks carry ids only; the plan lives here)
  job:ID:state         hash shard -> queued | running | completed | failed | cancelled
  job:ID:info          hash shard -> JSON (host, pid, started/finished, skipped, error)
  job:ID:attempts      hash shard -> deliveries so far (survives worker crashes)
  job:ID:progress      hash shard -> "finished_requests tokens" of a running shard

Updates that must not race (a shard finishing, the job starting, cancel) are Lua scripts,
so exactly one task sees "that was the last shard" and finalizes: no chords needed."""
from __future__ import annotations

import datetime as dt
import json
import urllib.parse

import redis

from batchspec.jobs.shards import Shard

PREFIX = "batchspec:"
COUNTERS = ("shards_total", "shards_completed", "shards_failed", "shards_cancelled",
            "requests_total", "requests_completed", "requests_failed", "tokens_generated")

_START = """
local n = redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
if redis.call('HGET', KEYS[1], 'state') == 'queued' then
  redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[2])
end
redis.call('HSET', KEYS[2], ARGV[1], 'running')
return n
"""

# ARGV: shard, outcome (completed|failed|cancelled), requests ok, requests failed, tokens
_FINISH = """
local s = redis.call('HGET', KEYS[2], ARGV[1])
if s == 'completed' or s == 'failed' or s == 'cancelled' then return -1 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'shards_' .. ARGV[2], 1)
redis.call('HINCRBY', KEYS[1], 'requests_completed', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'requests_failed', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'tokens_generated', ARGV[5])
local c = redis.call('HMGET', KEYS[1], 'shards_total', 'shards_completed', 'shards_failed',
                     'shards_cancelled')
if tonumber(c[2]) + tonumber(c[3]) + tonumber(c[4]) >= tonumber(c[1]) then
  redis.call('HSET', KEYS[1], 'state', 'finalizing')
  return 1
end
return 0
"""

_CANCEL = """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'queued' or s == 'running' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 'cancel_requested', '1')
  return 'cancelling'
end
return s
"""


def redis_client(url: str) -> redis.Redis:
    """A client for redis://, rediss://, unix:// URLs, or for the master behind Redis
    Sentinel: 'sentinel://host1:26379/0;sentinel://host2:26379/0' (the same URL Celery
    takes; the master's name comes from BATCHSPEC_REDIS_MASTER)."""
    if not url.startswith("sentinel://"):
        return redis.Redis.from_url(url, decode_responses=True)
    from redis.sentinel import Sentinel

    from batchspec.jobs.celery_app import master_name
    parts = [urllib.parse.urlparse(p.strip()) for p in url.split(";") if p.strip()]
    db = int(parts[0].path.strip("/") or 0)
    sentinel = Sentinel([(p.hostname, p.port or 26379) for p in parts], socket_timeout=5)
    return sentinel.master_for(master_name(), db=db, password=parts[0].password,
                               decode_responses=True)


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


class JobStore:
    def __init__(self, url: str):
        self.r = redis_client(url)
        self._start = self.r.register_script(_START)
        self._finish = self.r.register_script(_FINISH)
        self._cancel = self.r.register_script(_CANCEL)

    def _key(self, job_id: str, part: str = "") -> str:
        return f"{PREFIX}job:{job_id}" + (f":{part}" if part else "")

    def create(self, job_id: str, spec: dict, shards: list[Shard]) -> None:
        fields = {"job_id": job_id, "state": "queued", "spec": json.dumps(spec),
                  "output": spec["output"], "created_at": now_iso(),
                  **{c: 0 for c in COUNTERS},
                  "shards_total": len(shards),
                  "requests_total": sum(s.num_rows for s in shards)}
        pipe = self.r.pipeline()
        pipe.hset(self._key(job_id), mapping=fields)
        if shards:
            pipe.hset(self._key(job_id, "plan"),
                      mapping={s.id: json.dumps(s.to_dict()) for s in shards})
            pipe.hset(self._key(job_id, "state"), mapping={s.id: "queued" for s in shards})
        pipe.zadd(PREFIX + "jobs", {job_id: dt.datetime.now(dt.UTC).timestamp()})
        pipe.execute()

    def exists(self, job_id: str) -> bool:
        return bool(self.r.exists(self._key(job_id)))

    def spec(self, job_id: str) -> dict:
        return json.loads(self.r.hget(self._key(job_id), "spec"))

    def plan(self, job_id: str) -> list[Shard]:
        plan = self.r.hgetall(self._key(job_id, "plan"))
        return [Shard.from_dict(json.loads(plan[k])) for k in sorted(plan)]

    def shard(self, job_id: str, shard_id: str) -> Shard:
        return Shard.from_dict(json.loads(self.r.hget(self._key(job_id, "plan"), shard_id)))

    def shard_state(self, job_id: str, shard_id: str) -> str | None:
        return self.r.hget(self._key(job_id, "state"), shard_id)

    def shard_states(self, job_id: str) -> dict[str, str]:
        return self.r.hgetall(self._key(job_id, "state"))

    def shard_info(self, job_id: str) -> dict[str, dict]:
        return {k: json.loads(v) for k, v in self.r.hgetall(self._key(job_id, "info")).items()}

    def update_info(self, job_id: str, shard_id: str, **fields) -> None:
        key = self._key(job_id, "info")
        info = json.loads(self.r.hget(key, shard_id) or "{}")
        self.r.hset(key, shard_id, json.dumps(info | fields))

    def start_attempt(self, job_id: str, shard_id: str) -> int:
        """Count a delivery of the shard (before any work, so a crash still counts) and mark
        it and the job running. Returns the attempt number."""
        keys = [self._key(job_id), self._key(job_id, "state"), self._key(job_id, "attempts")]
        return int(self._start(keys=keys, args=[shard_id, now_iso()]))

    def attempts(self, job_id: str, shard_id: str) -> int:
        return int(self.r.hget(self._key(job_id, "attempts"), shard_id) or 0)

    def progress(self, job_id: str, shard_id: str, finished: int, tokens: int) -> None:
        self.r.hset(self._key(job_id, "progress"), shard_id, f"{finished} {tokens}")

    def running_progress(self, job_id: str) -> dict[str, tuple[int, int]]:
        """shard -> (finished requests, generated tokens) of the shards being generated."""
        return {k: tuple(map(int, v.split()))
                for k, v in self.r.hgetall(self._key(job_id, "progress")).items()}

    def finish_shard(self, job_id: str, shard_id: str, outcome: str, requests_ok: int = 0,
                     requests_failed: int = 0, tokens: int = 0) -> int:
        """Record a shard's end once. Returns 1 if it was the job's last shard (the caller
        finalizes), 0 if not, -1 if the shard had already ended (a redelivery)."""
        keys = [self._key(job_id), self._key(job_id, "state"), self._key(job_id, "progress")]
        return int(self._finish(keys=keys, args=[shard_id, outcome, requests_ok,
                                                 requests_failed, tokens]))

    def cancel(self, job_id: str) -> str:
        return self._cancel(keys=[self._key(job_id)])

    def cancel_requested(self, job_id: str) -> bool:
        return self.r.hget(self._key(job_id), "cancel_requested") == "1"

    def set_fields(self, job_id: str, **fields) -> None:
        self.r.hset(self._key(job_id), mapping={k: v if isinstance(v, str) else json.dumps(v)
                                                for k, v in fields.items()})

    def get(self, job_id: str) -> dict | None:
        """The job record with counts as ints, progress of running shards folded in, and
        throughput."""
        raw = self.r.hgetall(self._key(job_id))
        if not raw:
            return None
        job = {k: v for k, v in raw.items() if k not in COUNTERS and k != "spec"}
        job |= {c: int(raw.get(c, 0)) for c in COUNTERS}
        running = self.running_progress(job_id).values()
        job["requests_in_progress"] = sum(r[0] for r in running)
        tokens = job["tokens_generated"] + sum(r[1] for r in running)
        start = raw.get("started_at")
        if start:
            end = raw.get("finished_at")
            end_t = dt.datetime.fromisoformat(end) if end else dt.datetime.now(dt.UTC)
            elapsed = max((end_t - dt.datetime.fromisoformat(start)).total_seconds(), 1e-9)
            job["tokens_per_s"] = tokens / elapsed
            job["requests_per_s"] = job["requests_completed"] / elapsed
        for k in ("summary", "failed_shards"):
            if k in job:
                job[k] = json.loads(job[k])
        return job

    def expire(self, job_id: str, seconds: int) -> None:
        """Let an ended job's keys go after `seconds` (its files stay in OUT)."""
        pipe = self.r.pipeline()
        for part in ("", "plan", "state", "info", "attempts", "progress"):
            pipe.expire(self._key(job_id, part), seconds)
        pipe.execute()

    def recent(self, limit: int = 20) -> list[dict]:
        ids = self.r.zrevrange(PREFIX + "jobs", 0, limit - 1)
        jobs = {i: self.get(i) for i in ids}
        gone = [i for i, j in jobs.items() if j is None]
        if gone:  # expired records
            self.r.zrem(PREFIX + "jobs", *gone)
        return [j for j in jobs.values() if j is not None]
