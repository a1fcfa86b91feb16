"""Run shards: ShardDriver (one driver, used by `batchspec run` and by the Celery worker's
run_shard), and the local runner behind `batchspec run`.

A shard: read its rows, validate them (bad rows -> errors), generate, then write the
acceptance records, the errors and, last, the outputs, each atomically. The outputs file is
the shard's commit point: a shard whose outputs file exists is done and is skipped, so
re-running a job runs only what is missing, and a shard interrupted anywhere before that
rename simply runs again."""
from __future__ import annotations

import datetime as dt
import logging
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from batchspec.jobs import metrics
from batchspec.jobs.lease import STEPS
from batchspec.jobs.outputs import (
    output_fs,
    read_outputs_for_seed,
    shard_counts,
    shard_path,
    write_shard,
    write_shard_file,
)
from batchspec.jobs.rows import check_columns, prepare_requests, row_id, shard_row_ids
from batchspec.jobs.shards import Shard, expand_inputs, mark_duplicates, plan_shards, read_shard
from batchspec.jobs.spec import JobSpec, new_job_id
from batchspec.jobs.states import iso
from batchspec.jobs.summary import check_output, claim_output, clear_output, finalize

log = logging.getLogger(__name__)


@dataclass
class ShardResult:
    shard: str
    status: str             # done | skipped | aborted | failed
    num_completed: int = 0  # rows in outputs
    num_errors: int = 0     # rows in errors
    num_tokens: int = 0
    wall_s: float = 0.0
    error: str | None = None  # why a failed shard failed


def plan_job(spec: JobSpec) -> list[Shard]:
    """The job's shards, with rows whose id an earlier row of the job has marked. Reads
    the inputs' footers and id columns only; raises for missing or unusable inputs."""
    files = expand_inputs(spec.inputs)
    shards = plan_shards(files, spec.shard_size, check_schema=lambda path, schema:
                         check_columns(path, schema, spec.template))
    return mark_duplicates(shards, key=lambda shard, i, value: row_id(value, shard, i))


def start_job(spec: JobSpec, shards: list[Shard] | None = None) -> list[Shard]:
    """The job's shards, with the output directory checked and claimed for them. Raises
    before anything runs for missing or unusable inputs, or an output directory of another
    job."""
    shards = plan_job(spec) if shards is None else shards
    check_output(spec.to_dict(), shards)
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
    requests: list = field(default_factory=list)   # the Requests behind seqs, in order
    failed_rows: dict[int, str] = field(default_factory=dict)  # seq index -> engine error


