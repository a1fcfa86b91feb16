"""Celery tasks: run one shard of a job, submit a scheduled job. Tasks take ids and paths;
the spec and the shard plan are read from the job store.

A worker process keeps one engine loaded (the models load on its first shard, never in the
worker's parent process) and reuses it for every shard with the same engine settings."""
from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import json
import logging
import os
import socket
import time

from batchspec.jobs.celery_app import app
from batchspec.jobs.runner import fail_shard, is_done, run_shard, start_job
from batchspec.jobs.spec import JobSpec, new_job_id
from batchspec.jobs.states import SHARD_ENDED
from batchspec.jobs.store import JobStore, now_iso
from batchspec.jobs.summary import finalize

log = logging.getLogger(__name__)
_engine: dict = {"key": None, "llm": None}
_stores: dict[str, JobStore] = {}


def get_store() -> JobStore:
    url = app.conf.broker_url
    if url not in _stores:
        _stores[url] = JobStore(url)
    return _stores[url]


def get_llm(spec: JobSpec):
    """The process's engine for this spec's settings; loaded once, replaced (not added to)
    when a job needs other models, so a GPU never holds two model sets."""
    config = spec.engine_config(device=os.environ.get("BATCHSPEC_DEVICE") or None)
    key = json.dumps(dataclasses.asdict(config), sort_keys=True)
    if _engine["key"] != key or _engine["llm"].engine.closed:
        _engine.update(key=None, llm=None)
        gc.collect()
        from batchspec.llm import LLM
        log.info("loading %s (drafts %s) on %s", config.model, config.drafts, config.device)
        _engine.update(key=key, llm=LLM.from_config(config))
    return _engine["llm"]


class Every:
    """Call fn at most every `interval` seconds; between calls, return the last result.
    Engine steps are milliseconds apart; Redis does not need to hear about each one."""

    def __init__(self, interval: float, fn):
        self.interval, self.fn, self.last, self.value = interval, fn, -1e18, None

    def __call__(self, *args):
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last, self.value = now, self.fn(*args)
        return self.value


def finalize_job(job_id: str) -> dict:
    store = get_store()
    job = store.get(job_id)
    states, info = store.shard_states(job_id), store.shard_info(job_id)
    failed = {s: info.get(s, {}).get("error", "") for s, st in states.items() if st == "failed"}
    cancelled = store.cancel_requested(job_id) and "cancelled" in states.values()
    finished = now_iso()
    timings = {"created_at": job["created_at"], "started_at": job.get("started_at"),
               "finished_at": finished}
    if job.get("started_at"):
        timings["wall_s"] = (dt.datetime.fromisoformat(finished)
                             - dt.datetime.fromisoformat(job["started_at"])).total_seconds()
    skipped = sorted(s for s, i in info.items() if i.get("skipped"))
    doc = finalize(store.spec(job_id), store.plan(job_id), job_id=job_id, timings=timings,
                   failed_shards=failed, cancelled=cancelled,
                   extra={"shards_skipped": skipped})
    store.set_fields(job_id, state=doc["state"], finished_at=finished,
                     summary=doc["summary"], failed_shards=failed)
    store.expire(job_id, int(float(os.environ.get("BATCHSPEC_JOB_TTL_DAYS", 30)) * 86400))
    return doc


def _end(job_id: str, shard_id: str, outcome: str, ok: int = 0, bad: int = 0,
         tokens: int = 0, **info) -> str:
    store = get_store()
    store.update_info(job_id, shard_id, finished_at=now_iso(), outcome=outcome, **info)
    if store.finish_shard(job_id, shard_id, outcome, ok, bad, tokens) == 1:
        finalize_job(job_id)
    return outcome


@app.task(bind=True, name="batchspec.run_shard", max_retries=None)
def run_shard_task(self, job_id: str, shard_id: str) -> str:
    store = get_store()
    if not store.exists(job_id):  # expired or deleted record: nothing to run it against
        log.warning("shard %s of unknown job %s dropped", shard_id, job_id)
        return "unknown_job"
    if store.shard_state(job_id, shard_id) in SHARD_ENDED:
        # A redelivery of an ended shard; finish a finalization a crash interrupted.
        if store.get(job_id)["state"] == "finalizing":
            finalize_job(job_id)
        return "duplicate"
    spec_dict, shard = store.spec(job_id), store.shard(job_id, shard_id)
    max_attempts = spec_dict["max_attempts"]
    if store.cancel_requested(job_id):
        return _end(job_id, shard_id, "cancelled")
    attempt = store.start_attempt(job_id, shard_id)
    store.update_info(job_id, shard_id, host=socket.gethostname(), pid=os.getpid(),
                      attempt=attempt, started_at=now_iso())
    if attempt > max_attempts:
        reason = (f"gave up after {max_attempts} attempts: the worker running this "
                  f"shard died or failed each time")
        fail_shard(spec_dict["output"], shard, reason)
        return _end(job_id, shard_id, "failed", bad=shard.num_rows, error=reason)
    try:
        # Inside the try: a spec this host cannot serve (model missing here) is retried,
        # possibly elsewhere, then failed like any other error.
        spec = JobSpec.from_dict(spec_dict)
        llm = None if is_done(spec, shard) else get_llm(spec)
        result = run_shard(
            spec, shard, llm, job_id=job_id,
            should_abort=Every(0.5, lambda: store.cancel_requested(job_id)),
            on_progress=Every(0.5, lambda n, t: store.progress(job_id, shard_id, n, t)))
    except Exception as e:
        log.exception("shard %s of job %s failed (attempt %d)", shard_id, job_id, attempt)
        if attempt < max_attempts:
            raise self.retry(exc=e, countdown=min(60, 2 ** attempt)) from e
        reason = f"{type(e).__name__}: {e}"
        fail_shard(spec_dict["output"], shard, reason)
        return _end(job_id, shard_id, "failed", bad=shard.num_rows, error=reason)
    if result.status == "aborted":
        return _end(job_id, shard_id, "cancelled")
    return _end(job_id, shard_id, "completed", result.num_completed, result.num_errors,
                result.num_tokens, skipped=result.status == "skipped", wall_s=result.wall_s)


def submit_job(spec: JobSpec, shards: list | None = None) -> str:
    """Store the job and enqueue one task per shard (`shards`: the job's plan, when the
    caller has made it). Returns the job id."""
    spec.job_id = spec.job_id or new_job_id(spec.name)
    shards = start_job(spec, shards)
    store = get_store()
    store.create(spec.job_id, spec.to_dict(), shards)
    for shard in shards:
        run_shard_task.apply_async((spec.job_id, shard.id))
    if not shards:
        store.set_fields(spec.job_id, state="finalizing")
        finalize_job(spec.job_id)
    return spec.job_id


@app.task(name="batchspec.submit_scheduled")
def submit_scheduled(config_path: str) -> str:
    """A beat firing: the job YAML with today's dates filled into its paths."""
    job_id = submit_job(JobSpec.build(config=config_path))
    log.info("scheduled job %s from %s submitted", job_id, config_path)
    return job_id
