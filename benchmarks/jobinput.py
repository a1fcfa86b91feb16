"""The job input shared by the shard benchmarks: held-out prompts of every domain with
mixed lengths (max_tokens 8-96), as one Parquet file."""
from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.tools.evaluate import load_prompts


def write_mixed_job(path: str, rows: int) -> None:
    prompts = load_prompts(None, None, rows, split="heldout", seed=1)
    rng = random.Random(0)
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))],
                             "prompt": [p["prompt"] for p in prompts],
                             "domain": [p["domain"] for p in prompts],
                             "max_tokens": [rng.randint(8, 96) for _ in prompts]}), path)
