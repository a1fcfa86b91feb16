"""`batchspec run | submit | status | jobs | cancel | worker | beat`.

`run` executes a job in this process (no Redis); the others talk to Redis / Celery, whose
URL comes from --broker or BATCHSPEC_REDIS_URL. Exit codes: 0 when the job is done (also
with bad rows, which are listed in OUT/errors/), 1 when it failed, was cancelled, or could
not start; every failure says what to fix.

Deployment settings (model, drafts, speculation, device, shard size, broker) may come from
BATCHSPEC_* environment variables. What a job computes (inputs, sampling, template) is
given explicitly, so a stale variable never changes a job's outputs silently."""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable

import click

from batchspec.jobs.celery_app import DEFAULT_REDIS_URL
from batchspec.jobs.states import FINAL, SUCCESS

JOB_OPTIONS = [
    click.argument("inputs", nargs=-1),
    click.option("-o", "--output", help="Output directory (local path or fsspec URL)."),
    click.option("--config", type=click.Path(dir_okay=False), envvar="BATCHSPEC_JOB_CONFIG",
                 help="Job YAML file; options given on the command line override it."),
    click.option("--model", envvar="BATCHSPEC_MODEL",
                 help="Target model (HF directory). Default: the bundled demo models."),
    click.option("--draft", "drafts", multiple=True, metavar="DOMAIN=PATH",
                 envvar="BATCHSPEC_DRAFTS",
                 help="Draft for a domain: an HF directory, 'ngram', 'suffix', or DIR+suffix "
                      "(each round from whichever promises more) (repeatable; 'default' "
                      "serves rows without a matching domain)."),
    click.option("-k", "--num-speculative-tokens", type=int,
                 envvar="BATCHSPEC_NUM_SPECULATIVE_TOKENS",
                 help="Most tokens a draft proposes per round [4]."),
    click.option("--confidence-threshold", type=float,
                 envvar="BATCHSPEC_CONFIDENCE_THRESHOLD",
                 help="Stop drafting when the draft's probability falls below this [0]."),
    click.option("--temperature", type=float, help="Sampling temperature, 0 = greedy [0]."),
    click.option("--top-p", type=float, help="Nucleus sampling mass [1]."),
    click.option("--top-k", type=int, help="Top-k sampling, 0 = off [0]."),
    click.option("--max-tokens", type=int, help="Most tokens generated per row [128]."),
    click.option("--seed", type=int, help="Job seed; each row's seed derives from it and "
                                          "the row id unless the row has a seed [0]."),
    click.option("--device", envvar="BATCHSPEC_DEVICE",
                 help="auto, cpu, cuda, cuda:N, or one device per tensor-parallel rank "
                      "(cuda:0,cuda:1) [auto]."),
    click.option("--tensor-parallel-size", type=int, envvar="BATCHSPEC_TENSOR_PARALLEL_SIZE",
                 help="Shard the target over this many devices, one process each [one "
                      "per device listed in --device]."),
    click.option("--dtype", envvar="BATCHSPEC_DTYPE",
                 type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                 help="Model dtype [auto]."),
    click.option("--threads", "num_threads", type=int, envvar="BATCHSPEC_THREADS",
                 help="CPU threads for the forward pass [1 for models under 50M "
                      "parameters, else torch's default]."),
    click.option("--shard-size", type=int, envvar="BATCHSPEC_SHARD_SIZE",
                 help="Most rows per shard [1000]."),
    click.option("--min-acceptance", type=float, envvar="BATCHSPEC_MIN_ACCEPTANCE",
                 help="Fall back to plain decoding below this acceptance rate."),
    click.option("--max-spec-temperature", type=float,
                 envvar="BATCHSPEC_MAX_SPEC_TEMPERATURE",
                 help="Do not speculate for rows sampled above this temperature."),
    click.option("--adaptive-k/--fixed-k", "adaptive_k", default=None,
                 envvar="BATCHSPEC_ADAPTIVE_K",
                 help="Per step, draft the k (0..-k) with the most expected tokens/s, from "
                      "costs measured at start-up, or a fixed k [adaptive]."),
    click.option("--draft-vocab/--whole-draft-vocab", "draft_vocab", default=None,
                 help="Drafts with a draft_vocab.json score only its tokens (`batchspec "
                      "draft-vocab`), or every token [per row: its tokens for rows at "
                      "temperature 0, every token for rows above]."),
    click.option("--suffix-seed", metavar="DIR",
                 help="Output directory of an earlier run whose outputs seed the job-wide "
                      "suffix drafts (e.g. last night's); needs a suffix draft."),
    click.option("--prefix-caching/--no-prefix-caching", "prefix_caching", default=None,
                 help="Share the KV cache of identical prompt prefixes between rows [on]."),
    click.option("--template", help="Prompt template over input columns, e.g. "
                                    "'Q: {question}\\nContext: {context}'."),
    click.option("--chat/--no-chat", default=None,
                 help="Send prompts as a user message through the chat template."),
    click.option("--max-attempts", type=int, envvar="BATCHSPEC_MAX_ATTEMPTS", help="Deliveries of a shard before it is "
                                                  "marked failed (Celery) [3]."),
    click.option("--name", help="Job name (prefix of the job id)."),
    click.option("--output-format", type=click.Choice(["parquet", "openai"]),
                 help="openai: also write the OpenAI Batch output and error files "
                      "(OUT/openai/*.jsonl) when the job ends [parquet]."),
]


