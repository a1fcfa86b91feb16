"""The Celery app: Redis broker and result backend, settings for long GPU shards.

Start a worker with `batchspec worker` (or `celery -A batchspec.jobs.celery_app worker`).
The broker URL comes from `--broker` or BATCHSPEC_REDIS_URL. See docs/operations.md for why
each setting is what it is."""
from __future__ import annotations

import os

from celery import Celery
from celery.signals import beat_init, worker_ready

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
QUEUE = "batchspec"


def redis_url() -> str:
    return os.environ.get("BATCHSPEC_REDIS_URL", DEFAULT_REDIS_URL)


def visibility_timeout() -> int:
    """Seconds before Redis hands an unacknowledged task to another worker. It must exceed
    the longest shard, or a shard still running gets a second copy (harmless, since writes
    are idempotent, but wasteful). Default 6 h."""
    return int(os.environ.get("BATCHSPEC_VISIBILITY_TIMEOUT", 6 * 3600))


def master_name() -> str:
    """Name of the Redis master that Sentinel watches (sentinel:// URLs only)."""
    return os.environ.get("BATCHSPEC_REDIS_MASTER", "mymaster")


def configure(app: Celery, url: str) -> None:
    vt = visibility_timeout()
    transport = {"visibility_timeout": vt,
                 # Sweep for tasks of dead workers often enough relative to vt.
                 "unacked_restore_interval": max(1, min(60, vt // 4)),
                 "unacked_restore_throttle": 1}
    if url.startswith("sentinel://"):
        transport["master_name"] = master_name()
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # A shard's task is acknowledged only after it returns; if the worker process
        # dies mid-shard the message goes back to the queue (attempts are counted in Redis).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # One shard at a time per process: no shard waits behind a long one in a prefetch
        # buffer, and a crash loses at most the shard being run.
        worker_prefetch_multiplier=1,
        task_default_queue=QUEUE,
        result_expires=7 * 24 * 3600,
        # Nobody reads task results (the job store holds what matters): a task never fails
        # because the result backend is briefly unreachable.
        task_ignore_result=True,
        # Workers outlive Redis restarts: reconnect forever; a running shard keeps running
        # (its lease and the job store carry it through, docs/operations.md "Faults").
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # An error Redis answers with is recovered from as a lost connection is (the
        # consumer reconnects), not fatal to the worker: a Redis at its maxmemory refused an
        # acknowledgement (OOM) and the worker's main process exited, leaving its jobs
        # without a worker until one was started again.
        broker_channel_error_retry=True,
        timezone="UTC",
        enable_utc=True,
    )


app = Celery("batchspec", include=["batchspec.jobs.tasks"])
configure(app, redis_url())


@worker_ready.connect
@beat_init.connect
def _start_checks(sender=None, **_):
    """Every worker's main process and beat check the active jobs periodically: shards of
    dead workers are re-queued and finished jobs finalized even when nobody watches."""
    from batchspec.jobs.tasks import start_checker
    start_checker()


def use_broker(url: str | None) -> Celery:
    """Point the app (and worker children, through the environment) at `url`."""
    if url:
        os.environ["BATCHSPEC_REDIS_URL"] = url
        configure(app, url)
    return app
