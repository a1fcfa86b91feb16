"""Acceptance rate α of a demo draft with its vocabulary's list (draft_vocab.json) and with its
whole vocabulary, by temperature: the measure behind config.draft_vocab_for's line. Held-out
prompts of one domain, the domain's draft, fp32, k = 4, every row drafting through the list
(draft_vocab=True) or none (False), α summed over the seeds.

    python benchmarks/draft_vocab_alpha.py --domain code --temperatures 0.2,0.4,0.8
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import LLM, SamplingParams  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--domain", default="code", choices=["code", "docs"])
    ap.add_argument("--temperatures", default="0.2,0.4,0.8")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = demo_models()
    prompts = [p["prompt"] for p in load_prompts(None, args.domain, args.num_prompts,
                                                 split="heldout", seed=0)]
    print(f"draft-{args.domain}, {len(prompts)} held-out prompts, k = 4, fp32")
    for t in (float(v) for v in args.temperatures.split(",")):
        alphas = {}
        for listed in (True, False):
            accepted = drafted = 0
            for seed in (int(s) for s in args.seeds.split(",")):
                llm = LLM(models["target"], drafts={"default": models[f"draft-{args.domain}"]},
                          num_speculative_tokens=4, device="cpu", dtype="float32", seed=seed,
                          min_acceptance=0.0, draft_vocab=listed)
                outs = llm.generate(prompts, SamplingParams(temperature=t,
                                                            max_tokens=args.max_tokens),
                                    use_tqdm=False)
                accepted += sum(o.stats["total_accepted"] for o in outs)
                drafted += sum(o.stats["total_drafted"] for o in outs)
            alphas[listed] = accepted / drafted
        print(f"T = {t}: α {alphas[True]:.3f} with the list, {alphas[False]:.3f} with the "
              f"whole vocabulary", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
