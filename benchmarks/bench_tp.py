"""Plain decoding with the target on one rank and sharded over two (tensor parallelism over
gloo), side by side in one process: a random Llama of 32M parameters (hidden 512, 6 layers,
8 heads, 4 KV heads, vocab 16384, tied embeddings, fp32), prompts of 32 tokens, 64 new tokens
each, greedy; the engines run in turn `--repeats` times, best of each. TP=1 runs once on one
intra-op thread and once on as many as TP=2 uses in all (one per rank), so that it compares
at equal cores. Checks that the tokens are identical.

    python benchmarks/bench_tp.py --batch-sizes 1,16 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from batchspec import LLM, SamplingParams  # noqa: E402
from batchspec.tools.tiny import make_random_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = make_random_model(d, "llama", vocab_size=16384, hidden_size=512, num_layers=6,
                                 num_heads=8, num_kv_heads=4, tie_word_embeddings=True,
                                 tokenizer=False, seed=0)
        engines = {"TP=1, 1 thread": LLM(path, device="cpu", num_threads=1),
                   "TP=1, 2 threads": LLM(path, device="cpu", num_threads=2),
                   "TP=2 (gloo), 1 thread per rank": LLM(path, device="cpu", num_threads=1,
                                                         tensor_parallel_size=2)}
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        print(f"model: {engines['TP=1, 1 thread'].engine.target.num_params / 1e6:.1f}M "
              f"parameters; torch {torch.__version__}; {os.cpu_count()} CPUs")
        print("| batch | engine | tokens/s | vs TP=1, 1 thread |")
        print("| ---: | --- | ---: | ---: |")
        for b in map(int, args.batch_sizes.split(",")):
            prompts = torch.randint(1, 16384, (b, 32), generator=g).tolist()
            best, tokens = {}, {}
            for llm in engines.values():  # warm-up
                llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    torch.set_num_threads(llm.config.num_threads)  # a process-wide setting
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    dt = time.perf_counter() - t0
                    best[name] = min(best.get(name, float("inf")), dt)
                    tokens[name] = [o.token_ids for o in outs]
            assert len({str(t) for t in tokens.values()}) == 1, "TP changed the tokens"
            base = best["TP=1, 1 thread"]
            for name, dt in best.items():
                print(f"| {b} | {name} | {b * args.max_tokens / dt:.0f} | {base / dt:.2f}x |")
        for llm in engines.values():
            llm.engine.close()


if __name__ == "__main__":
    main()
