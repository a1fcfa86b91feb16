"""Plain decoding, fixed k and adaptive k side by side: one process, the three LLMs run in
turn (interleaved) `--repeats` times, best of each; demo family with per-domain drafts,
held-out prompts of both domains, 64 new tokens.

    python benchmarks/bench_adaptive.py --batch-size 32 --temperature 0.8
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import LLM, SamplingParams, demo_models
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    m = demo_models()
    drafts = {"default": m["draft"], "code": m["draft-code"], "docs": m["draft-docs"]}
    common = dict(device="cpu", max_num_seqs=args.batch_size, num_threads=1)
    llms = {"plain": LLM(m["target"], **common),
            "fixed k": LLM(m["target"], drafts=drafts, min_acceptance=0.0, **common),
            "adaptive k": LLM(m["target"], drafts=drafts, min_acceptance=0.0,
                              adaptive_k=True, **common)}
    prompts = load_prompts(None, None, args.num_prompts, split="heldout", seed=0)
    tok = hfref.load_tokenizer(m["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=64)
    for llm in llms.values():  # warm-up
        llm.generate(ids[:2], params, domains=domains[:2], use_tqdm=False)
    best = dict.fromkeys(llms, 0.0)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(ids, params, domains=domains, use_tqdm=False)
            rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
            best[name] = max(best[name], rate)
    print(f"B={args.batch_size} T={args.temperature}")
    for name, rate in best.items():
        print(f"{name:<11} {rate:8.1f} tok/s  {rate / best['plain']:.3f}x plain")


if __name__ == "__main__":
    main()
