"""batchspec LLM.generate vs transformers generate (batched, left-padded) on the same random
~30M-parameter Llama, 64 prompts of mixed length, greedy, fixed output length.

    python benchmarks/bench_engine.py [--num-prompts 64] [--max-tokens 64] [--threads N] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import LLM, SamplingParams  # noqa: E402
from batchspec.tools.tiny import make_random_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both engines [torch's default]")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    d = tempfile.mkdtemp()
    path = make_random_model(d, "llama", vocab_size=16384, hidden_size=512, num_layers=6,
                             num_heads=8, num_kv_heads=8, intermediate_size=1408,
                             tie_word_embeddings=True, tokenizer=False, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 16384, size=int(n)).tolist()
               for n in rng.integers(16, 257, size=args.num_prompts)]
    n_tokens = args.num_prompts * args.max_tokens

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                              max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens)
        return out[:, width:].tolist()

    llm = LLM(path, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run_bs():
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    engines = (("transformers", run_hf), ("batchspec", run_bs))
    times = {name: [] for name, _ in engines}
    tokens = {}
    for _, fn in engines:
        fn()  # warm-up
    # Interleaved repeats, best of each: on a shared machine the speed drifts over minutes,
    # and running one engine's repeats after the other's would measure the drift.
    for _ in range(args.repeats):
        for name, fn in engines:
            t0 = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t0)
    results = {name: {"seconds": min(times[name]), "tok_s": n_tokens / min(times[name]),
                      "tokens": tokens[name]} for name, _ in engines}
    same = sum(a == b for a, b in zip(results["transformers"]["tokens"],
                                      results["batchspec"]["tokens"]))
    ratio = results["batchspec"]["tok_s"] / results["transformers"]["tok_s"]
    print(f"model: random Llama, {n_params / 1e6:.1f}M params, fp32, {torch.get_num_threads()} "
          f"threads; {args.num_prompts} prompts of 16-256 tokens, {args.max_tokens} new each")
    print(f"{'engine':<14}{'seconds':>10}{'tok/s':>10}")
    for name in ("transformers", "batchspec"):
        r = results[name]
        print(f"{name:<14}{r['seconds']:>10.2f}{r['tok_s']:>10.1f}")
    print(f"batchspec / transformers: {ratio:.2f}x; identical outputs: {same}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                       for k, v in results.items()} | {"ratio": ratio, "identical": same}, f)


if __name__ == "__main__":
    main()
