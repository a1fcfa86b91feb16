"""How often a demo draft's greedy token is the target's, with its output layer scoring the
N tokens most frequent in the demo's training text (both domains) against the whole
vocabulary: the target decodes held-out prompts greedily (batchspec, plain), the draft
(transformers, fp32) scores every position of those outputs, and its argmax over the N
tokens is compared with the target's token. Also prints the share of the target's tokens
among the N (coverage). The drafts ship with N = 1,024 (scripts/build_demo_models.py).

    python benchmarks/draft_vocab_agreement.py --draft draft-code --domain code
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="draft-code", choices=["draft", "draft-code", "draft-docs"])
    ap.add_argument("--domain", default="code", choices=["code", "docs"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="512,1024,1536,2048,3072")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from transformers import AutoModelForCausalLM

    from batchspec import LLM, SamplingParams
    from batchspec.demo import demo_models
    from batchspec.demo.corpus import DOMAINS, build_corpus
    from batchspec.models.loader import load_tokenizer
    from batchspec.spec import draft_vocab
    from batchspec.tools.evaluate import load_prompts
    torch.set_num_threads(2)
    models = demo_models()
    tok = load_tokenizer(models["target"])
    corpus = build_corpus()
    counts = draft_vocab.count_tokens(tok, (t for d in DOMAINS for _, t in corpus[d]["train"]))
    ranked = [t for t, _ in counts.most_common()]
    prompts = load_prompts(None, args.domain, args.num_prompts, split="heldout", seed=0)
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    outs = LLM(models["target"], device="cpu").generate(
        ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    draft = AutoModelForCausalLM.from_pretrained(models[args.draft], dtype=torch.float32).eval()
    V = draft.config.vocab_size
    sizes = [int(s) for s in args.sizes.split(",")] + [V]
    rows = {n: torch.tensor(sorted(ranked[:n])) for n in sizes}
    agree, covered, total = dict.fromkeys(sizes, 0), dict.fromkeys(sizes, 0), 0
    for prompt, out in zip(ids, outs):
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = draft(seq).logits[0, len(prompt) - 1:-1]    # each output's position
        target = torch.tensor(out.token_ids)
        total += len(target)
        for n, r in rows.items():
            agree[n] += int((r[logits[:, r].argmax(1)] == target).sum())
            covered[n] += int(torch.isin(target, r).sum())
    print(f"{args.draft} on {total} greedy target tokens of {len(ids)} held-out {args.domain} "
          f"prompts")
    print(f"{'tokens scored':>13} {'coverage':>9} {'agreement':>10}")
    for n in sizes:
        print(f"{n:>13} {covered[n] / total:>9.4f} {agree[n] / total:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
