"""Run shards: ShardDriver (one driver, used by `batchspec run` and by the Celery worker's
run_shard), and the local runner behind `batchspec run`.

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
)
from batchspec.jobs.rows import check_columns, prepare_requests
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


@dataclass
class ShardWork:
    """A shard queued in a ShardDriver: its error rows, its sequences, and its result once
    written."""
    shard: Shard
    errors: list[dict]
    seqs: list
    left: int
    t0: float
    result: ShardResult | None = None


class ShardDriver:
    """Runs shards through one engine: `batchspec run` and the Celery worker both drive
    shards with it. A shard's rows are read, checked (bad rows -> errors) and queued by
    `add`; `step` runs one engine step and writes every shard whose last row finished in it.
    Queue the next shard whenever `wants_more()` (every queued row has been admitted), and
    the batch stays full across shard boundaries instead of draining each shard's tail."""

    def __init__(self, spec: JobSpec, llm, job_id: str):
        self.spec, self.llm, self.job_id = spec, llm, job_id
        self._by_seq: dict[int, ShardWork] = {}   # Sequence.seq_id -> its shard
        self.num_tokens = 0

    def add(self, shard: Shard) -> ShardWork:
        """Queue the shard's valid rows; a shard with none is written at once."""
        t0 = time.perf_counter()
        requests, errors = prepare_requests(
            read_shard(shard), shard, sampling=self.spec.sampling_fields(),
            make_request=self.llm.make_request, template=self.spec.template,
            chat=self.spec.chat)
        seqs = self.llm.add(requests)
        work = ShardWork(shard, errors, seqs, len(seqs), t0)
        self._by_seq.update((s.seq_id, work) for s in seqs)
        if not seqs:
            self._write(work)
        return work

    def wants_more(self) -> bool:
        return not self.llm.has_waiting()

    @property
    def busy(self) -> bool:
        return bool(self._by_seq)

    def step(self) -> tuple[list[ShardWork], int]:
        """One engine step: (shards written in it, requests finished in it)."""
        finished, n = self.llm.step()
        self.num_tokens += n
        written = []
        for seq in finished:
            work = self._by_seq.pop(seq.seq_id)
            work.left -= 1
            if work.left == 0:
                self._write(work)
                written.append(work)
        return written, len(finished)

    def abort(self) -> None:
        """Drop every shard in flight, writing nothing: they stay not done."""
        self.llm.engine.abort_all()
        self._by_seq.clear()

    def _write(self, work: ShardWork) -> None:
        outs = [self.llm.output(s) for s in work.seqs]
        records = [{**o.stats, "job_id": self.job_id, "shard": work.shard.id} for o in outs]
        outputs = [{"id": o.request_id, "text": o.text, "token_ids": list(o.token_ids),
                    "finish_reason": o.finish_reason,
                    "num_prompt_tokens": len(o.prompt_token_ids),
                    "num_output_tokens": len(o.token_ids), "domain": o.domain,
                    "draft": o.draft, "latency_s": o.latency_s} for o in outs]
        write_shard(self.spec.output, work.shard, outputs, records, work.errors)
        work.result = ShardResult(work.shard.id, "done", len(outputs), len(work.errors),
                                  sum(len(o.token_ids) for o in outs),
                                  time.perf_counter() - work.t0)


def run_shard(spec: JobSpec, shard: Shard, llm, *, job_id: str,
              should_abort: Callable[[], bool] | None = None,
              on_progress: Callable[[int, int], None] | None = None) -> ShardResult:
    """One shard (a Celery task's work): skipped when its outputs exist, aborted (nothing
    written) when should_abort() turns true between engine steps."""
    fs, root = output_fs(spec.output)
    if fs.exists(shard_path(root, "outputs", shard)):
        n_ok, n_bad = shard_counts(fs, root, shard)
        return ShardResult(shard.id, "skipped", n_ok, n_bad)
    driver = ShardDriver(spec, llm, job_id)
    work = driver.add(shard)
    done = 0
    try:
        while work.result is None:
            if should_abort is not None and should_abort():
                driver.abort()
                return ShardResult(shard.id, "aborted")
            _, n = driver.step()
            done += n
            if on_progress is not None:
                on_progress(done, driver.num_tokens)
    finally:
        if driver.busy:  # interrupted: leave the engine clean
            driver.abort()
    return work.result


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
    driver = ShardDriver(spec, llm, job_id) if todo else None
    try:
        while pending or (driver is not None and driver.busy):
            while pending and driver.wants_more():
                bar.advance(len(driver.add(pending.popleft()).errors))
            if not driver.busy:
                continue
            _, n = driver.step()
            bar.advance(n, driver.num_tokens)
    finally:
        if driver is not None and driver.busy:  # interrupted: leave the engine clean
            driver.abort()
    bar.close()
    timings.update(finished_at=utcnow(), wall_s=time.perf_counter() - t0)
    return finalize(spec.to_dict() | {"job_id": job_id}, shards, job_id=job_id,
                    timings=timings, failed_shards={},
                    extra={"shards_run": [s.id for s in todo]})
