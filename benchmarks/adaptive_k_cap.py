"""What the cap on a row's draft length (-k) is worth to adaptive lengths, beside plain.

-k (num_speculative_tokens) caps adaptive lengths. On the demo models, a plain engine, a fixed
k = 4 (`spec-domain`) and `spec-adaptive` at each cap given, all taking turns over the same
job as `batchspec bench` runs them (batchspec.tools.bench.run_engines_in_turns), after one
batch each as the bench's warm-up.
Prints each engine's tokens per second x plain (the fastest run of each, as the bench; and
the median of the runs' ratios to plain in the same run) and its tokens a pass in its last
run (the bench's column: contract.summarize's mean accepted length).

Adaptive lengths draft each row as far as its plan says pays, up to the cap; where rows'
drafts hold far (one row, T = 0) a cap of 4 binds at nearly every step:

    python benchmarks/adaptive_k_cap.py --batch-size 1 --temperature 0 --domain code --caps 4,8
    python benchmarks/adaptive_k_cap.py --batch-size 32 --temperature 0.8 --caps 4,8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.contract import summarize  # noqa: E402
from batchspec.tools import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--caps", default="4,8", help="caps of adaptive lengths to compare [4,8]")
    ap.add_argument("--domain", default=None, help="code or docs (default: both)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts a run takes [32 at one row, as the bench's one-row bar "
                         "runs; else max(64, 8 x batch size), as its matrix]")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    b, t = args.batch_size, args.temperature
    num = args.num_prompts or (32 if b == 1 else max(64, 8 * b))
    torch.set_num_threads(1)
    models, dtype, ids, domains = bench.demo_workload(num, args.domain)
    llms = {"plain": bench.make_llm("plain", models, b, 4, 0, 0.0, 1, dtype),
            "fixed k = 4": bench.make_llm("spec-domain", models, b, 4, 0, 0.0, 1, dtype)}
    for cap in caps:
        llms[f"adaptive, cap {cap}"] = bench.make_llm("spec-adaptive", models, b, cap, 0, 0.0,
                                                      1, dtype)
    from batchspec.llm import freeze_heap
    freeze_heap()
    for llm in llms.values():
        bench.run_engine(llm, ids[:max(2, b)], domains=domains, temperature=t,
                         max_tokens=args.max_tokens)
    rates: dict[str, list[float]] = {m: [] for m in llms}
    last: dict[str, dict] = {}
    for _ in range(args.repeats):
        for m, r in bench.run_engines_in_turns(llms, ids, domains=domains, temperature=t,
                                               max_tokens=args.max_tokens).items():
            rates[m].append(r["tokens"] / r["wall_s"])
            last[m] = r
    plain = max(rates["plain"])
    print(f"{b} rows, T = {t}, {num} prompts, {args.repeats} runs in turns; "
          f"plain {plain:,.0f} tok/s")
    print(f"{'engine':18} {'x plain':>8} {'paired':>8} {'tokens a pass':>14}")
    for m in llms:
        if m == "plain":
            continue
        paired = statistics.median(a / p for a, p in zip(rates[m], rates["plain"]))
        per_pass = summarize(last[m]["totals"])["mean_accepted_length"]
        print(f"{m:18} {max(rates[m]) / plain:8.3f} {paired:8.3f} {per_pass:14.3f}")


if __name__ == "__main__":
    main()
