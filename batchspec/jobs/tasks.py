"""Celery tasks: run one shard of a job, submit a scheduled job; and the checks that carry a
job to its end through worker deaths and Redis restarts. Tasks take ids and paths; the spec
and the shard plan are read from the job store.

A worker process keeps one engine loaded (the models load on its first shard, never in the
worker's parent process) and reuses it for every shard with the same engine settings.

A shard runs under a lease (batchspec.jobs.lease). `reconcile(job_id)` brings a job
forward from whatever Redis holds and what the output directory says: it re-queues running
shards whose lease expired, records shards whose outputs file exists (the commit point) as
completed, re-sends queued shards whose task message was lost, and finalizes a job whose
shards have all ended. Every worker runs it periodically on the active jobs, and so do
beat, `batchspec status` and `submit --wait`."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import pyarrow.parquet as pq
from celery.signals import worker_process_shutdown

from batchspec.jobs.celery_app import QUEUE, app
from batchspec.jobs.lease import Lease, check_interval, holder_is_dead, lease_renew, lease_ttl
from batchspec.jobs.lease import new_token as new_lease_token
from batchspec.jobs.outputs import output_fs, shard_counts, shard_path
from batchspec.jobs.runner import (
    ShardDriver,
    ShardWork,
    fail_shard,
    is_done,
    plan_job,
    run_shard,
)
from batchspec.jobs.shards import InputChanged, Shard
from batchspec.jobs.spec import JobSpec, load_yaml, new_job_id, resolve_paths
from batchspec.jobs.states import FINAL, SHARD_ENDED
from batchspec.jobs.store import JobStore, output_busy
from batchspec.jobs.summary import check_output, claim_output, clear_output, finalize

log = logging.getLogger(__name__)
_engine: dict = {"key": None, "llm": None}
_stores: dict[tuple[str, float], JobStore] = {}

# How long a worker keeps retrying a Redis command before giving up on it (a Redis restart
# takes seconds; past this, lease expiry and reconcile() recover whatever was left undone).
WORKER_REDIS_RETRY_S = 40.0
# Longest wait before a failed shard's next attempt (2 ** attempt seconds, capped).
RETRY_BACKOFF_MAX_S = 60
# How long a job recorded by a submit may stay `preparing` (its output directory cleared
# and claimed: milliseconds) before a check takes its submitter for dead (submit_job).
PREPARE_TIMEOUT_S = 60


def get_store(retry_s: float = 0) -> JobStore:
    """The job store at the app's broker URL. Commands that cannot reach Redis are retried
    for about retry_s seconds (workers wait out a Redis restart; the CLI fails fast)."""
    key = (app.conf.broker_url, retry_s)
    if key not in _stores:
        _stores[key] = JobStore(key[0], retry_s)
    return _stores[key]


def worker_store() -> JobStore:
    return get_store(WORKER_REDIS_RETRY_S)


def get_llm(spec: JobSpec):
    """The process's engine for this spec's settings; loaded once, replaced (not added to)
    when a job needs other models, so a GPU never holds two model sets."""
    config = spec.engine_config(device=os.environ.get("BATCHSPEC_DEVICE") or None)
    key = json.dumps(dataclasses.asdict(config), sort_keys=True)
    if _engine["key"] != key or _engine["llm"].engine.closed:
        _engine.update(key=None, llm=None)
        gc.unfreeze()   # the engine dropped was frozen with the heap at its load
        gc.collect()
        from batchspec.llm import LLM, freeze_heap
        log.info("loading %s (drafts %s) on %s", config.model, config.drafts, config.device)
        _engine.update(key=key, llm=LLM.from_config(config))
        freeze_heap()
    return _engine["llm"]


class Every:
    """Call fn at most every `interval` seconds, in the caller's thread; between calls,
    return the last result. A call that fails (Redis unreachable) is logged and returns
    `default`. For loops that may wait on Redis (`submit --wait`'s checks); a running shard
    asks Redis from threads of its own instead (InBackground)."""

    def __init__(self, interval: float, fn, default=None):
        self.interval, self.fn, self.last, self.value = interval, fn, -1e18, default
        self.default = default

    def __call__(self, *args):
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            try:
                self.value = self.fn(*args)
            except Exception as e:
                log.warning("job store unreachable: %s", e)
                self.value = self.default
        return self.value


class InBackground:
    """fn(*args) in a thread of its own: at the first call, then every `interval` seconds,
    with the arguments of the latest call; a call returns at once with fn's last result
    (`default` until it has one). For what a running shard asks of Redis between engine
    steps (cancel checks, progress reports): asked by the engine's own thread, as `Every`
    does, a Redis that answered slowly stalled the shard as long: a worker whose path to
    Redis hung for 10 s lost 9.5 s of a 7 s shard. A failure is logged once until a call
    succeeds again. stop() ends the thread."""

    def __init__(self, interval: float, fn, default=None, name: str = "batchspec-redis"):
        self.interval, self.fn, self.value = interval, fn, default
        self._args: tuple | None = None
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def __call__(self, *args):
        first = self._args is None
        self._args = args
        if first:
            self._wake.set()
        return self.value

    def _run(self) -> None:
        failing = False
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            args = self._args
            if args is None:
                continue
            try:
                self.value = self.fn(*args)
                failing = False
            except Exception as e:
                if not failing:
                    log.warning("a job store call failed (%s); it is tried again every "
                                "%.1f s", e, self.interval)
                failing = True

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()


# --- ending shards and jobs -------------------------------------------------------------

def finalize_job(job_id: str, store: JobStore | None = None) -> dict:
    """Write `_job.json` (and `_SUCCESS`) from the output directory and record the job's
    final state and counts (counted from the files, whatever Redis' counters say). A job
    whose `_job.json` cannot be written ends `failed` with the reason."""
    store = store or worker_store()
    job = store.get(job_id)
    states, info = store.shard_states(job_id), store.shard_info(job_id)
    failed = {s: info.get(s, {}).get("error", "") for s, st in states.items() if st == "failed"}
    cancelled = store.cancel_requested(job_id) and "cancelled" in states.values()
    finished = store.now_iso()
    timings = {"created_at": job["created_at"], "started_at": job.get("started_at"),
               "finished_at": finished}
    if job.get("started_at"):
        timings["wall_s"] = (dt.datetime.fromisoformat(finished)
                             - dt.datetime.fromisoformat(job["started_at"])).total_seconds()
    skipped = sorted(s for s, i in info.items() if i.get("skipped"))
    try:
        doc = finalize(store.spec(job_id), store.plan(job_id), job_id=job_id,
                       timings=timings, failed_shards=failed, cancelled=cancelled,
                       extra={"shards_skipped": skipped}, tokens_run=job["tokens_run"])
    except Exception as e:
        log.exception("job %s: could not write its summary", job_id)
        error = f"could not write _job.json: {type(e).__name__}: {e}"
        store.set_final(job_id, state="failed", finished_at=finished, failed_shards=failed,
                        error=error)
        return {"job_id": job_id, "state": "failed", "error": error}
    store.set_final(job_id, state=doc["state"], finished_at=finished, summary=doc["summary"],
                    failed_shards=failed, tokens_generated=doc["summary"]["tokens_generated"],
                    **({"error": doc["error"]} if doc.get("error") else {}), **doc["counts"])
    store.expire(job_id, job_ttl_s())
    log.info("job %s %s", job_id, doc["state"])
    return doc


def job_ttl_s() -> int:
    """How long an ended job's record stays in Redis (BATCHSPEC_JOB_TTL_DAYS, default 30)."""
    return int(float(os.environ.get("BATCHSPEC_JOB_TTL_DAYS", 30)) * 86400)


def _end(job_id: str, shard_id: str, outcome: str, ok: int = 0, bad: int = 0,
         tokens: int = 0, **info) -> str:
    store = worker_store()
    store.update_info(job_id, shard_id, finished_at=store.now_iso(), outcome=outcome, **info)
    ended = store.finish_shard(job_id, shard_id, outcome, ok, bad, tokens,
                               ran=not info.get("skipped"))
    if ended == 1:
        finalize_job(job_id, store)
    elif ended == -2:
        log.warning("shard %s of job %s ended %s, but the job has no record (Redis lost "
                    "it): submit the job again to finish it; its written shards are kept",
                    shard_id, job_id, outcome)
    return outcome


def end_failed(job_id: str, output: str, shard: Shard, reason: str) -> str:
    """End a shard as failed whatever else is broken: its rows go to its errors file with
    the reason (`shard_failed`) if that can be written, and the job store records the end
    either way. Should the store be unreachable too, the shard's lease expires
    and a later delivery ends it."""
    try:
        fail_shard(output, shard, reason)
    except Exception as e:  # a full disk, say: the store still records the end
        log.exception("errors file of shard %s of job %s not written", shard.id, job_id)
        reason = f"{reason}; errors file not written ({type(e).__name__}: {e})"
    return _end(job_id, shard.id, "failed", bad=shard.num_rows, error=reason)


def give_back(job_id: str, shard: Shard, output: str, token: str, attempt: int,
              max_attempts: int, exc: Exception) -> str:
    """A shard whose attempt raised: put it back to queued and send it again after a
    backoff, or, at its last attempt, end it failed. If Redis cannot be reached, the shard
    is recovered anyway: a running shard's lease expires, and a queued shard whose message
    is missing is sent again by reconcile(). An input file no longer the version the job
    was planned on fails the shard at once: no retry would read the planned rows."""
    if attempt >= max_attempts or isinstance(exc, InputChanged):
        return end_failed(job_id, output, shard, f"{type(exc).__name__}: {exc}")
    try:
        if worker_store().requeue(job_id, shard.id, token):
            run_shard_task.apply_async((job_id, shard.id),
                                       countdown=min(RETRY_BACKOFF_MAX_S, 2 ** attempt))
    except Exception as e:
        log.warning("shard %s of job %s not re-sent (%s); it will be by the periodic check",
                    shard.id, job_id, e)
    return "retry"


# --- the shard task ---------------------------------------------------------------------

def streaming() -> bool:
    """BATCHSPEC_STREAM=1 (`batchspec worker --stream`): keep one engine full across shard
    tasks (see Stream)."""
    return os.environ.get("BATCHSPEC_STREAM", "") not in ("", "0", "false", "no")


@app.task(name="batchspec.run_shard", ignore_result=True)
def run_shard_task(job_id: str, shard_id: str) -> str:
    store = worker_store()
    if not store.exists(job_id):  # expired or deleted record: nothing to run it against
        log.warning("shard %s of unknown job %s dropped", shard_id, job_id)
        return "unknown_job"
    if store.shard_state(job_id, shard_id) in SHARD_ENDED:
        reconcile(job_id, store)  # a redelivery: finish a finalization a crash interrupted
        return "duplicate"
    spec_dict, shard = store.spec(job_id), store.shard(job_id, shard_id)
    max_attempts = spec_dict["max_attempts"]
    started = store.now_iso()  # cleared to start: a cancel from now on stops it between steps
    if store.cancel_requested(job_id):
        return _end(job_id, shard_id, "cancelled")
    if STREAM.has(job_id, shard_id):  # in flight in this very process
        return "duplicate"
    token, ttl = new_lease_token(), lease_ttl()
    holder = store.lease_holder(job_id, shard_id)
    taken_at = time.monotonic()
    attempt = store.start_attempt(job_id, shard_id, token, ttl,
                                  take_over=holder if holder_is_dead(holder) else "")
    if attempt < 0:  # ended meanwhile, or running under another worker's live lease
        log.info("shard %s of job %s is %s: duplicate delivery dropped", shard_id, job_id,
                 "ended" if attempt == -2 else f"held by {holder}")
        return "duplicate"
    quick = get_store()  # no retries: a Redis outage must not stall engine steps
    lease = Lease(quick, job_id, shard_id, token, ttl, lease_renew(), taken_at).start()
    cancelled = InBackground(0.5, lambda: quick.cancel_requested(job_id), False)
    report = InBackground(0.5, lambda n, t: quick.progress(job_id, shard_id, token, n, t))
    handed_over = False
    try:
        store.update_info(job_id, shard_id, host=socket.gethostname(), pid=os.getpid(),
                          attempt=attempt, started_at=started)
        # Inside the try: a spec this host cannot serve (model missing here) is retried,
        # possibly elsewhere, then failed like any other error.
        spec = JobSpec.from_dict(spec_dict)
        done = is_done(spec, shard)
        if attempt > max_attempts and not done:
            return end_failed(job_id, spec.output, shard, (
                f"gave up after {max_attempts} attempts: the worker running this shard "
                f"died or failed each time"))
        if streaming() and not done:
            handed_over = True  # the stream ends the shard and stops its lease
            return STREAM.add(Flight(job_id, shard, spec, token, attempt, lease))
        result = run_shard(
            spec, shard, None if done else get_llm(spec), job_id=job_id,
            should_abort=lambda: lease.lost or cancelled(),
            on_progress=report, may_write=lease.held)
    except Exception as e:
        handed_over = False
        log.exception("shard %s of job %s failed (attempt %d)", shard_id, job_id, attempt)
        return give_back(job_id, shard, spec_dict["output"], token, attempt, max_attempts, e)
    finally:
        cancelled.stop()
        report.stop()
        if not handed_over:
            lease.stop()
    if result.status == "aborted":
        if lease.lost:  # re-queued by a check that saw our lease expire: not ours now
            return "lease_lost"
        return _end(job_id, shard_id, "cancelled")
    return _end(job_id, shard_id, "completed", result.num_completed, result.num_errors,
                result.num_tokens, skipped=result.status == "skipped", wall_s=result.wall_s)


# --- the streaming worker ---------------------------------------------------------------

@dataclasses.dataclass
class Flight:
    """A shard handed to the stream: what it takes to end it."""
    job_id: str
    shard: Shard
    spec: JobSpec
    token: str
    attempt: int
    lease: Lease
    work: ShardWork | None = None
    # set once every row of the shard is admitted to the batch (or the shard ended, or the
    # stream could not take it: `error`); its task then returns
    handed: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Exception | None = None


class Stream:
    """The streaming worker (BATCHSPEC_STREAM=1): one engine per worker process kept full
    across shard tasks, as `batchspec run` keeps it across shards. A shard task hands its
    shard to the process's stream thread and returns as soon as every row queued so far has
    been admitted to the batch, so Celery hands the process the next shard while this one's
    tail is still generating. The stream thread alone touches the engine: it queues handed
    shards in its ShardDriver between steps, steps, and, when a shard's last row finishes,
    writes its files and records its end. The lock guards only the hand-over; a step runs
    outside it (a thread stepping under it held it nearly all the time, and a task waiting
    for it could wait through a whole shard: shards then ran one after another).

    The lease, not the task message, says who runs a shard: a task's message is
    acknowledged when it hands its shard over, and the shard stays `running` under a lease
    renewed until its end is recorded. A worker killed with shards in flight loses their
    leases, and they are re-queued (counted as attempts) like any other. Shards of one job
    stream together; a shard of another job waits until the engine has drained. A cancelled
    job's shards in flight stop between steps and write nothing; its queued shards do not
    start (the task's usual check)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.job_id: str | None = None          # the job whose shards stream now
        self.pending: list[Flight] = []         # handed over, not yet queued in the engine
        self.flights: dict[str, Flight] = {}    # queued in the engine
        self.thread: threading.Thread | None = None
        self.stopping = False
        # the stream thread's own: the engine's driver and its job's periodic checks
        self.driver: ShardDriver | None = None
        self.cancelled = None
        self.progress = None

    def has(self, job_id: str, shard_id: str) -> bool:
        with self.cond:
            return self.job_id == job_id and (
                shard_id in self.flights or any(f.shard.id == shard_id for f in self.pending))

    def add(self, flight: Flight) -> str:
        """Hand the shard to the stream; return once its rows are all admitted (or the
        shard ended). Raises what kept the stream from taking it (the model cannot load)."""
        with self.cond:
            self.cond.wait_for(lambda: self.job_id in (None, flight.job_id))
            self.job_id = flight.job_id
            self.pending.append(flight)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, daemon=True,
                                               name="batchspec-stream")
                self.thread.start()
            self.cond.notify_all()
            thread = self.thread
        while not flight.handed.wait(1.0):
            if not thread.is_alive() and not self.stopping:  # (a bug): give it back
                raise RuntimeError("the stream thread has stopped")
        if flight.error is not None:
            raise flight.error
        return "streaming"

    def _holds(self, work: ShardWork) -> bool:
        """Whether this worker still holds the lease of the shard whose files are due."""
        flight = self.flights.get(work.shard.id)
        return flight is None or flight.lease.held()

    def _report(self) -> None:
        quick = get_store()
        with self.cond:
            flights = list(self.flights.values())
        for f in flights:
            quick.progress(f.job_id, f.shard.id, f.token, len(f.work.seqs) - f.work.left, 0)

    def _drop_driver(self) -> None:
        """Forget the engine's driver (the stream has drained, or stops) and stop its job's
        checks."""
        for poller in (self.cancelled, self.progress):
            if poller is not None:
                poller.stop()
        self.driver = self.cancelled = self.progress = None

    def _queue(self, flight: Flight) -> list[tuple[Flight, str, Exception | None]]:
        """Queue a handed shard's rows in the engine (the stream thread's, between steps)."""
        try:
            if self.driver is None:
                quick, job_id = get_store(), flight.job_id
                self.driver = ShardDriver(flight.spec, get_llm(flight.spec), job_id,
                                          may_write=self._holds)
                self.cancelled = InBackground(0.5, lambda: quick.cancel_requested(job_id),
                                              False)
                self.progress = InBackground(0.5, self._report)
            flight.work = self.driver.add(flight.shard)
        except Exception as e:  # the task gives the shard back
            flight.error = e
            flight.handed.set()
            return []
        if flight.work.result is not None:  # no valid rows: written already
            return [(flight, "completed", None)]
        with self.cond:
            self.flights[flight.shard.id] = flight
        return []

    def _step(self) -> list[tuple[Flight, str, Exception | None]]:
        """One engine step, or the end of every shard in flight (cancelled, or the step
        failed)."""
        if self.cancelled():
            self.driver.abort()
            return self._take_all("cancelled")
        try:
            written, _ = self.driver.step()
        except Exception as e:  # the step failed: every shard in flight
            log.exception("engine step failed")
            try:
                self.driver.abort()
            except Exception:  # a closed engine: get_llm() reloads it
                log.exception("engine abort failed")
            return self._take_all("failed", e)
        with self.cond:
            ended = [(self.flights.pop(w.shard.id),
                      "lease_lost" if w.result.status == "aborted" else "completed", None)
                     for w in written]
        self.progress()
        return ended

    def _take_all(self, outcome: str, exc: Exception | None = None,
                  also: list[Flight] = ()) -> list[tuple[Flight, str, Exception | None]]:
        """End every shard in flight (and `also`: shards being queued) with outcome."""
        with self.cond:
            flights = {**self.flights, **{f.shard.id: f for f in also if not f.handed.is_set()}}
            self.flights.clear()
        return [(f, outcome, exc) for f in flights.values()]

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.flights or self.pending or self.stopping)
                if self.stopping:
                    return
                new, self.pending = self.pending, []
            try:
                ended = [e for f in new for e in self._queue(f)]
                if self.flights:
                    ended += self._step()
                wants_more = not self.flights or self.driver.wants_more()
            except Exception as e:  # (a bug) every shard here is given back, none stranded
                log.exception("stream thread failed")
                try:
                    if self.driver is not None:
                        self.driver.abort()
                except Exception:
                    log.exception("engine abort failed")
                ended = self._take_all("failed", e, new)
                wants_more = True
            with self.cond:
                if not self.flights and not self.pending:
                    self._drop_driver()
                    self.job_id = None
                self.cond.notify_all()
            for f in [f for f, _, _ in ended] + (list(self.flights.values()) if wants_more
                                                 else []):
                if not f.handed.is_set():
                    f.handed.set()
            for f, outcome, exc in ended:
                self._record(f, outcome, exc)

    def _record(self, f: Flight, outcome: str, exc: Exception | None) -> None:
        """Record a shard's end (outside the lock: Redis and finalizing take time). If the
        store cannot be reached, its lease expires and reconcile() records it."""
        try:
            if outcome == "failed":
                give_back(f.job_id, f.shard, f.spec.output, f.token, f.attempt,
                          f.spec.max_attempts, exc)
            elif outcome == "cancelled":
                _end(f.job_id, f.shard.id, "cancelled")
            elif outcome == "lease_lost":   # another worker has the shard now
                log.info("shard %s of job %s left to the worker that holds it now",
                         f.shard.id, f.job_id)
            else:
                r = f.work.result
                _end(f.job_id, f.shard.id, "completed", r.num_completed, r.num_errors,
                     r.num_tokens, wall_s=r.wall_s)
        except Exception:
            log.exception("end of shard %s of job %s not recorded", f.shard.id, f.job_id)
        finally:
            f.lease.stop()

    def release(self, timeout_s: float = 60) -> None:
        """Worker shutdown: stop the stream thread after its step and give every shard in
        flight or handed over back (queued, sent again), so another worker takes it now
        rather than when its lease expires. A step still running after timeout_s leaves
        its shards to their leases."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                log.warning("engine step still running at shutdown: shards in flight are "
                            "left to their leases")
                with self.cond:
                    for f in [*self.flights.values(), *self.pending]:
                        f.handed.set()
                return
        with self.cond:
            flights = list(self.flights.values()) + self.pending
            self.flights.clear()
            self.pending = []
            self.job_id = None
        if self.driver is not None:
            self.driver.abort()
            self._drop_driver()
        for f in flights:
            try:
                if worker_store().requeue(f.job_id, f.shard.id, f.token):
                    run_shard_task.apply_async((f.job_id, f.shard.id))
            except Exception as e:
                log.warning("shard %s of job %s not given back (%s): its lease will expire",
                            f.shard.id, f.job_id, e)
            f.lease.stop()
            f.handed.set()


