"""Rows whose greedy output differs from plain decoding's, per speculation method, on held-out
code and docs prompts of the demo family (64 new tokens each). Exact speculation changes no
greedy token where the target computes a token alike in a verification window and in a
decode step: fp32, and bf16 on CPUs with AMX or AVX512-BF16 (kernels/linear_cpu.cpp, the
attention kernel). Elsewhere in bf16 a window rounds differently from a decode step, and a
near-tied token can flip.

    python benchmarks/greedy_agreement.py                          # bf16 where the CPU has it
    python benchmarks/greedy_agreement.py --batch-size 1
    python benchmarks/greedy_agreement.py --dtype float32
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from batchspec import SamplingParams  # noqa: E402
from batchspec.tools.bench import make_llm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="spec-domain,suffix,spec-adaptive")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    a = ap.parse_args()
    from batchspec.config import default_dtype
    from batchspec.demo import demo_models
    from batchspec.tools import hfref
    from batchspec.tools.evaluate import load_prompts
    torch.set_num_threads(1)
    models = demo_models()
    dtype = default_dtype(models["target"], "cpu") if a.dtype == "auto" else a.dtype
    prompts = load_prompts(None, None, a.num_prompts, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=64)

    def outputs(method):
        llm = make_llm(method, models, a.batch_size, 4, 0, 0.0, 1, dtype)
        return [o.token_ids for o in llm.generate(ids, params, domains=domains,
                                                  use_tqdm=False)]
    plain = outputs("plain")
    print(f"{len(ids)} prompts, batch size {a.batch_size}, {dtype}, T = 0")
    for method in a.methods.split(","):
        differ = [i for i, (p, o) in enumerate(zip(plain, outputs(method))) if p != o]
        print(f"{method:>14}: {len(differ)} rows differ from plain"
              + (f" (rows {differ[:10]})" if differ else ""))


if __name__ == "__main__":
    main()