def job_options(fn):
    for option in reversed(JOB_OPTIONS):
        fn = option(fn)
    return fn


def _set_broker(ctx, _param, value):
    ctx.ensure_object(dict)["broker"] = value
    return value


broker_option = click.option(
    "--broker", envvar="BATCHSPEC_REDIS_URL", default=DEFAULT_REDIS_URL, show_default=True,
    show_envvar=True,
    expose_value=False, callback=_set_broker, is_eager=True,
    help="Redis URL of the broker, result backend and job store.")


def _redis_url() -> str:
    """The broker URL of the running command, its password masked."""
    ctx = click.get_current_context(silent=True)
    url = (ctx.obj or {}).get("broker") if ctx is not None else None
    url = url or DEFAULT_REDIS_URL
    return re.sub(r"(://[^:/@]*:)[^@]+@", r"\1***@", url)


def redis_problem(e: Exception) -> str | None:
    """One line for a Redis failure a user can fix, or None if `e` is not one."""
    import redis
    from kombu.exceptions import OperationalError
    url = _redis_url()
    text = str(e).lower()
    if isinstance(e, redis.AuthenticationError) or "noauth" in text or "wrongpass" in text \
            or "invalid password" in text:
        return (f"Redis at {url} refused the credentials ({e}): put the right password in "
                f"the URL, redis://:PASSWORD@HOST:PORT/DB")
    if "max number of clients reached" in text:
        return (f"Redis at {url} has as many clients as its maxclients allows and refuses "
                f"more: raise its maxclients (CONFIG SET maxclients N, and in redis.conf), or "
                f"close idle clients")
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError, OperationalError)):
        return (f"cannot reach Redis at {url} ({_reason(e)}): start redis-server, or pass "
                f"--broker / set BATCHSPEC_REDIS_URL")
    if isinstance(e, redis.exceptions.OutOfMemoryError) or "used memory > 'maxmemory'" in text:
        return (f"Redis at {url} is full (used memory > maxmemory) and refuses writes: raise "
                f"its maxmemory, or free memory there (ended jobs' records expire after "
                f"BATCHSPEC_JOB_TTL_DAYS)")
    if isinstance(e, redis.exceptions.ReadOnlyError) or text.startswith("readonly"):
        return (f"Redis at {url} is a read-only replica: point --broker / BATCHSPEC_REDIS_URL "
                f"at its master (or use sentinel://)")
    if text.startswith("misconf"):
        return (f"Redis at {url} refuses writes because it cannot save its data to disk "
                f"({str(e).strip()[:120]}): free its disk or fix its `dir`")
    if isinstance(e, ValueError) and ("redis url" in text or text.startswith("port ")):
        return (f"invalid Redis URL {url} ({e}): use redis://HOST:PORT/DB (or rediss://, "
                f"unix://, sentinel://)")
    return None


