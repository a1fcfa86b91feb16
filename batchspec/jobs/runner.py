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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from batchspec.jobs.outputs import (
    output_fs,
    shard_counts,
    shard_path,
    write_shard,
    write_shard_file,
)
from batchspec.jobs.rows import check_columns, prepare_requests, row_ids
from batchspec.jobs.shards import Shard, expand_inputs, plan_shards, read_shard
from batchspec.jobs.spec import JobSpec, new_job_id
from batchspec.jobs.summary import claim_output, finalize


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


def run_shard(spec: JobSpec, shard: Shard, llm, *, job_id: str,
              should_abort: Callable[[], bool] | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> ShardResult:
    fs, root = output_fs(spec.output)
    if fs.exists(shard_path(root, "outputs", shard)):
        n_ok, n_bad = shard_counts(fs, root, shard)
        return ShardResult(shard.id, "skipped", n_ok, n_bad)
    t0 = time.perf_counter()
    requests, errors = _prepare(spec, shard, llm)
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
    return write_results(spec, shard, outs, errors, job_id=job_id, t0=t0)


def _prepare(spec: JobSpec, shard: Shard, llm):
    """The shard's valid requests and its error rows."""
    return prepare_requests(
        read_shard(shard), shard, sampling=spec.sampling_fields(), seed=spec.seed,
        encode=llm.encode, max_model_len=llm.max_model_len, template=spec.template,
        chat=spec.chat)


def write_results(spec: JobSpec, shard: Shard, outs, errors: list[dict], *, job_id: str,
                  t0: float) -> ShardResult:
    """Write a shard's acceptance records, errors and, last (the commit point), outputs."""
    records = [{**o.stats, "job_id": job_id, "shard": shard.id} for o in outs]
    outputs = [{"id": o.request_id, "text": o.text, "token_ids": list(o.token_ids),
                "finish_reason": o.finish_reason,
                "num_prompt_tokens": len(o.prompt_token_ids),
                "num_output_tokens": len(o.token_ids), "domain": o.domain,
                "draft": o.draft, "latency_s": o.latency_s} for o in outs]
    write_shard(spec.output, shard, outputs, records, errors)
    return ShardResult(shard.id, "done", len(outputs), len(errors),
                       sum(len(o.token_ids) for o in outs), time.perf_counter() - t0)


def fail_shard(output: str, shard: Shard, reason: str) -> None:
    """A shard given up on: every row goes to its errors file in `output`, so no row is lost
    silently. Its outputs stay absent, so re-running the job tries it again."""
    fs, root = output_fs(output)
    rows = [{"id": rid, "error_type": "shard_failed", "message": reason}
            for rid in row_ids(read_shard(shard), shard)]
    write_shard_file(fs, root, "errors", shard, rows)


def utcnow() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Progress:
    """tqdm bar on stderr: requests finished, with generated tokens/s."""

    def __init__(self, total: int, enabled: bool = True):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not enabled,
                        dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def advance(self, n: int, tokens: int | None = None):
        self.bar.update(n)
        if tokens is not None:
            rate = tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)

    def close(self):
        self.bar.close()


@dataclass
class _ShardInFlight:
    shard: Shard
    errors: list[dict]
    seqs: list
    left: int
    t0: float


def run_local(spec: JobSpec, progress: bool = True, llm=None) -> dict:
    """`batchspec run`: every missing shard in this process, then finalize. Returns the
    `_job.json` document.

    Shards overlap in the engine: the next shard's requests are queued as soon as every
    request queued so far has been admitted to the batch, so the batch stays full across
    shard boundaries instead of draining each shard's tail. A shard's files are written the
    moment its last request finishes."""
    job_id = spec.job_id or new_job_id(spec.name)
    shards = start_job(spec)
    timings = {"started_at": utcnow()}
    t0 = time.perf_counter()
    todo = [s for s in shards if not is_done(spec, s)]
    bar = Progress(sum(s.num_rows for s in shards), progress)
    bar.advance(sum(s.num_rows for s in shards if s not in todo))
    if todo and llm is None:
        from batchspec.llm import LLM
        llm = LLM.from_config(spec.engine_config())
    pending = deque(todo)
    inflight: dict[int, _ShardInFlight] = {}   # id(sequence) -> its shard
    tokens = 0

    def finish(work: _ShardInFlight) -> None:
        write_results(spec, work.shard, [llm.output(s) for s in work.seqs], work.errors,
                      job_id=job_id, t0=work.t0)

    try:
        while pending or inflight:
            while pending and not llm.engine.scheduler.waiting:
                shard, started = pending.popleft(), time.perf_counter()
                requests, errors = _prepare(spec, shard, llm)
                seqs = llm.add_requests([r.prompt_token_ids for r in requests],
                                        [r.params for r in requests],
                                        domains=[r.domain for r in requests],
                                        request_ids=[r.id for r in requests]) \
                    if requests else []
                work = _ShardInFlight(shard, errors, seqs, len(seqs), started)
                inflight.update((id(s), work) for s in seqs)
                bar.advance(len(errors))
                if not seqs:
                    finish(work)
            if not inflight:
                continue
            finished, n = llm.step()
            tokens += n
            for seq in finished:
                work = inflight.pop(id(seq))
                work.left -= 1
                if work.left == 0:
                    finish(work)
            bar.advance(len(finished), tokens)
    finally:
        if llm is not None and llm.engine.has_unfinished():  # interrupted: leave it clean
            llm.engine.abort_all()
    bar.close()
    timings.update(finished_at=utcnow(), wall_s=time.perf_counter() - t0)
    return finalize(spec.to_dict() | {"job_id": job_id}, shards, job_id=job_id,
                    timings=timings, failed_shards={},
                    extra={"shards_run": [s.id for s in todo]})