class ShardDriver:
    """Runs shards through one engine: `batchspec run` and the Celery worker both drive
    shards with it. A shard's rows are read, checked (bad rows -> errors) and queued by
    `add`; `step` runs one engine step and writes every shard whose last row finished in it.
    Queue the next shard whenever `wants_more()` (every queued row has been admitted), and
    the batch stays full across shard boundaries instead of draining each shard's tail."""

    def __init__(self, spec: JobSpec, llm, job_id: str, contain_failures: bool = True,
                 may_write: Callable[[ShardWork], bool] | None = None):
        """contain_failures: a shard that cannot be read or written ends `failed` (its
        rows in its errors file as far as that can be written) and the others go on, as
        `batchspec run` wants; False raises instead, for a Celery task to retry.
        may_write(work), asked before a shard's files are written: False ends the shard
        `aborted` with nothing written (a worker's lease on it has gone to another)."""
        self.spec, self.llm, self.job_id = spec, llm, job_id
        self.contain_failures = contain_failures
        self.may_write = may_write
        self._by_seq: dict[int, ShardWork] = {}   # Sequence.seq_id -> its shard
        self.num_tokens = 0
        if spec.suffix_seed:
            seed_suffix_drafts(llm.engine, spec.suffix_seed)

    def add(self, shard: Shard) -> ShardWork:
        """Queue the shard's valid rows; a shard with none is written at once."""
        t0 = time.perf_counter()
        try:
            requests, errors = prepare_requests(
                read_shard(shard), shard, sampling=self.spec.sampling_fields(),
                make_request=self.llm.make_request, template=self.spec.template,
                chat=self.spec.chat)
        except Exception as e:
            if not self.contain_failures:
                raise
            work = ShardWork(shard, [], [], 0, t0)
            self._fail(work, f"cannot read the shard's rows: {type(e).__name__}: {e}")
            return work
        work = ShardWork(shard, errors, [], 0, t0, requests=requests)
        work.seqs = self.llm.add(requests)
        work.left = len(work.seqs)
        self._by_seq.update((s.seq_id, work) for s in work.seqs)
        if not work.seqs:
            self._write(work)
        return work

    def wants_more(self) -> bool:
        return not self.llm.has_waiting()

    @property
    def busy(self) -> bool:
        return bool(self._by_seq)

    def step(self) -> tuple[list[ShardWork], int]:
        """One engine step: (shards ended in it, requests finished in it)."""
        try:
            t0 = time.perf_counter()
            with STEPS.step():      # (watched by the leases: batchspec.jobs.lease)
                finished, n = self.llm.step()
            metrics.on_step(self.llm, time.perf_counter() - t0)
        except Exception:
            if self.llm.engine.closed:  # a tensor-parallel target broke: nothing to replay on
                raise
            log.exception("an engine step failed; running its requests one at a time to "
                          "find the row(s) that broke it")
            return self._replay_alone()
        self.num_tokens += n
        ended = []
        for seq in finished:
            work = self._by_seq.pop(seq.seq_id)
            work.left -= 1
            if work.left == 0:
                self._write(work)
                ended.append(work)
        return ended, len(finished)

    def _replay_alone(self) -> tuple[list[ShardWork], int]:
        """After a failed step: abort every request in flight and run each again alone. A
        request's tokens do not depend on its batch (keyed randomness), so the ones that
        succeed give the outputs they would have; one that fails again goes to its shard's
        errors with the reason, and the rest of the batch goes on."""
        works = list({id(w): w for w in self._by_seq.values()}.values())
        self.llm.engine.abort_all()
        self._by_seq.clear()
        num_finished = 0
        for work in works:
            for i, seq in enumerate(work.seqs):
                if seq.finish_reason != "abort":
                    continue                       # finished before the failed step
                alone = self.llm.add([work.requests[i]])[0]
                try:
                    while not alone.is_finished:
                        with STEPS.step():
                            _, n = self.llm.step()
                        self.num_tokens += n
                    work.seqs[i] = alone
                except Exception as e:  # noqa: BLE001 - this row broke the step
                    self.llm.engine.abort_all()
                    work.failed_rows[i] = f"{type(e).__name__}: {e}"
                num_finished += 1
            self._write(work)
        return works, num_finished

    def abort(self) -> None:
        """Drop every shard in flight, writing nothing: they stay not done."""
        self.llm.engine.abort_all()
        self._by_seq.clear()

    def _fail(self, work: ShardWork, reason: str) -> None:
        log.error("shard %s failed: %s", work.shard.id, reason)
        work.result = ShardResult(work.shard.id, "failed", num_errors=work.shard.num_rows,
                                  wall_s=time.perf_counter() - work.t0, error=reason)
        try:
            fail_shard(self.spec.output, work.shard, reason)
        except Exception:  # noqa: BLE001 - the shard has ended all the same
            log.exception("could not write the errors of failed shard %s", work.shard.id)

    def _write(self, work: ShardWork) -> None:
        if self.may_write is not None and not self.may_write(work):
            log.warning("shard %s is no longer this worker's: its files are not written",
                        work.shard.id)
            work.result = ShardResult(work.shard.id, "aborted",
                                      wall_s=time.perf_counter() - work.t0)
            return
        try:
            self._write_files(work)
        except Exception as e:
            if not self.contain_failures:
                raise
            self._fail(work, f"cannot write the shard's files: {type(e).__name__}: {e}")

    def _write_files(self, work: ShardWork) -> None:
        errors = work.errors + [{"id": work.seqs[i].request_id, "error_type": "engine_error",
                                 "message": reason} for i, reason in work.failed_rows.items()]
        outs = [self.llm.output(s) for i, s in enumerate(work.seqs)
                if i not in work.failed_rows]
        records = [{**o.stats, "job_id": self.job_id, "shard": work.shard.id} for o in outs]
        outputs = [{"id": o.request_id, "text": o.text, "token_ids": list(o.token_ids),
                    "finish_reason": o.finish_reason,
                    "num_prompt_tokens": len(o.prompt_token_ids),
                    "num_output_tokens": len(o.token_ids), "domain": o.domain,
                    "draft": o.draft, "latency_s": o.latency_s} for o in outs]
        write_shard(self.spec.output, work.shard, outputs, records, errors)
        work.result = ShardResult(work.shard.id, "done", len(outputs), len(errors),
                                  sum(len(o.token_ids) for o in outs),
                                  time.perf_counter() - work.t0)
        metrics.on_shard(self.job_id, outputs, records, len(errors), work.result.wall_s)


_seeded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> seeds applied