STREAM = Stream()


@worker_process_shutdown.connect
def _release_stream(**_):
    STREAM.release()


def refuse_busy_output(store: JobStore, output: str) -> None:
    """Raise OutputBusy when a job not yet final writes to `output`: two jobs in one
    directory would run its shards twice over. `submit` asks before it clears or writes
    anything; a beat firing asks before it submits (its refusal is a failed job's record).
    JobStore.create asks again in the transaction that records the job, so that of two
    jobs past this check at the same instant one is refused."""
    busy = store.running_in(output)
    if busy is not None:
        raise output_busy(busy, output)


def submit_job(spec: JobSpec, shards: list | None = None, overwrite: bool = False,
               stop: Callable[[], bool] | None = None) -> str:
    """Store the job and enqueue one task per shard (`shards`: the job's plan, when the
    caller has made it); `overwrite` clears the output directory's job files first. Returns
    the job id. `stop`, asked before each task is sent: True leaves the tasks not yet sent
    to the workers' periodic check, which sends a queued shard's task when none carries it
    (`submit` stops so when Ctrl-C comes while it sends them).

    The record comes first: JobStore.create claims the output directory in one transaction
    (OutputBusy when an active job writes there), and only then are its files cleared and
    its plan written. Cleared before the record, a `submit --overwrite` that lost the claim
    to a job started in the same instant had already removed that job's outputs. Until the
    directory is ready the job is `preparing`: no check sends its tasks, which would run on
    the old job's files, and one whose submitter died meanwhile is ended failed by reconcile
    after PREPARE_TIMEOUT_S. A failure in between (the directory cannot be cleared or
    written, Ctrl-C) ends the job failed with the reason at once, so that it does not hold
    the directory."""
    spec.job_id = spec.job_id or new_job_id(spec.name)
    shards = plan_job(spec) if shards is None else shards
    check_output(spec.to_dict(), shards, overwrite=overwrite)     # read-only: raises first
    store = get_store()
    store.create(spec.job_id, spec.to_dict(), shards, preparing=True)
    try:
        if overwrite:
            clear_output(spec.output)
        claim_output(spec.to_dict(), shards)
    except BaseException as e:
        store.set_final(spec.job_id, state="failed", finished_at=store.now_iso(),
                        error=f"could not prepare {spec.output}: {type(e).__name__}: {e}")
        raise
    store.prepared(spec.job_id)
    for shard in shards:
        if stop is not None and stop():
            break
        run_shard_task.apply_async((spec.job_id, shard.id))
    if not shards:
        store.set_fields(spec.job_id, state="finalizing")
        finalize_job(spec.job_id, store)
    return spec.job_id


