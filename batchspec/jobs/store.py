"""Job records in Redis: state, timestamps, shard plan, per-shard state and attempts, counts.

Keys (prefix `batchspec:`):
  jobs                 sorted set job_id -> created time (for `batchspec jobs`)
  job:ID               hash: state, spec, output, timestamps, *_total / *_completed / ...
  job:ID:plan          hash shard -> shard JSON (tasks carry ids only; the plan lives here)
  job:ID:state         hash shard -> queued | running | completed | failed | cancelled
  job:ID:info          hash shard -> JSON (host, pid, started/finished, skipped, error)
  job:ID:attempts      hash shard -> deliveries so far (survives worker crashes)
  job:ID:progress      hash shard -> "finished_requests tokens" of a running shard
  job:ID:owner         hash shard -> lease token of the worker running it
  job:ID:lease:SHARD   the running shard's lease: its worker's token, with a TTL the worker
                       keeps renewing; gone = the worker is dead (see batchspec.jobs.lease)
  active               set of the jobs not yet final (what the periodic checks look at)

Updates that must not race (a shard starting, renewing or losing its lease, finishing, the
job finalizing, cancel) are Lua scripts, so a shard runs under one live lease at a time,
is re-queued once when its lease expires, and exactly one task finalizes: no chords
needed."""
from __future__ import annotations

import datetime as dt
import json
import urllib.parse

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from batchspec.contract import throughput
from batchspec.jobs.shards import Shard
from batchspec.jobs.states import iso

PREFIX = "batchspec:"
# tokens_generated counts the tokens shards made while the job ran, and takes the total of
# its output files when it ends; tokens_run keeps the former, and requests_run counts the
# rows completed by shards that ran (not found done): what throughput divides.
COUNTERS = ("shards_total", "shards_completed", "shards_failed", "shards_cancelled",
            "requests_total", "requests_completed", "requests_failed", "tokens_generated",
            "tokens_run", "requests_run")

ENDED_LUA = "s == 'completed' or s == 'failed' or s == 'cancelled'"
# Redis' clock in a script, epoch seconds (JobStore.now says why)
NOW_LUA = "(function() local t = redis.call('TIME') return t[1] + t[2] / 1e6 end)()"

# KEYS: job, state, attempts, lease, owner. ARGV: shard, now, token, ttl ms, the token of a
# dead holder this worker may take over ('' for none).
# Returns the attempt number, -1 if another worker holds a live lease, -2 if the shard ended.
_START = f"""
local s = redis.call('HGET', KEYS[2], ARGV[1])
if {ENDED_LUA} then return -2 end
local holder = redis.call('GET', KEYS[4])
if holder and holder ~= ARGV[5] then return -1 end
local n = redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
if redis.call('HGET', KEYS[1], 'state') == 'queued' then
  redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[2])
end
redis.call('HSET', KEYS[2], ARGV[1], 'running')
redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[4])
redis.call('HSET', KEYS[5], ARGV[1], ARGV[3])
return n
"""

# KEYS: state, lease, owner. ARGV: shard, token, ttl ms. 1 renewed, 0 the lease is not ours
# (the shard ended, or was re-queued after our lease expired).
_RENEW = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'running' then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""

# KEYS: owner, progress. ARGV: shard, token, "finished tokens". A running shard's progress, from
# its lease holder only: a worker that wakes after its lease expired (a frozen host) and the
# shard ran elsewhere must not show it in progress again (nothing would ever clear it).
_PROGRESS = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""

# KEYS: state, lease, owner, progress. ARGV: shard, token ('' = any holder, if the lease is
# gone). Puts a running shard back to queued: a lease holder giving it up (to be retried),
# or anyone noticing its lease expired. Exactly one caller gets 1 and sends the task.
_REQUEUE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'running' then return 0 end
if ARGV[2] == '' then
  if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
