"""What the job commands print for a person: the lines `run` and `submit --wait` end with,
the `status` table and the `jobs` list. (`status --json` prints the record itself.)"""
from __future__ import annotations

import os

BAR_WIDTH = 24


def _rate(alpha) -> str:
    """α as shown: a number, 'n/a' when nothing was drafted, or a string saying why not."""
    if isinstance(alpha, str):
        return alpha
    return "n/a (nothing drafted)" if alpha is None else f"{alpha:.3f}"


def _where(output: str, openai_files: dict | None = None) -> str:
    sep = "" if output.endswith("/") else "/"
    line = f"outputs in {output}{sep}outputs/ (errors/, acceptance/ beside it)"
    if openai_files:
        line += f"; OpenAI Batch files {openai_files['output']}, {openai_files['errors']}"
    return line + f"\nreport: batchspec report {output}"


def ending(state: str, *, completed: int, failed: int, total: int, shards_failed: int,
           shards_total: int, summary: dict | None, output: str,
           openai_files: dict | None = None, error: str | None = None) -> str:
    """How `run` and `submit --wait` end: counts, the job's error if it has one, α, where
    the outputs are (a job whose inputs hold no rows has none to point at)."""
    if not total:
        return f"{state}: the inputs hold no rows; nothing to run"
    summary = summary or {}
    lines = [f"{state}: {completed}/{total} requests done, {failed} failed"
             + (" (reasons in errors/)" if failed else "")
             + (f", {shards_failed}/{shards_total} shards failed" if shards_failed else "")]
    if error:
        lines.append(error)
    drafted, accepted = summary.get("total_drafted"), summary.get("total_accepted")
    alpha = f"acceptance rate α {_rate(summary.get('acceptance_rate'))}"
    if drafted:
        alpha += f" ({accepted:,} of {drafted:,} drafted tokens accepted)"
    tokens, speed = summary.get("tokens_generated"), summary.get("tokens_per_s")
    if tokens is not None:
        alpha += f"; {tokens:,} tokens generated"
        if drafted and tokens:
            from batchspec.contract import draft_token_share
            share = 100 * draft_token_share(accepted, tokens)
            shown = f"{share:.0f}" if share >= 1 or not accepted else f"{share:.1f}"
            alpha += f" ({shown}% from drafts)"
        alpha += f", {speed:.1f} tokens/s" if speed else ""
    lines += [alpha, _where(output, openai_files)]
    return "\n".join(lines)


def ending_of_doc(doc: dict) -> str:
    """ending() of a job document (`_job.json`)."""
    c = doc["counts"]
    return ending(doc["state"], completed=c["requests_completed"], failed=c["requests_failed"],
                  total=c["requests_total"], shards_failed=c["shards_failed"],
                  shards_total=c["shards_total"], summary=doc["summary"],
                  output=doc["spec"]["output"], openai_files=doc.get("openai_files"),
                  error=doc.get("error"))


def ending_of_record(job: dict, openai_files: dict | None = None) -> str:
    """ending() of a job record in Redis (JobStore.get)."""
    return ending(job["state"], completed=job["requests_completed"],
                  failed=job["requests_failed"], total=job["requests_total"],
                  shards_failed=job["shards_failed"], shards_total=job["shards_total"],
                  summary=(job.get("summary") or {}) | {"tokens_per_s": job.get("tokens_per_s")},
                  output=job["output"], openai_files=openai_files, error=job.get("error"))


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    filled = round(width * done / total) if total else width
    pct = 100 * done / total if total else 100.0
    return f"[{'#' * filled}{'-' * (width - filled)}] {pct:5.1f}%"


def status_table(job: dict, alpha: float | str | None, shards: dict[str, dict]) -> str:
    """`batchspec status JOB`: a short table. `alpha` is the acceptance rate over the shards
    done so far (None: nothing drafted; a string: why it is not known); `shards` are the
    running and failed shards with their info (host, pid, attempt, error)."""
    total = job["requests_total"]
    ended = job["requests_completed"] + job["requests_failed"]
    rows = [("job", job["job_id"]),
            ("state", job["state"]),
            ("progress", f"{progress_bar(ended, total)}  {ended}/{total} requests"
                         + (f" (+{job['requests_in_progress']} in running shards)"
                            if job.get("requests_in_progress") else "")),
            ("requests", f"{job['requests_completed']} done, {job['requests_failed']} failed"
                         + (" (reasons in OUT/errors/)" if job["requests_failed"] else "")),
            ("shards", f"{job['shards_completed']} done, {job['shards_failed']} failed, "
                       f"{job['shards_cancelled']} cancelled of {job['shards_total']}"),
            ("throughput", "-" if job.get("requests_per_s") is None else
             f"{job['requests_per_s']:.2f} requests/s, {job['tokens_per_s']:.1f} tokens/s "
             f"({job['tokens_generated']:,} tokens)"),
            ("acceptance α", _rate(alpha) if job["shards_completed"] else "- (no shard done yet)"),
            ("output", job["output"] or "-")]
    if job["state"] == "failed" and not job["shards_total"] and not job.get("started_at"):
        # a job that never ran a row (a beat firing that could not be submitted, an empty job
        # whose _job.json could not be written): no progress, counts or rates to show
        rows = rows[:2] + [("progress", "- (no row ran: see the error)"), rows[-1]]
    if job.get("error"):
        rows.append(("error", job["error"]))
    times = [f"{k.removesuffix('_at')} {job[k]}" for k in ("created_at", "started_at",
                                                           "finished_at") if job.get(k)]
    rows.append(("times", ", ".join(times)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    failed = {s: i for s, i in shards.items() if i.get("state") == "failed"}
    running = {s: i for s, i in shards.items() if i.get("state") == "running"}
    if failed:
        lines.append("failed shards:")
        lines += [f"  {s}  {i.get('error') or '(no reason recorded)'}"
                  + _where_ran(i) for s, i in sorted(failed.items())]
    if running:
        lines.append("running shards:")
        lines += [f"  {s} {_where_ran(i).strip()}" for s, i in sorted(running.items())]
    return "\n".join(lines)


def _where_ran(info: dict) -> str:
    parts = [f"{k} {info[k]}" for k in ("host", "pid", "attempt") if info.get(k) is not None]
    return f"  ({', '.join(parts)})" if parts else ""


JOBS_LEGEND = ("SHARDS: ended (done + failed) / total.  REQUESTS: done + failed / total "
               "(failed rows are in OUT/errors/).")


def jobs_table(jobs: list[dict]) -> str:
    lines = [f"{'JOB':40} {'STATE':22} {'SHARDS':>9} {'REQUESTS':>16} CREATED"]
    for j in jobs:
        shards = f"{j['shards_completed'] + j['shards_failed']}/{j['shards_total']}"
        reqs = f"{j['requests_completed']}+{j['requests_failed']}/{j['requests_total']}"
        lines.append(f"{j['job_id']:40} {j['state']:22} {shards:>9} {reqs:>16} "
                     f"{j['created_at']}")
    if not jobs:
        lines.append("(no jobs in this Redis)")
    return "\n".join(lines + ["", JOBS_LEGEND])


def draft_name(draft: str | None) -> str | None:
    """A draft as people name it: its model directory's name (or 'ngram'); the path stays
    in the records."""
    return os.path.basename(draft.rstrip("/")) if draft else draft