def seed_suffix_drafts(engine, seed: str) -> None:
    """Seed the engine's job-wide suffix tries with the outputs in `seed` (an earlier run's
    output directory), once per engine and directory. The seed only speeds drafting up, so a
    directory without outputs (a first run) or one that cannot be read leaves the tries
    empty, with a warning, and the job goes on."""
    done = _seeded.setdefault(engine, set())
    if seed in done:
        return
    done.add(seed)
    try:
        outputs = read_outputs_for_seed(seed, engine.config.suffix_max_tokens)
    except Exception as e:  # noqa: BLE001 - a bad seed must not fail the job
        log.warning("suffix_seed %s cannot be read (%s: %s); the job-wide suffix tries "
                    "start empty", seed, type(e).__name__, e)
        return
    if not outputs:
        log.warning("suffix_seed %s holds no outputs; the job-wide suffix tries start empty",
                    seed)
        return
    engine.seed_suffix_drafts(outputs)
    log.info("seeded the job-wide suffix tries with %d outputs of %s",
             sum(map(len, outputs.values())), seed)


def run_shard(spec: JobSpec, shard: Shard, llm, *, job_id: str,
              should_abort: Callable[[], bool] | None = None,
              on_progress: Callable[[int, int], None] | None = None,
              may_write: Callable[[], bool] | None = None) -> ShardResult:
    """One shard (a Celery task's work): skipped when its outputs exist, aborted (nothing
    written) when should_abort() turns true between engine steps, or may_write() is false
    when its files are to be written."""
    fs, root = output_fs(spec.output)
    if fs.exists(shard_path(root, "outputs", shard)):
        n_ok, n_bad = shard_counts(fs, root, shard)
        return ShardResult(shard.id, "skipped", n_ok, n_bad)
    driver = ShardDriver(spec, llm, job_id, contain_failures=False,
                         may_write=None if may_write is None else lambda _: may_write())
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


def fail_shard(output: str, shard: Shard, reason: str) -> None:
    """A shard given up on: every row goes to its errors file in `output`, so no row is lost
    silently. Its outputs stay absent, so re-running the job tries it again."""
    fs, root = output_fs(output)
    rows = [{"id": rid, "error_type": "shard_failed", "message": reason}
            for rid in shard_row_ids(shard)]
    write_shard_file(fs, root, "errors", shard, rows)


def utcnow() -> str:
    return iso(dt.datetime.now(dt.UTC))


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


def run_local(spec: JobSpec, progress: bool = True, llm=None, overwrite: bool = False) -> dict:
    """`batchspec run`: every missing shard in this process, then finalize. Returns the
    `_job.json` document; with "already_complete": True (and nothing written) when the
    output directory holds this job completed, unless `overwrite` (which clears the
    directory's job files and runs the job again).

    Nothing is written before the job can run: inputs are planned, the output directory
    checked and the models loaded first. Shards overlap in the engine: the next shard's
    requests are queued as soon as every request queued so far has been admitted to the
    batch, so the batch stays full across shard boundaries instead of draining each
    shard's tail. A shard's files are written the moment its last request finishes; a shard
    that cannot be read or written ends failed and the others go on."""
    shards = plan_job(spec)
    done = check_output(spec.to_dict(), shards, overwrite=overwrite)
    if done is not None:
        return done | {"already_complete": True}
    job_id = spec.job_id or new_job_id(spec.name)
    todo = shards if overwrite else [s for s in shards if not is_done(spec, s)]
    if todo and llm is None:
        from batchspec.llm import LLM, freeze_heap
        llm = LLM.from_config(spec.engine_config())
        freeze_heap()
    if overwrite:      # (once the models have loaded: a bad model leaves the old job whole)
        clear_output(spec.output)
    claim_output(spec.to_dict(), shards)
    timings = {"started_at": utcnow()}
    t0 = time.perf_counter()
    bar = Progress(sum(s.num_rows for s in shards), progress)
    bar.advance(sum(s.num_rows for s in shards if s not in todo))
    pending = deque(todo)
    driver = ShardDriver(spec, llm, job_id) if todo else None
    failed: dict[str, str] = {}

    def account(work: ShardWork) -> None:
        if work.result is not None and work.result.status == "failed":
            failed[work.shard.id] = work.result.error
            bar.advance(work.shard.num_rows - len(work.errors) - (len(work.seqs) - work.left))

    try:
        while pending or (driver is not None and driver.busy):
            while pending and driver.wants_more():
                work = driver.add(pending.popleft())
                bar.advance(len(work.errors))
                account(work)
            if not driver.busy:
                continue
            ended, n = driver.step()
            bar.advance(n, driver.num_tokens)
            for work in ended:
                account(work)
    finally:
        if driver is not None and driver.busy:  # interrupted: leave the engine clean
            driver.abort()
    bar.close()
    timings.update(finished_at=utcnow(), wall_s=time.perf_counter() - t0)
    return finalize(spec.to_dict() | {"job_id": job_id}, shards, job_id=job_id,
                    timings=timings, failed_shards=failed,
                    extra={"shards_run": [s.id for s in todo]},
                    tokens_run=driver.num_tokens if driver is not None else 0)
