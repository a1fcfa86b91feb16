"""Each draft's acceptance by depth, as a fixed-k engine meets it on the demo models and
held-out prompts: per temperature and domain, the share of drafts at depth d accepted among
those judged (a draft is judged when every draft before it in its round was accepted), from
the acceptance records' rounds. The adaptive policy starts every depth at PRIOR_P
(batchspec/spec/policy.py) and learns from the rounds it drafts; this is what it would learn.

    python benchmarks/depth_acceptance.py [--batch-size 8] [--num-prompts 128]
        [--temperatures 0,0.8] [--max-tokens 64] [--k 4]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.tools.bench import _params, _start_afresh, demo_workload, make_llm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models, dtype, ids, domains = demo_workload(args.num_prompts)
    llm = make_llm("spec-domain", models, args.batch_size, args.k, 0, 0.0, 1, dtype)
    print(f"per-domain drafts, k = {args.k}, {args.batch_size} rows, {len(ids)} prompts; "
          "acceptance at depth 1..k (drafts judged)")
    for t in (float(x) for x in args.temperatures.split(",")):
        _start_afresh(llm)
        outs = llm.generate(ids, _params(t, 1.0, args.max_tokens), domains=domains,
                            use_tqdm=False)
        for domain in sorted(set(domains)):
            acc, judged = [0] * args.k, [0] * args.k
            for out, d in zip(outs, domains):
                if d != domain:
                    continue
                for n, a in zip(out.stats["round_drafted"], out.stats["round_accepted"]):
                    for depth in range(min(n, a + 1)):
                        judged[depth] += 1
                        acc[depth] += depth < a
            cells = [f"{a / j:.3f} ({j})" if j else "-" for a, j in zip(acc, judged)]
            print(f"T={t:<4} {domain:<6} " + "  ".join(cells))


if __name__ == "__main__":
    main()
