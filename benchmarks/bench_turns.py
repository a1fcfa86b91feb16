"""How much of a side-by-side ratio is the machine: two engines on the demo models, over the
same prompts, timed as whole runs in turns and step by step in turns (what `batchspec bench
--turns runs|steps` does), each round's ratio second / first. Two engines of one method
(the default, plain against plain) have a true ratio of 1: the spread of the per-round
ratios is what each way of taking turns adds (docs/benchmarks.md).

    python benchmarks/bench_turns.py --batch-size 32 --temperature 0.8 --num-prompts 256
    python benchmarks/bench_turns.py --methods plain,spec-adaptive --turns steps --repeats 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.bench import METHODS, make_llm, run_engine, run_engines_in_turns  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--methods", default="plain,plain",
                    help="first,second, of " + ",".join(m for m in METHODS
                                                       if m not in ("hf", "hf-assisted")))
    ap.add_argument("--turns", choices=["runs", "steps", "both"], default="both")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = demo_models()
    prompts = load_prompts(None, None, args.num_prompts, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    kw = dict(domains=[p["domain"] for p in prompts], temperature=args.temperature,
              max_tokens=args.max_tokens)
    dtype = default_dtype(models["target"], "cpu")
    methods = args.methods.split(",")
    if len(methods) != 2 or not set(methods) <= set(METHODS) - {"hf", "hf-assisted"}:
        ap.error(f"--methods: two of {', '.join(METHODS[2:])}")
    llms = {name: make_llm(m, models, args.batch_size, 4, 0, 0.0, 1, dtype)
            for name, m in zip(("a", "b"), methods)}
    for llm in llms.values():
        run_engine(llm, ids[:args.batch_size], **kw)
    print(f"{methods[1]} over {methods[0]}, B={args.batch_size} T={args.temperature}, "
          f"{len(ids)} prompts, {args.repeats} rounds")
    for turns in ("runs", "steps") if args.turns == "both" else (args.turns,):
        ratios = []
        for _ in range(args.repeats):
            res = run_engines_in_turns(llms, ids, **kw) if turns == "steps" else \
                {name: run_engine(llm, ids, **kw) for name, llm in llms.items()}
            tok_s = {name: r["tokens"] / r["wall_s"] for name, r in res.items()}
            ratios.append(tok_s["b"] / tok_s["a"])
        print(f"turns {turns}: ratios {' '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.3f}, spread {min(ratios):.3f}-"
              f"{max(ratios):.3f}")


if __name__ == "__main__":
    main()