elseif redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], 'queued')
redis.call('DEL', KEYS[2])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return 1
"""

# ARGV: shard, outcome (completed|failed|cancelled), requests ok, requests failed, tokens,
# whether the shard ran ('1') or was found done ('0').
# KEYS: job, state, progress, lease, owner. -2: no job record (a Redis that lost it: the
# record is not rebuilt from counters alone).
_FINISH = f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return -2 end
local s = redis.call('HGET', KEYS[2], ARGV[1])
if {ENDED_LUA} then return -1 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'shards_' .. ARGV[2], 1)
redis.call('HINCRBY', KEYS[1], 'requests_completed', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'requests_failed', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'tokens_generated', ARGV[5])
if ARGV[6] == '1' then
  redis.call('HINCRBY', KEYS[1], 'tokens_run', ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'requests_run', ARGV[3])
end
local c = redis.call('HMGET', KEYS[1], 'shards_total', 'shards_completed', 'shards_failed',
                     'shards_cancelled')
if tonumber(c[2]) + tonumber(c[3]) + tonumber(c[4]) >= tonumber(c[1]) then
  redis.call('HSET', KEYS[1], 'state', 'finalizing', 'finalizing_since', {NOW_LUA})
  return 1
end
return 0
"""

# KEYS: job, state. ARGV: seconds after which a finalizer that has not finished is presumed
# dead. 1 when every shard has ended and the caller is to finalize.
_CLAIM_FINALIZE = f"""
local st = redis.call('HGET', KEYS[1], 'state')
if not st or st == 'completed' or st == 'completed_with_errors' or st == 'failed'
   or st == 'cancelled' then return 0 end
for _, s in ipairs(redis.call('HVALS', KEYS[2])) do
  if not ({ENDED_LUA}) then return 0 end
end
local since = tonumber(redis.call('HGET', KEYS[1], 'finalizing_since') or '0')
local now = {NOW_LUA}
if st == 'finalizing' and since + tonumber(ARGV[1]) > now then return 0 end
redis.call('HSET', KEYS[1], 'state', 'finalizing', 'finalizing_since', now)
return 1
"""

_CANCEL = """
local s = redis.call('HGET', KEYS[1], 'state')
if s == 'queued' or s == 'running' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 'cancel_requested', '1')
  return 'cancelling'
end
return s
"""


def retry_policy(seconds: float) -> Retry:
    """Retry a command on connection errors with exponential backoff (0.1 s doubling up to
    2 s) for about `seconds` in all: a Redis restart costs a worker a pause, not its shard."""
    delays, total = 0, 0.0
    while total < seconds:
        total += min(2.0, 0.1 * 2 ** delays)
        delays += 1
    return Retry(ExponentialBackoff(cap=2.0, base=0.1), delays,
                 (redis.ConnectionError, redis.TimeoutError, TimeoutError, ConnectionError))


def redis_client(url: str, retry_s: float = 0) -> redis.Redis:
    """A client for redis://, rediss://, unix:// URLs, or for the master behind Redis
    Sentinel: 'sentinel://host1:26379/0;sentinel://host2:26379/0' (the same URL Celery
    takes; the master's name comes from BATCHSPEC_REDIS_MASTER). Commands that cannot reach
    Redis are retried for about `retry_s` seconds before raising."""
    opts = {"decode_responses": True, "socket_connect_timeout": 5, "socket_timeout": 30,
            "health_check_interval": 30}
    if retry_s > 0:
        opts |= {"retry": retry_policy(retry_s),
                 "retry_on_error": [redis.ConnectionError, redis.TimeoutError]}
    if not url.startswith("sentinel://"):
        return redis.Redis.from_url(url, **opts)
    from redis.sentinel import Sentinel

    from batchspec.jobs.celery_app import master_name
    parts = [urllib.parse.urlparse(p.strip()) for p in url.split(";") if p.strip()]
    db = int(parts[0].path.strip("/") or 0)
    sentinel = Sentinel([(p.hostname, p.port or 26379) for p in parts], socket_timeout=5)
    return sentinel.master_for(master_name(), db=db, password=parts[0].password, **opts)


class OutputBusy(ValueError):
    """A job is still running in the output directory a new one would write to."""


