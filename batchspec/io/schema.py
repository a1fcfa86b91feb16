"""Arrow schemas of everything batchspec writes (DESIGN.md "Data formats")."""
from __future__ import annotations

import pyarrow as pa

i32_list = pa.list_(pa.int32())

OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("text", pa.string()),
    ("token_ids", i32_list),
    ("finish_reason", pa.string()),      # stop | length | abort
    ("num_prompt_tokens", pa.int32()),
    ("num_output_tokens", pa.int32()),
    ("domain", pa.string()),
    ("draft", pa.string()),              # draft name that served the request; null = plain
    ("latency_s", pa.float64()),
])

ERROR_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("error_type", pa.string()),
    ("message", pa.string()),
])

# One record per request. Counters are over the request's whole generation.
ACCEPTANCE_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("job_id", pa.string()),
    ("shard", pa.string()),
    ("domain", pa.string()),
    ("target", pa.string()),
    ("draft", pa.string()),
    ("temperature", pa.float32()),
    ("k_max", pa.int32()),
    ("confidence_threshold", pa.float32()),
    ("tokens_generated", pa.int32()),
    ("rounds", pa.int32()),              # target passes that produced tokens (decode steps)
    ("total_drafted", pa.int32()),
    ("total_accepted", pa.int32()),
    ("acceptance_rate", pa.float64()),   # total_accepted / total_drafted; null if nothing drafted
    ("mean_accepted_length", pa.float64()),  # tokens per target pass = tokens_generated / rounds
    ("drafted_per_depth", i32_list),     # index d: drafts proposed at depth d of the window
    ("accepted_per_depth", i32_list),
    ("round_output_pos", i32_list),      # output position at the start of each round
    ("round_drafted", i32_list),
    ("round_accepted", i32_list),
    ("skipped_by_confidence", pa.int32()),  # rounds whose window the confidence threshold cut short
    ("fallback_triggered", pa.bool_()),
    ("speedup_theoretical", pa.float64()),
    ("wall_s", pa.float64()),
])

RECORD_FIELDS = [f.name for f in ACCEPTANCE_SCHEMA]
