"""Tensor parallelism on CUDA GPUs (NCCL), for scripts/gpu_check.sh on a machine with two or
more GPUs: on random Llama / Qwen2 (one KV head, replicated) / Qwen3 (tied embeddings)
models, greedy tokens with TP=2 (and TP=4 where four GPUs are visible) equal TP=1's in fp32,
speculative decoding (n-gram) with TP=2 equals plain TP=2, and no rank process outlives
close(). bf16 agreement is printed, not required (rounding after a differently ordered
sum may move a near-tie). Exit code 1 on a mismatch.

    python scripts/gpu_tp_check.py
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from batchspec import LLM, SamplingParams
from batchspec.tools.tiny import make_random_model

PROMPTS = [[5, 17, 300, 42], [7], list(range(60, 140)), [11, 400, 11, 400, 11, 400, 11]] * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
CASES = {"llama": dict(arch="llama", num_kv_heads=4),
         "qwen2-kv1": dict(arch="qwen2", num_kv_heads=1),
         "qwen3-tied": dict(arch="qwen3", num_kv_heads=2, tie_word_embeddings=True)}


def tokens(path: str, devices: str, dtype: str, **kw) -> tuple[list[list[int]], list[int]]:
    llm = LLM(path, device=devices, dtype=dtype, kv_cache_memory_gb=1.0, **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    pids = getattr(llm.engine.target, "rank_pids", [])
    llm.engine.close()
    return [o.token_ids for o in outs], pids


def main() -> int:
    n = torch.cuda.device_count()
    assert n >= 2, "tensor parallelism needs two or more visible GPUs"
    sizes = [s for s in (2, 4) if s <= n]
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        for name, kw in CASES.items():
            kw = dict(kw)
            path = make_random_model(os.path.join(d, name), kw.pop("arch"), tokenizer=False,
                                     hidden_size=256, num_layers=4, num_heads=8,
                                     init_std=0.1, seed=3, **kw)
            for dtype in ("float32", "bfloat16"):
                ref, _ = tokens(path, "cuda:0", dtype)
                for size in sizes:
                    t0 = time.perf_counter()
                    got, pids = tokens(path, ",".join(f"cuda:{i}" for i in range(size)), dtype)
                    same = sum(a == b for a, b in zip(ref, got))
                    left = [p for p in pids if os.path.exists(f"/proc/{p}")]
                    ok = (same == len(ref) or dtype != "float32") and not left
                    failures += not ok
                    print(f"{name:11} {dtype:9} TP={size}: {same}/{len(ref)} rows identical to "
                          f"TP=1, ranks left after close: {len(left)} "
                          f"({time.perf_counter() - t0:.1f} s) {'ok' if ok else 'FAIL'}")
            spec, _ = tokens(path, "cuda:0,cuda:1", "float32", drafts={"default": "ngram"},
                             num_speculative_tokens=4, min_acceptance=0.0)
            plain, _ = tokens(path, "cuda:0,cuda:1", "float32")
            ok = spec == plain
            failures += not ok
            print(f"{name:11} float32   TP=2 n-gram speculation == plain: {'ok' if ok else 'FAIL'}")
    print("tensor parallelism:", "FAIL" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
