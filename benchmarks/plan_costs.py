"""Whether the adaptive policy's plans are too short for this machine: the templated job at
one batch size, by three engines in turns: suffix drafts with adaptive lengths planned from
the start-up costs as measured, the same with what a window's tokens add over a decode step
scaled by --scale (the plans' marginal cost of a slot), and suffix drafts at a fixed k.
If the scaled side runs faster, the start-up costs overprice verification slots here.
Each adaptive engine keeps its policy's lead from run to run (as a worker's engine does
from shard to shard), so its ratio moves a lot between invocations: compare several.

    python benchmarks/plan_costs.py [--batch-size 32] [--scale 0.5] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.spec.policy import StepCosts  # noqa: E402
from batchspec.tools import bench as bb  # noqa: E402
from batchspec.tools import hfref  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = demo_models()
    prompts = bb.templated_prompts(args.num_prompts)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    dtype = default_dtype(models["target"], "cpu")
    def llm(method):
        return bb.make_llm(method, models, args.batch_size, 4, 0, 0.0, 1, dtype)
    engines = {"adaptive, start-up costs": llm("suffix-adaptive"),
               f"adaptive, slots x{args.scale}": llm("suffix-adaptive"),
               "fixed k": llm("suffix")}
    policy = engines[f"adaptive, slots x{args.scale}"].engine.policy
    c = policy.costs      # a new StepCosts: none of the measured one's derived tables
    policy.costs = StepCosts(list(c.batch_sizes), {
        q: [t1 + args.scale * (t - t1) for t, t1 in zip(ts, c.target[1], strict=True)]
        for q, ts in c.target.items()}, dict(c.draft), c.prompt_token_s)
    best = dict.fromkeys(engines, 0.0)
    for i in range(args.repeats + 1):      # the first round warms every engine, untimed
        for name, engine in engines.items():
            r = bb.run_engine(engine, ids, domains=domains, temperature=0.0, max_tokens=64)
            if i:
                best[name] = max(best[name], r["tokens"] / r["wall_s"])
    print(f"{dtype}, {args.batch_size} rows, T=0, templated job; tok/s, fastest of "
          f"{args.repeats}")
    for name, rate in best.items():
        print(f"{name:28} {rate:8.1f}  {rate / best['fixed k']:.3f}x fixed k")


if __name__ == "__main__":
    main()
