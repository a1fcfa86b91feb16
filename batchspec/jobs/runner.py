"""Run one shard (the same code in `batchspec run` and in a Celery worker), and the local
runner behind `batchspec run`.

A shard: read its rows, validate them (bad rows -> errors), generate, then write the
acceptance records, the errors and, last, the outputs, each atomically. The outputs file is
the shard's commit point: a shard whose outputs file exists is done and is skipped, so
re-running a job runs only what is missing, and a shard interrupted anywhere before that
rename simply runs again."""
from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from batchspec.io.rows import check_columns, prepare_requests, row_ids
from batchspec.io.schema import ACCEPTANCE_SCHEMA, ERROR_SCHEMA, OUTPUT_SCHEMA
from batchspec.io.shards import (
    Shard,
    expand_inputs,
    output_fs,
    plan_shards,
    read_shard,
    remove_stale_temps,
    write_table_atomic,
)
from batchspec.jobs.spec import JobSpec, new_job_id
from batchspec.jobs.summary import claim_output, finalize, shard_counts, shard_path


@dataclass
class ShardResult:
    shard: str
    status: str             # done | skipped | aborted
    num_completed: int = 0  # rows in outputs
    num_errors: int = 0     # rows in errors
    num_tokens: int = 0
    wall_s: float = 0.0


def start_job(spec: JobSpec) -> list[Shard]:
    """The job's shards, with the output directory claimed for them. Raises before anything
    runs for missing or unusable inputs, or an output directory of another job."""
    files = expand_inputs(spec.inputs)
    shards = plan_shards(files, spec.shard_size, check_schema=lambda path, schema:
                         check_columns(path, schema, spec.template))
    claim_output(spec.to_dict(), shards)
    return shards


def is_done(spec: JobSpec, shard: Shard) -> bool:
    fs, root = output_fs(spec.output)
    return fs.exists(shard_path(root, "outputs", shard))


def _write(fs, root: str, kind: str, shard: Shard, rows: list[dict], schema: pa.Schema):
    remove_stale_temps(fs, f"{root}/{kind}", shard.filename)
    write_table_atomic(fs, shard_path(root, kind, shard), pa.Table.from_pylist(rows, schema))


def run_shard(spec: JobSpec, shard: Shard, llm, *, job_id: str,
              should_abort: Callable[[], bool] | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> ShardResult:
    fs, root = output_fs(spec.output)
    if fs.exists(shard_path(root, "outputs", shard)):
        n_ok, n_bad = shard_counts(fs, root, shard)
        return ShardResult(shard.id, "skipped", n_ok, n_bad)
    t0 = time.perf_counter()
    requests, errors = prepare_requests(
        read_shard(shard), shard, sampling=spec.sampling_fields(), seed=spec.seed,
        encode=llm.encode, max_model_len=llm.max_model_len, template=spec.template,
        chat=spec.chat)
    outs = []
    if requests:
        outs = llm.generate([r.prompt_token_ids for r in requests],
                            [r.params for r in requests],
                            domains=[r.domain for r in requests],
                            request_ids=[r.id for r in requests],
                            should_abort=should_abort, on_progress=on_progress,
                            use_tqdm=False)
    if any(o.finish_reason == "abort" for o in outs):
        # Cancelled mid-shard: write nothing, the shard stays not done.
        return ShardResult(shard.id, "aborted", wall_s=time.perf_counter() - t0)
    records = [{**o.stats, "job_id": job_id, "shard": shard.id} for o in outs]
    outputs = [{"id": o.request_id, "text": o.text, "token_ids": list(o.token_ids),
                "finish_reason": o.finish_reason,
                "num_prompt_tokens": len(o.prompt_token_ids),
                "num_output_tokens": len(o.token_ids), "domain": o.domain,
                "draft": o.draft, "latency_s": o.latency_s} for o in outs]
    _write(fs, root, "acceptance", shard, records, ACCEPTANCE_SCHEMA)
    _write(fs, root, "errors", shard, errors, ERROR_SCHEMA)
    _write(fs, root, "outputs", shard, outputs, OUTPUT_SCHEMA)  # last: the commit point
    return ShardResult(shard.id, "done", len(outputs), len(errors),
                       sum(len(o.token_ids) for o in outs), time.perf_counter() - t0)


def fail_shard(output: str, shard: Shard, reason: str) -> None:
    """A shard given up on: every row goes to its errors file in `output`, so no row is lost
    silently. Its outputs stay absent, so re-running the job tries it again."""
    fs, root = output_fs(output)
    rows = [{"id": rid, "error_type": "shard_failed", "message": reason}
            for rid in row_ids(read_shard(shard), shard)]
    _write(fs, root, "errors", shard, rows, ERROR_SCHEMA)


def utcnow() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Progress:
    """tqdm bar on stderr: requests finished, with generated tokens/s."""

    def __init__(self, total: int, enabled: bool = True):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not enabled,
                        dynamic_ncols=True)
        self.base = 0
        self.t0 = time.perf_counter()

    def advance(self, n: int):
        self.base += n
        self.bar.update(self.base - self.bar.n)

    def update(self, done: int, tokens: int, shard_done: int = 0, shard_tokens: int = 0):
        """done/tokens: totals before the current shard; shard_*: within it."""
        self.bar.update(done + shard_done - self.bar.n)
        rate = (tokens + shard_tokens) / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)

    def close(self):
        self.bar.close()


def run_local(spec: JobSpec, progress: bool = True, llm=None) -> dict:
    """`batchspec run`: every missing shard in this process, then finalize. Returns the
    `_job.json` document."""
    job_id = spec.job_id or new_job_id(spec.name)
    shards = start_job(spec)
    timings = {"started_at": utcnow()}
    t0 = time.perf_counter()
    todo = [s for s in shards if not is_done(spec, s)]
    bar = Progress(sum(s.num_rows for s in shards), progress)
    bar.advance(sum(s.num_rows for s in shards if s not in todo))
    tokens = 0
    if todo and llm is None:
        from batchspec.llm import LLM
        llm = LLM.from_config(spec.engine_config())
    for shard in todo:
        done, tok0 = bar.base, tokens
        result = run_shard(spec, shard, llm, job_id=job_id,
                           on_progress=lambda n, t, d=done, k=tok0: bar.update(d, k, n, t))
        tokens += result.num_tokens
        bar.advance(shard.num_rows)
    bar.close()
    timings.update(finished_at=utcnow(), wall_s=time.perf_counter() - t0)
    return finalize(spec.to_dict() | {"job_id": job_id}, shards, job_id=job_id,
                    timings=timings, failed_shards={},
                    extra={"shards_run": [s.id for s in todo]})