def check_problems(job_id: str, write: Callable[[str], None] | None = None
                   ) -> Callable[[Exception], None]:
    """For try_reconcile in a command: why the job could not be brought forward, in one line
    through `write` (default: stderr), said again only when the reason changes. A Redis that
    refuses writes (full, a replica) used to show a logger's warning with Redis' raw reply
    at every poll."""
    said = []
    write = write or (lambda line: click.echo(line, err=True))

    def say(e: Exception) -> None:
        line = redis_problem(e) or f"{type(e).__name__}: {e}"
        if line not in said:
            said.append(line)
            write(f"could not bring job {job_id} forward: {line}")
    return say


def _reason(e: Exception) -> str:
    """Why Redis could not be reached, short: a connection refused, or one lost (reset or
    closed by the other end, or a broken pipe: the path cut mid-request), rather than
    redis-py's wording ("Error while reading from HOST:PORT : (104, 'Connection reset by
    peer')")."""
    text = str(e).lower()
    if "refused" in text:
        return "connection refused"
    if "reset by peer" in text or "closed by server" in text or "broken pipe" in text:
        return "connection lost"
    return str(e).strip().rstrip(".")


def os_problem(e: OSError) -> str:
    what = f" ({e.filename})" if e.filename else ""
    hint = {errno.ENOSPC: ": free some space or write to another output",
            errno.EROFS: ": the filesystem is read-only; write to another output",
            errno.EACCES: ": check the permissions, or write to another output",
            errno.ENOTDIR: ": a part of the path is a file"}.get(e.errno, "")
    return f"{e.strerror or e}{what}{hint}"


