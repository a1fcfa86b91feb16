"""Job-level files of an output directory: `_plan.json` (what the directory holds, so a
different job is never resumed into it), and at the end `_job.json` and `_SUCCESS`.

Counts and the acceptance summary are read back from the files written rather than from
in-memory tallies, so a resumed job, a job finished by whichever Celery task completed the
last shard, and a local run all report the same numbers for the same directory."""
from __future__ import annotations

import json

import pyarrow.parquet as pq

from batchspec.contract import add_totals, summarize, totals
from batchspec.jobs.openai_batch import write_openai_files
from batchspec.jobs.outputs import output_fs, shard_counts, shard_path, write_atomic
from batchspec.jobs.shards import Shard
from batchspec.jobs.states import SUCCESS

TOTALS_COLUMNS = ["tokens_generated", "rounds", "total_drafted", "total_accepted",
                  "round_drafted", "round_accepted", "fallback_triggered"]


def acceptance_summary(fs, root: str, shards: list[Shard]) -> dict:
    """The acceptance summary (batchspec.contract.summarize) over every request of the
    job's finished shards."""
    t = totals([])
    for shard in shards:
        path = shard_path(root, "acceptance", shard)
        if not fs.exists(shard_path(root, "outputs", shard)) or not fs.exists(path):
            continue
        with fs.open(path, "rb") as f:
            records = pq.read_table(f, columns=TOTALS_COLUMNS).to_pylist()
        t = add_totals(t, totals(records))
    return summarize(t)


def final_state(counts: dict, cancelled: bool) -> str:
    if cancelled:
        return "cancelled"
    if counts["shards_failed"] and not counts["shards_completed"]:
        return "failed"
    if counts["shards_failed"] or counts["requests_failed"]:
        return "completed_with_errors"
    return "completed"


def finalize(spec_dict: dict, shards: list[Shard], *, job_id: str, timings: dict,
             failed_shards: dict[str, str], cancelled: bool = False, extra: dict | None = None
             ) -> dict:
    """Count, summarize, write `_job.json` then `_SUCCESS` (if the job succeeded). Returns
    the job document."""
    fs, root = output_fs(spec_dict["output"])
    completed = ok = bad = 0
    for shard in shards:
        n_ok, n_bad = shard_counts(fs, root, shard)
        completed += fs.exists(shard_path(root, "outputs", shard))
        ok, bad = ok + n_ok, bad + n_bad
    counts = {"shards_total": len(shards), "shards_completed": completed,
              "shards_failed": len(failed_shards),
              "shards_cancelled": len(shards) - completed - len(failed_shards) if cancelled else 0,
              "requests_total": sum(s.num_rows for s in shards),
              "requests_completed": ok, "requests_failed": bad}
    summary = acceptance_summary(fs, root, shards)
    wall = timings.get("wall_s")
    summary["tokens_per_s"] = summary["tokens_generated"] / wall if wall else None
    state = final_state(counts, cancelled)
    if spec_dict.get("output_format") == "openai":
        extra = (extra or {}) | {"openai_files": write_openai_files(
            fs, root, shards, job_id=job_id, model=spec_dict["model"])}
    doc = {"job_id": job_id, "state": state, "spec": spec_dict, "counts": counts,
           "timings": timings, "summary": summary, "failed_shards": failed_shards,
           **(extra or {})}
    write_atomic(fs, f"{root}/_job.json", json.dumps(doc, indent=2, default=str).encode())
    if state in SUCCESS:
        write_atomic(fs, f"{root}/_SUCCESS", b"")
    return doc


# Settings that change what a row's output is. Drafts, k and tau are not among them:
# speculative sampling is exact, so a job may resume with other drafts.
OUTPUT_SETTINGS = ("model", "temperature", "top_p", "top_k", "max_tokens", "seed",
                   "template", "chat")


def claim_output(spec_dict: dict, shards: list[Shard]) -> None:
    """Record the plan and output settings in OUT/_plan.json, or check that they match the
    ones already there: resuming another job's directory would mix outputs of two jobs
    under the same shard ids. Then clear `_SUCCESS` until the job finalizes again."""
    fs, root = output_fs(spec_dict["output"])
    plan = {"shards": [s.to_dict() for s in shards],
            **{k: spec_dict[k] for k in OUTPUT_SETTINGS}}
    path = f"{root}/_plan.json"
    if fs.exists(path):
        with fs.open(path, "rb") as f:
            old = json.load(f)
        changed = [k for k in plan if old.get(k) != plan[k]]
        if changed:
            what = "inputs or shard size" if changed == ["shards"] else ", ".join(changed)
            raise ValueError(f"{spec_dict['output']} holds a job with other {what}; "
                             f"resuming it would mix two jobs' outputs. Use another "
                             f"output directory, or delete this one to start over")
    else:
        write_atomic(fs, path, json.dumps(plan, indent=1).encode())
    if fs.exists(f"{root}/_SUCCESS"):
        fs.rm(f"{root}/_SUCCESS")
