"""Job and shard states, defined once (docs/operations.md, "States").

A job: queued -> running -> (cancelling) -> finalizing -> one of FINAL.
A shard: queued -> running -> one of SHARD_ENDED."""
from __future__ import annotations

SUCCESS = ("completed", "completed_with_errors")   # _SUCCESS is written
FINAL = SUCCESS + ("failed", "cancelled")          # the job has ended
SHARD_ENDED = ("completed", "failed", "cancelled")
