"""Plain decoding at several CPU thread counts, side by side on one engine: each round runs
the same prompts at every count in turn (torch.set_num_threads between runs), and the table
gives each count's fastest run and its median ratio, round by round, to the first count.
The C++ ops (linear layers, RMSNorm, SwiGLU, RoPE, attention) run on torch's threads; the
logits are the same at any count (tests/test_models.py).

    python benchmarks/bench_threads.py                         # the demo target
    python benchmarks/bench_threads.py --target models/smollm2-135m --batch-sizes 1,16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from batchspec import LLM, SamplingParams  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="model directory [the demo target]")
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}",
                    help="thread counts, the first the baseline [1,all cores]")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    from batchspec.demo import demo_models
    from batchspec.llm import freeze_heap
    from batchspec.tools import hfref
    from batchspec.tools.evaluate import load_prompts
    target = a.target or demo_models()["target"]
    counts = [int(n) for n in a.threads.split(",")]
    tok = hfref.load_tokenizer(target)
    prompts = load_prompts(None, None, a.num_prompts, split="heldout", seed=0)
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    print(f"{target}, {a.dtype}, {len(ids)} prompts, {a.max_tokens} new tokens each")
    print("| B | threads | tok/s (fastest) | x first count (median, paired) |")
    print("| --- | --- | --- | --- |")
    for batch_size in (int(b) for b in a.batch_sizes.split(",")):
        llm = LLM(target, device="cpu", dtype=a.dtype, num_speculative_tokens=0,
                  max_num_seqs=batch_size, num_threads=counts[0])
        llm.generate(ids[:batch_size], params, use_tqdm=False)     # first-call costs
        freeze_heap()
        runs = {n: [] for n in counts}
        for _ in range(a.repeats):
            for n in counts:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                outs = llm.generate(ids, params, use_tqdm=False)
                runs[n].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        for n in counts:
            ratio = statistics.median(x / b for x, b in zip(runs[n], runs[counts[0]]))
            print(f"| {batch_size} | {n} | {max(runs[n]):,.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
