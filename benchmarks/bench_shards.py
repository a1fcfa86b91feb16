"""`batchspec run`'s shard overlap: one job run by run_local (the next shard queued as soon as
the current one is admitted) against the same shards run one after another (run_shard each,
as a Celery worker does), on one LLM in one process, fastest of N each.

    python benchmarks/bench_shards.py [--rows 256] [--shard-size 32] [--max-num-seqs 32]

Demo family with its per-domain drafts; held-out standard-library prompts; per-row
max_tokens drawn from 8..96 so that rows finish at different times, as in real jobs."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import LLM, demo_models  # noqa: E402
from batchspec.jobs.runner import run_local, run_shard, start_job  # noqa: E402
from batchspec.jobs.spec import JobSpec  # noqa: E402
from benchmarks.jobinput import write_mixed_job  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_shards_")
    data = os.path.join(tmp, "in.parquet")
    write_mixed_job(data, args.rows)
    m = demo_models()
    llm = LLM(m["target"], drafts={"default": m["draft"], "code": m["draft-code"],
                                   "docs": m["draft-docs"]}, max_num_seqs=args.max_num_seqs)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for mode in ("overlapped", "one by one"):
            out = os.path.join(tmp, mode.replace(" ", "_"))
            shutil.rmtree(out, ignore_errors=True)
            spec = JobSpec(inputs=[data], output=out, shard_size=args.shard_size)
            t0 = time.perf_counter()
            if mode == "overlapped":
                run_local(spec, progress=False, llm=llm)
            else:
                for shard in start_job(spec):
                    run_shard(spec, shard, llm, job_id="bench")
            best[mode] = min(best.get(mode, float("inf")), time.perf_counter() - t0)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.rows} rows, shards of {args.shard_size}, max_num_seqs {args.max_num_seqs}")
    for mode, s in best.items():
        print(f"{mode:<12} {s:7.2f} s")
    print(f"one by one / overlapped: {best['one by one'] / best['overlapped']:.2f}x")


if __name__ == "__main__":
    main()
