"""Time `batchspec report` (every aggregate + JSON + HTML) over synthetic acceptance records.

    nice -n 10 python benchmarks/bench_report.py --records 1000000

The records are shaped like real ones: ~30 rounds per request (10 to 50), windows of k = 4 or
5 cut short now and then by the confidence threshold, a few fallbacks and plain requests,
α that depends on domain, temperature and output position (high early, lower in the middle).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.contract import ACCEPTANCE_SCHEMA  # noqa: E402
from batchspec.report.analysis import analyze  # noqa: E402
from batchspec.report.command import render_html, render_text  # noqa: E402

DOMAINS = np.array(["chat", "code", "rag", "summarize"])
DRAFTS = np.array(["llama-160m-distilled", "code-160m", "ngram", "llama-160m-distilled"])
BASE_P = np.array([0.82, 0.92, 0.95, 0.88])        # per-token acceptance at T = 0, by domain
TEMPERATURES = np.array([0.0, 0.0, 0.2, 0.3, 0.5, 0.7, 0.8, 1.0, 1.2], np.float32)
DRAFT_COST = 0.05                                # c = draft cost / target cost, per token


def _lists(values: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int32)))


def make_records(n: int, seed: int = 0, job_id: str = "job0") -> pa.Table:
    rng = np.random.default_rng(seed)
    dom = rng.integers(0, len(DOMAINS), n)
    temp = rng.choice(TEMPERATURES, n)
    is_plain = rng.random(n) < 0.05
    k = rng.choice([4, 5], n)
    num_rounds = rng.integers(10, 51, n)
    req = np.repeat(np.arange(n), num_rounds)                          # request of each round
    idx = np.arange(len(req)) - np.repeat(np.cumsum(num_rounds) - num_rounds, num_rounds)
    # Per-token acceptance: by domain, lower with temperature, high at the start of the
    # output, lowest in the middle, recovering towards the end.
    frac = idx / num_rounds[req]
    p = (BASE_P[dom] - 0.25 * temp)[req] * (1.0 + 0.12 * np.exp(-idx / 3) - 0.1 * np.sin(np.pi * frac))
    p = np.clip(p * rng.uniform(0.85, 1.1, n)[req], 0.02, 0.98)
    window = k[req].copy()
    cut = rng.random(len(req)) < 0.08                                 # confidence threshold
    window[cut] = rng.integers(0, window[cut])
    fell_back = ~is_plain & (rng.random(n) < 0.04)
    window[(fell_back[req] & (frac > 0.5)) | is_plain[req]] = 0
    run = np.floor(np.log(rng.random(len(req))) / np.log(p)).astype(np.int64)  # geometric
    accepted = np.minimum(run, window)
    tokens = accepted + 1
    pos = np.cumsum(tokens) - tokens
    pos -= np.repeat(pos[np.cumsum(num_rounds) - num_rounds], num_rounds)

    def per_request(x):
        return np.bincount(req, weights=x, minlength=n).astype(np.int64)

    drafted_r, accepted_r, tokens_r = per_request(window), per_request(accepted), per_request(tokens)
    rejections = per_request(accepted < window)
    depth = np.arange(5)
    mask = depth[None, :] < k[:, None]
    drafted_d = np.stack([per_request(window > d) for d in depth], 1)[mask]
    accepted_d = np.stack([per_request(accepted > d) for d in depth], 1)[mask]
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = np.where(drafted_r > 0, accepted_r / drafted_r, np.nan)
        p_hat = np.clip(accepted_r / (accepted_r + rejections), 0, 0.999)
    # each round at its own drafts (contract.rounds_speedup_theoretical); n-gram drafts free
    ph = p_hat[req]
    passes = per_request((1 - ph ** (window + 1)) / (1 - ph)) / num_rounds
    model = DRAFTS[dom] != "ngram"
    cost = per_request(window * model[req]) / num_rounds * DRAFT_COST
    speedup = np.where(is_plain, np.nan, passes / (1 + cost))
    prompt = rng.integers(32, 2049, n)
    cached = np.where(rng.random(n) < 0.5, 0, (prompt * rng.uniform(0, 0.9, n)).astype(np.int64))
    labels = pa.DictionaryArray.from_arrays(
        pa.array(dom[req].astype(np.int32), mask=window == 0), pa.array(DRAFTS)).cast(pa.string())
    sources = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(num_rounds)]).astype(np.int32)), labels)
    per_pass_s = 0.02 * np.where(is_plain, 1.0, 1 + k * DRAFT_COST)
    cols = {
        "request_id": pa.array(np.char.add(f"{job_id}-", np.arange(n).astype(str))),
        "job_id": pa.array(np.full(n, job_id)),
        "shard": pa.array(np.char.add("part-", (np.arange(n) // 10_000).astype(str))),
        "domain": pa.array(DOMAINS[dom]),
        "target": pa.array(np.full(n, "llama-8b")),
        "draft": pa.array(DRAFTS[dom], mask=is_plain),
        "temperature": pa.array(temp), "k_max": pa.array(k.astype(np.int32)),
        "confidence_threshold": pa.array(np.full(n, 0.3, np.float32)),
        "prompt_tokens": pa.array(prompt.astype(np.int32)),
        "cached_prompt_tokens": pa.array(cached.astype(np.int32)),
        "tokens_generated": pa.array(tokens_r.astype(np.int32)),
        "rounds": pa.array(num_rounds.astype(np.int32)),
        "total_drafted": pa.array(drafted_r.astype(np.int32)),
        "total_accepted": pa.array(accepted_r.astype(np.int32)),
        "acceptance_rate": pa.array(alpha, from_pandas=True),
        "mean_accepted_length": pa.array(tokens_r / num_rounds),
        "drafted_per_depth": _lists(drafted_d, k), "accepted_per_depth": _lists(accepted_d, k),
        "round_output_pos": _lists(pos, num_rounds), "round_drafted": _lists(window, num_rounds),
        "round_accepted": _lists(accepted, num_rounds), "round_source": sources,
        "skipped_by_confidence": pa.array(per_request(cut & ~is_plain[req]).astype(np.int32)),
        "fallback_triggered": pa.array(fell_back),
        "speedup_theoretical": pa.array(speedup, from_pandas=True),
        "wall_s": pa.array(num_rounds * per_pass_s),
    }
    return pa.Table.from_pydict(cols, schema=ACCEPTANCE_SCHEMA)


def write_jobs(root: str, records: int, jobs: int = 2, files_per_job: int = 4) -> list[str]:
    """`jobs` job output dirs under root, each with files_per_job acceptance shards."""
    outs = []
    for j in range(jobs):
        out = os.path.join(root, f"job-{j}")
        table = make_records(records // jobs, seed=j, job_id=f"job-{j}")
        os.makedirs(os.path.join(out, "acceptance"), exist_ok=True)
        step = -(-table.num_rows // files_per_job)
        for i in range(files_per_job):
            pq.write_table(table.slice(i * step, step),
                           os.path.join(out, "acceptance", f"part-{i:05d}.parquet"))
        outs.append(out)
    return outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--out", help="keep the synthetic job dirs here, or reuse them if present")
    ap.add_argument("--html", help="also keep the HTML report here")
    ap.add_argument("--repeat", type=int, default=3, help="time the report this many times")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="bench_report_")
    outs = sorted(glob.glob(os.path.join(root, "job-*")))
    if not outs:
        t0 = time.perf_counter()
        outs = write_jobs(root, args.records)
        print(f"generated {args.records:,} records in {time.perf_counter() - t0:.1f} s")
    times, cpu = [], []
    for _ in range(args.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        r = analyze(outs)
        text, page, doc = render_text(r), render_html(r), json.dumps(r, indent=2)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if args.html:
        with open(args.html, "w") as f:
            f.write(page)
    print(text)
    print(f"report over {r['summary']['requests']:,} records in {r['files']} files "
          f"(aggregates + text + JSON {len(doc):,} B + HTML {len(page):,} B), {len(times)} runs: "
          f"median {statistics.median(times):.2f} s, min {min(times):.2f} s wall; "
          f"median {statistics.median(cpu):.2f} s CPU (all threads)")


if __name__ == "__main__":
    main()
