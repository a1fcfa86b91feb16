"""Prometheus metrics of `batchspec run` and `batchspec worker` (`--metrics-port`, off by
default). docs/operations.md lists the series.

The engine knows nothing of them: the job layer reports what it sees. ShardDriver
(jobs/runner.py) calls `on_step` around each engine step (step time, KV cache usage, rows
waiting and running) and `on_shard` when it writes a shard (rows and tokens by job and
state, the shard's duration, and per request its drafted / accepted tokens, fallback and
confidence skips, by draft and domain).

Processes. `batchspec run` serves its own registry. A Celery worker runs shards in pool
children (prefork), so it uses prometheus_client's multiprocess mode: the worker's main
process sets PROMETHEUS_MULTIPROC_DIR to a fresh folder before anything loads
prometheus_client, each child writes its samples there, and the main process serves the
sum of them (plus the Celery queue depth, read from Redis at scrape time) on the port. The
same holds for `--pool solo`, where the main process runs the shards itself.

When metrics are off, nothing here imports prometheus_client and the hooks return at once."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

ENV_ON = "BATCHSPEC_METRICS"            # "1" in processes that record metrics
ENV_DIR = "PROMETHEUS_MULTIPROC_DIR"    # prometheus_client's multiprocess folder
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SHARD_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)

_metrics = None


class Metrics:
    """Every series, in one registry (in multiprocess mode, values go to the folder)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = CollectorRegistry()
        r = self.registry
        self.rows = Counter("batchspec_rows", "Input rows ended, by job and state "
                            "(completed: in outputs/; failed: in errors/).",
                            ["job", "state"], registry=r)
        self.tokens = Counter("batchspec_generated_tokens", "Tokens generated, by job.",
                              ["job"], registry=r)
        self.prompt_tokens = Counter("batchspec_prompt_tokens", "Prompt tokens of finished "
                                     "requests, by job.", ["job"], registry=r)
        self.shards = Counter("batchspec_shards", "Shards written, by job.", ["job"], registry=r)
        self.shard_seconds = Histogram("batchspec_shard_duration_seconds",
                                       "From reading a shard to writing its outputs.",
                                       buckets=SHARD_BUCKETS, registry=r)
        self.drafted = Counter("batchspec_spec_drafted_tokens", "Draft tokens proposed, by "
                               "draft and domain.", ["draft", "domain"], registry=r)
        self.accepted = Counter("batchspec_spec_accepted_tokens", "Draft tokens accepted, by "
                                "draft and domain.", ["draft", "domain"], registry=r)
        self.fallbacks = Counter("batchspec_spec_fallbacks", "Requests that fell back to plain "
                                 "decoding (acceptance too low).", ["draft", "domain"],
                                 registry=r)
        self.skips = Counter("batchspec_spec_confidence_skips", "Draft rounds cut short by the "
                             "confidence threshold.", ["draft", "domain"], registry=r)
        self.requests = Counter("batchspec_spec_requests", "Finished requests, by draft and "
                                "domain (draft 'none': plain decoding).", ["draft", "domain"],
                                registry=r)
        self.step_seconds = Histogram("batchspec_engine_step_seconds", "Wall time of one "
                                      "engine step (schedule, draft, verify, commit).",
                                      buckets=STEP_BUCKETS, registry=r)
        self.kv_usage = Gauge("batchspec_kv_cache_usage_ratio", "Used / total KV cache "
                              "blocks after the last step.", registry=r,
                              multiprocess_mode="livemax")
        self.engine_rows = Gauge("batchspec_engine_requests", "Requests in the engine, by "
                                 "state (waiting, running).", ["state"], registry=r,
                                 multiprocess_mode="livesum")


def get() -> Metrics | None:
    """This process's metrics, or None when they are off."""
    global _metrics
    if _metrics is None and os.environ.get(ENV_ON) == "1":
        _metrics = Metrics()
    return _metrics


def draft_label(draft: str | None) -> str:
    """A draft as people name it: its directory's name, 'ngram', or 'none' (plain)."""
    from batchspec.jobs.display import draft_name
    return draft_name(draft) or "none"


def on_step(llm, seconds: float) -> None:
    m = get()
    if m is None:
        return
    m.step_seconds.observe(seconds)
    engine = llm.engine
    blocks = engine.block_manager
    m.kv_usage.set(1 - blocks.num_free_blocks / blocks.num_blocks)
    m.engine_rows.labels("waiting").set(len(engine.scheduler.waiting))
    m.engine_rows.labels("running").set(len(engine.scheduler.running))


def on_shard(job_id: str, outputs: list[dict], records: list[dict], num_errors: int,
             seconds: float) -> None:
    m = get()
    if m is None:
        return
    m.rows.labels(job_id, "completed").inc(len(outputs))
    m.rows.labels(job_id, "failed").inc(num_errors)
    m.tokens.labels(job_id).inc(sum(o["num_output_tokens"] for o in outputs))
    m.prompt_tokens.labels(job_id).inc(sum(o["num_prompt_tokens"] for o in outputs))
    m.shards.labels(job_id).inc()
    m.shard_seconds.observe(seconds)
    for r in records:
        labels = (draft_label(r["draft"]), r["domain"] or "")
        m.requests.labels(*labels).inc()
        m.drafted.labels(*labels).inc(r["total_drafted"])
        m.accepted.labels(*labels).inc(r["total_accepted"])
        m.skips.labels(*labels).inc(r["skipped_by_confidence"])
        m.fallbacks.labels(*labels).inc(bool(r["fallback_triggered"]))


def serve_local(port: int) -> None:
    """`batchspec run`: record metrics in this process and serve them on `port`."""
    os.environ[ENV_ON] = "1"
    _listen(port, get().registry)


def serve_worker(port: int, redis_url: str, queue: str) -> str:
    """`batchspec worker`: multiprocess mode for the pool, served from this process. Call it
    before the pool starts (children inherit the environment). Returns the folder."""
    folder = tempfile.mkdtemp(prefix="batchspec-metrics-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ[ENV_DIR] = folder
    os.environ[ENV_ON] = "1"
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    registry.register(QueueDepth(redis_url, queue))
    _listen(port, registry)
    _mark_dead_children()
    return folder


def _listen(port: int, registry) -> None:
    from prometheus_client import start_http_server
    try:
        start_http_server(port, registry=registry)
    except OSError as e:
        raise ValueError(f"cannot serve metrics on port {port}: {e.strerror or e}") from e


def _mark_dead_children() -> None:
    """Drop the live gauges of a pool child when it exits (it may be replaced)."""
    from celery.signals import worker_process_shutdown

    @worker_process_shutdown.connect(weak=False)
    def _dead(pid=None, **_):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(pid or os.getpid())


class QueueDepth:
    """batchspec_queue_depth: shard tasks waiting in the Celery queue (Redis list length),
    read when scraped."""

    def __init__(self, redis_url: str, queue: str):
        self.redis_url, self.queue, self.client = redis_url, queue, None

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        family = GaugeMetricFamily("batchspec_queue_depth",
                                   "Shard tasks waiting in the Celery queue.")
        try:
            if self.client is None:
                from batchspec.jobs.store import redis_client
                self.client = redis_client(self.redis_url)
            family.add_metric([], self.client.llen(self.queue))
        except Exception:  # Redis away: no sample rather than a failed scrape
            return []
        return [family]