def output_busy(job_id: str, output: str) -> OutputBusy:
    return OutputBusy(f"job {job_id} is still running in {output}: wait for it (batchspec "
                      f"status {job_id}), cancel it (batchspec cancel {job_id}), or write to "
                      f"another output directory")


class JobStore:
    def __init__(self, url: str, retry_s: float = 0):
        self.url = url
        self.r = redis_client(url, retry_s)
        self._start = self.r.register_script(_START)
        self._renew = self.r.register_script(_RENEW)
        self._progress = self.r.register_script(_PROGRESS)
        self._requeue = self.r.register_script(_REQUEUE)
        self._finish = self.r.register_script(_FINISH)
        self._claim_finalize = self.r.register_script(_CLAIM_FINALIZE)
        self._cancel = self.r.register_script(_CANCEL)

    def _key(self, job_id: str, part: str = "") -> str:
        return f"{PREFIX}job:{job_id}" + (f":{part}" if part else "")

    def now(self) -> dt.datetime:
        """Redis' clock. Every time the store keeps (a job's and a shard's stamps, a job's
        order among the jobs) and every age it measures (a job still being prepared, a
        finalizer presumed dead) is read from it, not from the caller's: hosts' clocks
        disagree, by minutes on a laptop or a VM that drifted, and a `status` run on a host
        5 minutes ahead ended failed a job that its submitter was still preparing, while one
        5 minutes behind showed a running job at 6e13 tokens/s."""
        seconds, micros = self.r.time()
        return dt.datetime.fromtimestamp(seconds + micros / 1e6, dt.UTC)

    def now_iso(self) -> str:
        return iso(self.now())

    def create(self, job_id: str, spec: dict, shards: list[Shard],
               preparing: bool = False) -> None:
        """Record a new job, queued, among the active ones; raises OutputBusy when an active
        job writes to the same output directory. The check and the record are one
        transaction (WATCH on the active set, retried when a job starts or ends in between):
        of two submits into one directory in the same instant, one is refused, where checked
        apart both ran and computed every shard twice. `preparing`: its submitter still
        prepares the output directory (`prepared` says when it is done); until then no check
        sends its shards' tasks."""
        output = spec["output"]
        now = self.now()
        fields = {"job_id": job_id, "state": "queued", "spec": json.dumps(spec),
                  "output": output, "created_at": iso(now),
                  **{c: 0 for c in COUNTERS},
                  "shards_total": len(shards),
                  "requests_total": sum(s.num_rows for s in shards)}
        if preparing:
            fields["preparing_since"] = now.timestamp()
        plan = {s.id: json.dumps(s.to_dict()) for s in shards}
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(PREFIX + "active")
                    busy = self._active_in(pipe.smembers(PREFIX + "active"), output)
                    if busy is not None:
                        raise output_busy(busy, output)
                    pipe.multi()
                    pipe.hset(self._key(job_id), mapping=fields)
                    if shards:
                        pipe.hset(self._key(job_id, "plan"), mapping=plan)
                        pipe.hset(self._key(job_id, "state"),
                                  mapping=dict.fromkeys(plan, "queued"))
                    pipe.zadd(PREFIX + "jobs", {job_id: now.timestamp()})
                    pipe.sadd(PREFIX + "active", job_id)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def prepared(self, job_id: str) -> None:
        """The job's output directory is ready (create(preparing=True))."""
        self.r.hdel(self._key(job_id), "preparing_since")

    def preparing_for(self, job_id: str) -> float | None:
        """Seconds since a job still being prepared was recorded, or None."""
        since = self.r.hget(self._key(job_id), "preparing_since")
        return None if since is None else self.now().timestamp() - float(since)

    def create_failed(self, job_id: str, output: str, error: str, ttl_s: int) -> None:
        """The record of a job that could not be submitted (a beat firing whose inputs are
        missing, say): it ends at once, failed with `error`, and lists among the jobs."""
        now = self.now()
        fields = {"job_id": job_id, "state": "failed", "output": output, "error": error,
                  "created_at": iso(now), "finished_at": iso(now),
                  **{c: 0 for c in COUNTERS}}
        pipe = self.r.pipeline()
        pipe.hset(self._key(job_id), mapping=fields)
        pipe.expire(self._key(job_id), ttl_s)
        pipe.zadd(PREFIX + "jobs", {job_id: now.timestamp()})
        pipe.execute()

    def active_jobs(self) -> list[str]:
        """Jobs not yet final: what the periodic checks reconcile."""
        return sorted(self.r.smembers(PREFIX + "active"))

    def running_in(self, output: str) -> str | None:
        """An active job whose output directory is `output`, or None."""
        return self._active_in(self.r.smembers(PREFIX + "active"), output)

    def _active_in(self, jobs, output: str) -> str | None:
        """Of these jobs, the first (by id) whose output directory is `output`: their
        outputs in one round trip."""
        jobs = sorted(jobs)
        pipe = self.r.pipeline(transaction=False)
        for job_id in jobs:
            pipe.hget(self._key(job_id), "output")
        return next((j for j, out in zip(jobs, pipe.execute()) if out == output), None)

    def job_field(self, job_id: str, field: str) -> str | None:
        return self.r.hget(self._key(job_id), field)

    def drop_active(self, job_id: str) -> None:
        self.r.srem(PREFIX + "active", job_id)

    def set_final(self, job_id: str, **fields) -> None:
        """Record a job's end (its state among `fields`): it leaves the active set (and
        the finalizer's claim goes)."""
        self.set_fields(job_id, **fields)
        self.r.hdel(self._key(job_id), "finalizing_since")
        self.r.srem(PREFIX + "active", job_id)

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
        if not self.exists(job_id):   # (a record lost: no stray key without a TTL)
            return
        key = self._key(job_id, "info")
        info = json.loads(self.r.hget(key, shard_id) or "{}")
        self.r.hset(key, shard_id, json.dumps(info | fields))

    def lease_key(self, job_id: str, shard_id: str) -> str:
        return self._key(job_id, f"lease:{shard_id}")

    def lease_holder(self, job_id: str, shard_id: str) -> str | None:
        return self.r.get(self.lease_key(job_id, shard_id))

    def start_attempt(self, job_id: str, shard_id: str, token: str = "", ttl_s: float = 30,
                      take_over: str = "") -> int:
        """Take the shard's lease (as `token`, for ttl_s), count a delivery of the shard
        (before any work, so a crash still counts) and mark it and the job running. Returns
        the attempt number; -1 when another live worker holds the lease (this delivery is
        a duplicate: it must not run), -2 when the shard has already ended. `take_over` is
        the token of a holder known to be dead, whose lease may be replaced."""
        keys = [self._key(job_id), self._key(job_id, "state"), self._key(job_id, "attempts"),
                self.lease_key(job_id, shard_id), self._key(job_id, "owner")]
        return int(self._start(keys=keys, args=[shard_id, self.now_iso(), token,
                                                max(1, int(ttl_s * 1000)), take_over]))

    def renew_lease(self, job_id: str, shard_id: str, token: str, ttl_s: float) -> bool:
        """Extend the lease; False when it is no longer ours."""
        keys = [self._key(job_id, "state"), self.lease_key(job_id, shard_id),
                self._key(job_id, "owner")]
        return bool(self._renew(keys=keys, args=[shard_id, token, max(1, int(ttl_s * 1000))]))

    def requeue(self, job_id: str, shard_id: str, token: str = "") -> bool:
        """Put a running shard back to queued: as its lease holder (`token`) giving it up,
        or (no token) because its lease expired. True for the one caller that did it, which
        then sends the shard's task."""
        keys = [self._key(job_id, "state"), self.lease_key(job_id, shard_id),
                self._key(job_id, "owner"), self._key(job_id, "progress")]
        return bool(self._requeue(keys=keys, args=[shard_id, token]))

    def leases_alive(self, job_id: str, shard_ids: list[str]) -> dict[str, bool]:
        pipe = self.r.pipeline(transaction=False)
        for s in shard_ids:
            pipe.exists(self.lease_key(job_id, s))
        return dict(zip(shard_ids, map(bool, pipe.execute()), strict=True))

    def claim_finalize(self, job_id: str, stale_s: float = 60) -> bool:
        """True when every shard has ended and the job is not final, nor being finalized by
        someone who started less than stale_s ago: the caller finalizes."""
        keys = [self._key(job_id), self._key(job_id, "state")]
        return bool(self._claim_finalize(keys=keys, args=[stale_s]))

    def attempts(self, job_id: str, shard_id: str) -> int:
        return int(self.r.hget(self._key(job_id, "attempts"), shard_id) or 0)

    def progress(self, job_id: str, shard_id: str, token: str, finished: int,
                 tokens: int) -> bool:
        """Record a running shard's progress (requests finished, tokens generated) for its
        lease holder `token`; False, and nothing written, when the lease is not its own."""
        keys = [self._key(job_id, "owner"), self._key(job_id, "progress")]
        return bool(self._progress(keys=keys, args=[shard_id, token, f"{finished} {tokens}"]))

    def running_progress(self, job_id: str) -> dict[str, tuple[int, int]]:
        """shard -> (finished requests, generated tokens) of the shards being generated."""
        return {k: tuple(map(int, v.split()))
                for k, v in self.r.hgetall(self._key(job_id, "progress")).items()}

    def finish_shard(self, job_id: str, shard_id: str, outcome: str, requests_ok: int = 0,
                     requests_failed: int = 0, tokens: int = 0, ran: bool = True) -> int:
        """Record a shard's end once (ran: it ran now, rather than being found done).
        Returns 1 if it was the job's last shard (the caller finalizes), 0 if not, -1 if the
        shard had already ended (a redelivery), -2 if the job has no record."""
        keys = [self._key(job_id), self._key(job_id, "state"), self._key(job_id, "progress"),
                self.lease_key(job_id, shard_id), self._key(job_id, "owner")]
        return int(self._finish(keys=keys, args=[shard_id, outcome, requests_ok,
                                                 requests_failed, tokens,
                                                 "1" if ran else "0"]))

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
        tokens = job["tokens_run"] + sum(r[1] for r in running)
        start = raw.get("started_at")
        if start:
            end = raw.get("finished_at")
            end_t = dt.datetime.fromisoformat(end) if end else self.now()
            elapsed = max((end_t - dt.datetime.fromisoformat(start)).total_seconds(), 1e-9)
            job["tokens_per_s"] = throughput(tokens, elapsed)
            job["requests_per_s"] = throughput(job["requests_run"], elapsed)
        for k in ("summary", "failed_shards"):
            if k in job:
                job[k] = json.loads(job[k])
        return job

    def expire(self, job_id: str, seconds: int) -> None:
        """Let an ended job's keys go after `seconds` (its files stay in OUT)."""
        pipe = self.r.pipeline()
        for part in ("", "plan", "state", "info", "attempts", "progress", "owner"):
            pipe.expire(self._key(job_id, part), seconds)
        pipe.execute()

    def broker_messages(self, queue: str, max_age_s: float) -> list[str]:
        """The raw task messages waiting in the Celery queue `queue`, and those delivered to
        a worker less than max_age_s ago and not yet acknowledged (kombu's Redis transport
        keeps them in the `unacked` hash, their delivery times in `unacked_index`). An
        older unacknowledged message belongs to a worker that died with it, or is a shard
        already started (whose lease then speaks for it)."""
        cutoff = dt.datetime.now(dt.UTC).timestamp() - max_age_s
        recent = self.r.zrangebyscore("unacked_index", cutoff, "+inf")
        held = [m for m in (self.r.hmget("unacked", recent) if recent else []) if m]
        return self.r.lrange(queue, 0, -1) + held

    def recent(self, limit: int = 20) -> list[dict]:
        ids = self.r.zrevrange(PREFIX + "jobs", 0, limit - 1)
        jobs = {i: self.get(i) for i in ids}
        gone = [i for i, j in jobs.items() if j is None]
        if gone:  # expired records
            self.r.zrem(PREFIX + "jobs", *gone)
        return [j for j in jobs.values() if j is not None]