@app.task(name="batchspec.submit_scheduled", ignore_result=True)
def submit_scheduled(config_path: str, base_dir: str | None = None) -> str:
    """A beat firing: the job YAML with today's dates filled into its paths, relative paths
    joined to base_dir (the directory beat runs in). A firing that cannot be submitted
    (tonight's inputs missing, a model gone) is recorded as a failed job with the reason,
    so that `batchspec jobs` shows it: in the worker's log alone, a nightly job that never
    ran looked like one that was never due."""
    try:
        spec = JobSpec.build(config=config_path, base_dir=base_dir)
        refuse_busy_output(worker_store(), spec.output)
        job_id = submit_job(spec)
    except Exception as e:
        log.exception("scheduled job from %s could not be submitted", config_path)
        values = {}
        with contextlib.suppress(Exception):      # (the YAML itself may be what broke)
            values = load_yaml(config_path)
            values = resolve_paths(values, base_dir) if base_dir is not None else values
        name = values.get("name") or os.path.splitext(os.path.basename(config_path))[0]
        job_id = new_job_id(str(name))
        worker_store().create_failed(
            job_id, str(values.get("output") or ""),
            f"could not submit {config_path}: {type(e).__name__}: {e}", job_ttl_s())
        return job_id
    log.info("scheduled job %s from %s submitted", job_id, config_path)
    return job_id


