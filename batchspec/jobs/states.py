"""Job and shard states, and how their times are written, defined once (docs/operations.md,
"States").

A job: queued -> running -> (cancelling) -> finalizing -> one of FINAL.
A shard: queued -> running -> one of SHARD_ENDED."""
from __future__ import annotations

import datetime as dt

SUCCESS = ("completed", "completed_with_errors")   # _SUCCESS is written
FINAL = SUCCESS + ("failed", "cancelled")          # the job has ended
SHARD_ENDED = ("completed", "failed", "cancelled")


def iso(t: dt.datetime) -> str:
    """How a job's and a shard's times are written (the store's fields, `_job.json`'s
    timings, by `batchspec run` and by workers alike): ISO 8601 to the millisecond."""
    return t.isoformat(timespec="milliseconds")
