"""The drafts' vocabularies (draft_vocab.json: their output layers score the 1,024 most
frequent tokens) against their whole vocabularies, in one process, on the demo models: a
plain engine and engines of one method, with draft_vocab=True (every row drafts through the
list), False (none does) and, with --per-row, None (each row by its temperature: the default),
take turns step by step (batchspec.tools.bench.run_engines_in_turns), so that a stretch in
which a shared machine runs slower lands on all of them alike. Prints each round's speedup
over plain of each, tokens a pass, and the medians of the rounds after the first (which warms
them). --temperature takes a list, which the rows take in turn (a job whose rows set their
own).

    python benchmarks/draft_vocab_ab.py --batch-size 1 --domain code --repeats 4
    python benchmarks/draft_vocab_ab.py --batch-size 8 --temperature 0,0.8 --per-row
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="spec-domain", help="a model-draft method of "
                    "batchspec bench (default spec-domain)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", default="0",
                    help="one temperature, or a comma-separated list the rows take in turn")
    ap.add_argument("--per-row", action="store_true",
                    help="also an engine that chooses per row (draft_vocab None)")
    ap.add_argument("--domain", help="only prompts of this domain")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="default: max(32, 8 x batch size)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    temps = [float(t) for t in args.temperature.split(",")]
    temperature = temps[0] if len(temps) == 1 else temps
    if not args.method.startswith("spec"):
        ap.error(f"{args.method} has no model draft: give a method starting with spec")
    sys.path.insert(0, ROOT)
    from batchspec.config import default_dtype
    from batchspec.contract import summarize
    from batchspec.demo import demo_models
    from batchspec.tools import hfref
    from batchspec.tools.bench import load_prompts, make_llm, run_engines_in_turns
    torch.set_num_threads(1)
    models = demo_models()
    n = args.num_prompts or max(32, 8 * args.batch_size)
    prompts = load_prompts(None, args.domain, n, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    dtype = default_dtype(models["target"], "cpu")    # as batchspec bench runs the demo
    llms = {"plain": make_llm("plain", models, args.batch_size, 4, 0, 0.0, 1, dtype),
            "draft vocab": make_llm(args.method, models, args.batch_size, 4, 0, 0.0, 1, dtype,
                                    draft_vocab=True),
            "whole vocab": make_llm(args.method, models, args.batch_size, 4, 0, 0.0, 1, dtype,
                                    draft_vocab=False)}
    if args.per_row:
        llms["per row"] = make_llm(args.method, models, args.batch_size, 4, 0, 0.0, 1, dtype)
    sizes = {name: sorted({p.runner.model.head_size for p in llm.engine.proposers.values()})
             for name, llm in llms.items() if name != "plain"}
    print(f"{args.method}, B={args.batch_size}, T={args.temperature}, {dtype}, logits a "
          f"draft scores {sizes}: x plain, paired (tokens a pass)")
    speedups: dict[str, list[float]] = {name: [] for name in llms if name != "plain"}
    for r in range(args.repeats + 1):
        res = run_engines_in_turns(llms, ids, domains=domains, temperature=temperature,
                                   max_tokens=args.max_tokens)
        ratios = {name: res[name]["tokens"] / res[name]["wall_s"]
                  / (res["plain"]["tokens"] / res["plain"]["wall_s"]) for name in speedups}
        passes = {name: summarize(res[name]["totals"])["mean_accepted_length"]
                  for name in speedups}
        if r:
            for name, values in speedups.items():
                values.append(ratios[name])
        print(f"round {r}{' (warm-up, not in the medians)' if not r else ''}: " + ", ".join(
            f"{name} {ratios[name]:.3f} ({passes[name]:.2f})" for name in speedups), flush=True)
    med = {name: statistics.median(v) for name, v in speedups.items()}
    print("median: " + ", ".join(f"{name} {v:.3f}" for name, v in med.items()) +
          f"; draft vocab / whole vocab {med['draft vocab'] / med['whole vocab']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