# --- reconciling a job with its output directory ----------------------------------------

# (job, shard) -> when a queued shard was first seen without a task message
_missing_since: dict[tuple[str, str], float] = {}


def _record_done(store: JobStore, job_id: str, output: str, shard_id: str) -> bool:
    """If the shard's outputs file exists, record the shard completed (counted from its
    files) and return True."""
    shard = store.shard(job_id, shard_id)
    fs, root = output_fs(output)
    path = shard_path(root, "outputs", shard)
    if not fs.exists(path):
        return False
    ok, bad = shard_counts(fs, root, shard)
    with fs.open(path, "rb") as f:
        tokens = sum(pq.read_table(f, columns=["num_output_tokens"])
                     .column(0).to_pylist())
    ended = store.finish_shard(job_id, shard_id, "completed", ok, bad, tokens)
    if ended >= 0:      # (not a shard its own worker ended meanwhile)
        store.update_info(job_id, shard_id, finished_at=store.now_iso(), outcome="completed",
                          recovered=True)
    if ended == 1:
        finalize_job(job_id, store)
    return True


def _message_shards(store: JobStore) -> set[tuple[str, str]] | None:
    """(job, shard) of every run_shard task message in the queue or recently delivered to a
    worker (within twice the longest retry backoff); None while the queue is not empty (its
    messages are being consumed, and looking through them all would be costly)."""
    if store.r.llen(QUEUE):
        return None
    found = set()
    for raw in store.broker_messages(QUEUE, max_age_s=2 * RETRY_BACKOFF_MAX_S):
        try:
            msg = json.loads(raw)
            msg = msg[0] if isinstance(msg, list) else msg
            headers = msg.get("headers", {})
            if headers.get("task") == "batchspec.run_shard":
                found.add(tuple(ast.literal_eval(headers["argsrepr"]))[:2])
        except (ValueError, KeyError, TypeError, SyntaxError):
            continue
    return found