def clear_errors(fn):
    """Turn a condition a user can cause or meets (bad input, a missing file, Redis
    unreachable, a full or read-only disk, a tensor-parallel rank that died) into a one-line
    error and exit 1: no traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except Exception as e:
            tp = sys.modules.get("batchspec.engine.distributed")  # loaded if a target was
            if tp is not None and isinstance(e, tp.TargetFailed):  # a rank died (host, OOM)
                raise click.ClickException(
                    f"{e}. Shards already written are kept: run the same command again to "
                    f"finish the job") from e
            message = redis_problem(e)
            if message is None and isinstance(e, OSError) and not isinstance(
                    e, FileNotFoundError):
                message = os_problem(e)
            elif message is None and isinstance(e, (ValueError, FileNotFoundError)):
                message = str(e)
            if message is None:
                raise
            raise click.ClickException(message) from e
    return wrapper


def build_spec(config, **options):
    from batchspec.jobs.spec import JobSpec
    return JobSpec.build(config=config, **options)


def _report(doc: dict) -> None:
    from batchspec.jobs.display import ending_of_doc
    click.echo(ending_of_doc(doc), err=True)


def _already_complete(doc: dict) -> None:
    c = doc["counts"]
    click.echo(f"already complete: job {doc['job_id']}, {c['requests_completed']}/"
               f"{c['requests_total']} requests ({c['requests_failed']} failed) in "
               f"{doc['spec']['output']}; nothing to run (--overwrite runs it again)", err=True)
    click.echo(doc["job_id"])


overwrite_option = click.option(
    "--overwrite", is_flag=True,
    help="Delete the output directory's job files (outputs/, acceptance/, errors/, openai/, "
         "_job.json, _plan.json, _SUCCESS) and run the job again, whatever job they held. "
         "Without it, a completed job is reported, an interrupted one resumed.")


metrics_option = click.option(
    "--metrics-port", type=int, envvar="BATCHSPEC_METRICS_PORT",
    help="Serve Prometheus metrics on this port (/metrics); off by default.")


@click.command()
@job_options
@overwrite_option
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@metrics_option
@clear_errors
def run(config, quiet, overwrite, metrics_port, **options):
    """Run a job in this process: INPUT... Parquet or OpenAI Batch (.jsonl) files, globs or
    URLs -> -o OUT."""
    from batchspec.jobs.runner import run_local
    if metrics_port:
        from batchspec.jobs.metrics import serve_local
        serve_local(metrics_port)
    doc = run_local(build_spec(config, **options), progress=not quiet, overwrite=overwrite)
    if doc.get("already_complete"):
        _already_complete(doc)
        return
    _report(doc)
    click.echo(doc["job_id"])
    sys.exit(0 if doc["state"] in SUCCESS else 1)


def _store(ctx):
    """The job store of --broker, checked to answer (a one-line error if it does not)."""
    from batchspec.jobs.celery_app import use_broker
    from batchspec.jobs.tasks import get_store
    use_broker(ctx.obj["broker"])
    store = get_store()
    store.r.ping()
    return store


def _get_job(store, job_id: str) -> dict:
    job = store.get(job_id)
    if job is None:
        raise click.ClickException(f"no job {job_id!r} in this Redis (see `batchspec jobs`)")
    if "state" not in job or "output" not in job:   # counters left of a record Redis lost
        raise click.ClickException(
            f"job {job_id!r} has only part of its record in this Redis (Redis lost it): "
            f"submit the job again with the same inputs and -o to finish it")
    return job


# how long `submit --wait` waits for a Redis it lost before it stops following the job
REDIS_WAIT_S = 60


class CtrlCHeld:
    """Ctrl-C (SIGINT) held off while the block runs, and raised as KeyboardInterrupt as it
    ends; pending() says whether one came. `submit` records a job and sends its tasks so:
    Ctrl-C stops it at a point of its own (before the next task; the workers' periodic check
    sends the rest), not inside Redis' or Celery's code. There, a KeyboardInterrupt could
    land in the modules Celery imports at its first send: inside the class body of one it
    came out as a RuntimeError with a traceback, and inside the code `namedtuple` compiles
    with eval, Python, having printed the command's message, ended the process by SIGINT
    (status -2 under `python -m`) instead of exit status 1. The signal is noted by a handler
    of its own meanwhile (blocking it in this thread would not do: the kernel hands a signal
    sent to the process to any thread not blocking it, and torch's threads do not). A second
    Ctrl-C is not held: where Redis hangs, a held one would wait out its socket timeouts, and
    the user asked twice. Outside the main thread, or where SIGINT is ignored, nothing is
    held."""
    def __enter__(self) -> CtrlCHeld:
        import signal
        import threading
        self._came, self._previous = False, None
        if threading.current_thread() is threading.main_thread() and \
                callable(signal.getsignal(signal.SIGINT)):
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        if self._came:            # the second: now, as Python's own handler would
            import signal
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
            self._came = False
            raise KeyboardInterrupt
        self._came = True
        click.echo("finishing the job's submission (Ctrl-C again to stop at once)", err=True)

    def pending(self) -> bool:
        return self._came

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            import signal
            signal.signal(signal.SIGINT, self._previous)
            if self._came:   # (Python's own handler raises KeyboardInterrupt)
                self._previous(signal.SIGINT, None)


def _import_for_waiting() -> None:
    """What wait_for imports, imported before the job is recorded: after it, Ctrl-C stops the
    waiting, and one that lands in an import has the effects CtrlCHeld says."""
    import redis  # noqa: F401
    import tqdm.auto  # noqa: F401


def wait_for(store, job_id: str, output: str, poll_s: float = 0.5,
             progress: bool = True) -> dict:
    """Follow a job just submitted (into `output`) to its end with a progress bar on stderr
    (requests, tokens/s)."""
    import redis
    from tqdm.auto import tqdm

    from batchspec.jobs.tasks import Every, try_reconcile

    def record() -> dict:
        job = store.get(job_id)
        if job is None or "state" not in job:
            # (a Redis restarted without persistence, or flushed, while the job ran)
            raise click.ClickException(
                f"job {job_id}'s record is gone from Redis (restarted without persistence, or "
                f"flushed?); the shards it finished stay in {output}: submit the job again "
                f"with the same inputs and -o to run the rest")
        return job
    job = record()
    say = check_problems(job_id, lambda line: tqdm.write(line, file=sys.stderr))
    check = Every(5.0, lambda: try_reconcile(job_id, store, say))
    with tqdm(total=job["requests_total"], unit="req", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        down_since = None
        while True:
            try:
                job = record()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # a Redis restart, or this host's path to it: wait it out, up to
                # REDIS_WAIT_S, saying so once (the checks, which need Redis, wait too)
                if down_since is None:
                    down_since = time.monotonic()
                    tqdm.write(f"lost Redis at {_redis_url()} ({_reason(e)}); waiting for it "
                               f"(job {job_id} goes on in the workers)", file=sys.stderr)
                elif time.monotonic() - down_since > REDIS_WAIT_S:
                    raise click.ClickException(
                        f"Redis at {_redis_url()} unreachable for over {REDIS_WAIT_S} s: stopped "
                        f"following job {job_id}, which goes on in the workers; follow it "
                        f"with batchspec status {job_id} once Redis is back") from None
                time.sleep(1.0)
                continue
            if down_since is not None:
                down_since = None
                tqdm.write("Redis is back", file=sys.stderr)
            check()  # carries the job on if its workers died or Redis restarted
            done = job["requests_completed"] + job["requests_failed"]
            bar.update(min(done + job["requests_in_progress"], bar.total) - bar.n)
            bar.set_postfix_str(f"{job['state']} {job.get('tokens_per_s', 0):.1f} tok/s")
            if job["state"] in FINAL:
                return job
            time.sleep(poll_s)


@click.command()
@job_options
@overwrite_option
@broker_option
@click.option("--wait", is_flag=True, help="Follow the job to its end (progress on stderr).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar with --wait.")
@click.pass_context
@clear_errors
def submit(ctx, config, wait, quiet, overwrite, **options):
    """Submit a job to the Celery workers; prints the job id (last line of stdout)."""
    store = _store(ctx)               # Redis first: nothing is written if it is not there
    from batchspec.jobs.runner import plan_job
    from batchspec.jobs.summary import check_output
    from batchspec.jobs.tasks import refuse_busy_output, submit_job
    spec = build_spec(config, **options)
    shards = plan_job(spec)
    refuse_busy_output(store, spec.output)      # (OutputBusy: one line, clear_errors)
    done = check_output(spec.to_dict(), shards, overwrite=overwrite)
    if done is not None:
        _already_complete(done)
        return
    from batchspec.jobs.spec import new_job_id
    job_id = spec.job_id = spec.job_id or new_job_id(spec.name)
    if wait:
        _import_for_waiting()
    try:
        # (with --overwrite, the directory is cleared once the job holds it: submit_job)
        with CtrlCHeld() as ctrl_c:
            submit_job(spec, shards, overwrite=overwrite, stop=ctrl_c.pending)
        if not wait:
            click.echo(job_id)
            return
        click.echo(f"submitted {job_id}", err=True)
        job = wait_for(store, job_id, spec.output, progress=not quiet)
    except KeyboardInterrupt:
        # Ctrl-C once the job is recorded (its shards' tasks being sent, or while waiting)
        # stops this command, not the job: shards whose tasks were not sent yet are sent by
        # the workers' periodic check
        if store.job_field(job_id, "state") in (None, "failed"):  # (while OUT was prepared)
            raise click.Abort() from None
        raise click.ClickException(
            f"interrupted; job {job_id} goes on in the workers: follow it with "
            f"batchspec status {job_id}, or stop it with batchspec cancel {job_id}") from None
    from batchspec.jobs.display import ending_of_record
    from batchspec.jobs.openai_batch import output_paths
    openai_files = output_paths(job["output"]) if spec.output_format == "openai" else None
    summary = _summary_so_far(store, job)   # (no summary in the record: _job.json not written)
    job["summary"] = {"acceptance_rate": summary} if isinstance(summary, str) else summary
    click.echo(ending_of_record(job, openai_files), err=True)
    click.echo(job_id)
    sys.exit(0 if job["state"] in SUCCESS else 1)


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@broker_option
@click.pass_context
@clear_errors
def status(ctx, job_id, as_json):
    """State, counts and throughput of a job."""
    from batchspec.jobs.tasks import try_reconcile
    store = _store(ctx)
    _get_job(store, job_id)
    try_reconcile(job_id, store, check_problems(job_id))
    job = _get_job(store, job_id)
    # Where running and failed shards are (host, pid, attempt, error): where to look.
    info, states = store.shard_info(job_id), store.shard_states(job_id)
    job["shards"] = {s: {"state": st, **info.get(s, {})} for s, st in sorted(states.items())
                     if st in ("running", "failed")}
    if as_json:
        click.echo(json.dumps(job, indent=2, sort_keys=True))
        return
    from batchspec.jobs.display import status_table
    click.echo(status_table(job, _alpha_so_far(store, job), job["shards"]))


def _summary_so_far(store, job: dict) -> dict | str:
    """The job's acceptance summary: its record's once it ended, else over the acceptance
    files of the shards done so far (a job whose `_job.json` could not be written has
    none in its record either); a string saying why when they cannot be read from here."""
    if "summary" in job:
        return job["summary"]
    from batchspec.jobs.outputs import output_fs
    from batchspec.jobs.summary import acceptance_summary
    try:
        fs, root = output_fs(job["output"])
        return acceptance_summary(fs, root, store.plan(job["job_id"]))
    except Exception as e:  # noqa: BLE001 - the output may live where this host cannot read
        return f"- (cannot read {job['output']} from here: {type(e).__name__})"


def _alpha_so_far(store, job: dict):
    """α of the job (_summary_so_far's), or a string saying why it is not known."""
    summary = _summary_so_far(store, job)
    return summary if isinstance(summary, str) else summary.get("acceptance_rate")


@click.command()
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="How many jobs.")
@broker_option
@click.pass_context
@clear_errors
def jobs(ctx, limit):
    """Recent jobs, newest first."""
    from batchspec.jobs.display import jobs_table
    click.echo(jobs_table(_store(ctx).recent(limit)))


@click.command()
@click.argument("job_id")
@broker_option
@click.pass_context
@clear_errors
def cancel(ctx, job_id):
    """Cancel a job: running shards stop between engine steps, queued ones do not start."""
    store = _store(ctx)
    _get_job(store, job_id)
    state = store.cancel(job_id)
    if state == "cancelling":   # its queued shards end now; with none running, the job too
        from batchspec.jobs.tasks import try_reconcile
        try_reconcile(job_id, store, check_problems(job_id))
        state = store.job_field(job_id, "state") or state
    click.echo(state)
    if state not in ("cancelling", "cancelled"):
        raise click.ClickException(f"job {job_id} is {state}; nothing to cancel")


@click.command()
@click.option("--device", envvar="BATCHSPEC_DEVICE",
              help="Device of this worker (cuda:N), or its group of GPUs for a "
                   "tensor-parallel target (cuda:0,cuda:1,...); one worker per GPU or group.")
@click.option("--tensor-parallel-size", type=int,
              help="Shard the target over this many GPUs counted from --device (default "
                   "cuda:0), e.g. CUDA_VISIBLE_DEVICES=4,5,6,7 ... --tensor-parallel-size 4.")
@click.option("--concurrency", type=int, default=1, show_default=True,
              help="Worker processes; each loads its own copy of the models.")
@click.option("--pool", type=click.Choice(["prefork", "solo"]), default="prefork",
              show_default=True, help="prefork keeps a parent that requeues the shard of a "
                                      "crashed child; solo runs shards in this process.")
@click.option("--loglevel", default="INFO", show_default=True, help="Celery log level.")
@click.option("--hostname", help="Celery node name (default: celery@HOST).")
@click.option("--stream", is_flag=True, envvar="BATCHSPEC_STREAM",
              help="Keep each process's engine full across shard tasks (the next shard's "
                   "rows join the batch while this one's tail generates).")
@metrics_option
@broker_option
@click.pass_context
@clear_errors
def worker(ctx, device, tensor_parallel_size, concurrency, pool, loglevel, hostname,
           metrics_port, stream):
    """Start a Celery worker that runs shards."""
    from batchspec.config import check_device, rank_devices
    from batchspec.jobs.celery_app import QUEUE, use_broker
    from batchspec.jobs.lease import check_interval, lease_renew, lease_ttl, step_timeout
    for setting in (lease_ttl, lease_renew, check_interval, step_timeout):
        setting()        # a malformed BATCHSPEC_* setting fails here, in one line
    if tensor_parallel_size is not None:  # the worker's devices decide the ranks of its jobs
        if tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        names = (device or "cuda").split(",")
        device = ",".join(names if len(names) > 1 else
                          rank_devices(names[0], tensor_parallel_size))
    if device:
        for name in device.split(","):
            check_device(name.strip())
        os.environ["BATCHSPEC_DEVICE"] = device  # read by the pool's children
    os.environ["BATCHSPEC_STREAM"] = "1" if stream else ""
    if metrics_port:  # before the pool forks: its children record, this process serves
        from batchspec.jobs.metrics import serve_worker
        serve_worker(metrics_port, ctx.obj["broker"], QUEUE)
    # (no gossip or mingle: batchspec's workers coordinate through the job store alone,
    # and after a Redis outage Celery's gossip logged a long traceback per restart)
    argv = ["worker", f"--concurrency={concurrency}", f"--pool={pool}",
            f"--loglevel={loglevel}", "-Q", QUEUE, "--without-gossip", "--without-mingle"]
    use_broker(ctx.obj["broker"]).worker_main(argv + ([f"--hostname={hostname}"] if hostname else []))


@click.command()
@click.option("--jobs", "jobs_dir", default="jobs", show_default=True,
              envvar="BATCHSPEC_JOBS_DIR", help="Folder of job YAML files with a schedule.")
@click.option("--schedule-file", default="celerybeat-schedule", show_default=True,
              help="Where beat keeps the last run time of each entry.")
@click.option("--loglevel", default="INFO", show_default=True, help="Celery log level.")
@broker_option
@click.pass_context
@clear_errors
def beat(ctx, jobs_dir, schedule_file, loglevel):
    """Run Celery beat: each job YAML's schedule submits that job."""
    from batchspec.jobs.celery_app import use_broker
    from batchspec.jobs.schedule import load_schedules
    app = use_broker(ctx.obj["broker"])
    app.conf.beat_schedule = load_schedules(jobs_dir)
    for name, entry in app.conf.beat_schedule.items():
        click.echo(f"{name}: {entry['schedule']} -> {entry['args'][0]}", err=True)
    _clear_damaged_schedule(schedule_file)
    app.Beat(schedule=schedule_file, loglevel=loglevel).run()


def _clear_damaged_schedule(path: str) -> None:
    """Remove a schedule file left damaged (beat killed while writing it, a disk error),
    with one line saying so: each entry's next run then counts from now. Celery removes
    one too, but logs a traceback as it does."""
    import dbm
    import shelve
    kind = dbm.whichdb(path)
    if kind is None:            # none yet (or not readable: beat says why)
        return
    try:
        if not kind:
            raise ValueError("not a database file")
        with shelve.open(path, flag="r") as db:
            list(db.items())
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it goes
        for suffix in ("", ".db", ".dat", ".dir", ".bak"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + suffix)
        click.echo(f"the schedule file {path} was damaged ({type(e).__name__}: {e}); "
                   f"removed: each schedule's next run counts from now", err=True)


COMMANDS = [run, submit, status, jobs, cancel, worker, beat]