def _resend_lost(store: JobStore, job_id: str, queued: list[str]) -> list[str]:
    """Send again the tasks of queued shards that no message carries (lost in a Redis
    restart, or by a sender that died between recording and sending). A shard must be seen
    missing twice, a check interval apart: a message being delivered is briefly in neither
    place. A duplicate message is harmless (a shard runs under one lease)."""
    present = _message_shards(store)
    if present is None:
        return []
    now, resent = time.monotonic(), []
    for s in queued:
        key = (job_id, s)
        if key in present:
            _missing_since.pop(key, None)
        elif now - _missing_since.setdefault(key, now) >= check_interval():
            _missing_since.pop(key)
            run_shard_task.apply_async((job_id, s))
            resent.append(s)
    return resent


def reconcile(job_id: str, store: JobStore | None = None) -> str | None:
    """Bring the job forward (see the module docstring); returns its state. Safe to call
    from any number of processes at once: each step is a Lua script that one caller wins."""
    store = store or worker_store()
    state = store.job_field(job_id, "state")
    if state is None or state in FINAL:
        store.drop_active(job_id)
        return state
    preparing = store.preparing_for(job_id)
    if preparing is not None:       # its submitter prepares the output directory (submit_job)
        if preparing < PREPARE_TIMEOUT_S:
            return state
        store.set_final(job_id, state="failed", finished_at=store.now_iso(),
                        error="its submit stopped before the output directory was ready (the "
                              "command was killed?); nothing ran: submit the job again")
        return "failed"
    states = store.shard_states(job_id)
    running = [s for s, st in states.items() if st == "running"]
    output = store.job_field(job_id, "output")
    # A cancelled job's shards that no worker runs end cancelled here: with its workers
    # gone (or busy elsewhere), the job would otherwise stay `cancelling` until one took
    # each shard's task only to end it.
    cancelling = state == "cancelling"
    for s, alive in store.leases_alive(job_id, running).items():
        if alive or _record_done(store, job_id, output, s):
            continue
        if store.requeue(job_id, s):
            if cancelling:
                _end(job_id, s, "cancelled")
                continue
            log.warning("shard %s of job %s lost its worker (lease expired): re-queued", s,
                        job_id)
            store.update_info(job_id, s, requeued_at=store.now_iso())
            run_shard_task.apply_async((job_id, s))
    queued = [s for s, st in states.items() if st == "queued"]
    if cancelling:
        for s in queued:   # (a worker starting one meanwhile finds its lease gone, and stops)
            _end(job_id, s, "cancelled")
        queued = []
    for s in _resend_lost(store, job_id, queued):
        log.warning("shard %s of job %s had no task message: sent again", s, job_id)
    if store.claim_finalize(job_id):
        return finalize_job(job_id, store)["state"]
    return store.job_field(job_id, "state")


def try_reconcile(job_id: str, store: JobStore, say: Callable[[Exception], None]) -> None:
    """reconcile() for a command watching the job (`status`, `cancel`, `submit --wait`): a
    failure goes to `say` (the command's one line), and the command goes on showing what the
    store holds."""
    try:
        reconcile(job_id, store)
    except Exception as e:
        say(e)


def reconcile_active(store: JobStore | None = None) -> None:
    """reconcile() every job not yet final; errors are logged, never raised."""
    try:
        store = store or worker_store()
        jobs = store.active_jobs()
    except Exception as e:
        log.warning("periodic check: job store unreachable: %s", e)
        return
    for job_id in jobs:
        try:
            reconcile(job_id, store)
        except Exception:
            log.exception("periodic check of job %s failed", job_id)


def start_checker(url: str | None = None) -> threading.Thread:
    """A daemon thread running reconcile_active() every check_interval() seconds with its
    own connection (started in every worker's main process and in beat)."""
    store = JobStore(url or app.conf.broker_url, WORKER_REDIS_RETRY_S)
    interval = check_interval()

    def loop():
        while True:
            time.sleep(interval)
            reconcile_active(store)

    thread = threading.Thread(target=loop, daemon=True, name="batchspec-check")
    thread.start()
    return thread
