"""Rows of new prompt tokens on CPU: the C++ paged attention kernel against SDPA one row at a
time, in whole forwards of a demo model (bf16, one thread). Shapes: a lone fresh prompt of L
tokens, and a 32-row step of decodes or 5-token windows beside one new row's prompt (what a
speculative job's steps look like: rows finish at staggered steps, so nearly every step
admits one), or beside a prefill chunk after cached context. The two settings take turns
every round; the ratio is the median over rounds of kernel / SDPA (docs/benchmarks.md).

    python benchmarks/bench_prompt_rows.py
    python benchmarks/bench_prompt_rows.py --lengths 128,256,512 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import batchspec.layers.attention as attention  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.engine.runner import ModelRunner  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="target", choices=["target", "draft"])
    ap.add_argument("--lengths", default="24,42,64,96,128")
    ap.add_argument("--context", type=int, default=100, help="keys of each decoding row")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows, ctx = 32, args.context
    blocks = -(-(max(ctx + 5, max(lengths) + 100)) // 16) + 1
    runner = ModelRunner(demo_models()[args.model], "cpu", "bfloat16")
    runner.allocate_kv_cache(rows * blocks + 8, 16)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(rows)]
    for i in range(rows):
        runner.forward([list(range(1, ctx + 1))], [0], [tables[i]], [1])

    def step(q, prompt, decoding=rows - 1, cached=0):
        inputs = [list(range(5, 5 + q))] * decoding + [list(range(7, 7 + prompt))]
        computed = [ctx] * decoding + [cached]
        logits = [q] * decoding + [1]
        return lambda: runner.forward(inputs, computed, tables[:decoding] + [tables[-1]],
                                      logits)

    shapes = {f"a prompt of {n} tokens alone": step(1, n, 0) for n in lengths}
    shapes["31 decodes + a 42-token prompt"] = step(1, 42)
    shapes["31 windows of 5 + a 42-token prompt"] = step(5, 42)
    shapes[f"31 windows of 5 + a 48-token chunk after {ctx}"] = step(5, 48, cached=ctx)
    limits = {"sdpa": attention.DECODE_MAX_Q, "kernel": 1 << 20}
    times = {(s, k): [] for s in shapes for k in limits}
    for _ in range(args.repeats):
        for name, run in shapes.items():
            for setting, limit in limits.items():
                attention.CPU_KERNEL_MAX_Q = limit
                run()
                t0 = time.perf_counter()
                for _ in range(4):
                    run()
                times[name, setting].append((time.perf_counter() - t0) / 4 * 1e3)
    print(f"{args.model}, bf16, 1 thread, {args.repeats} rounds (median ms; kernel / sdpa "
          f"paired)")
    for name in shapes:
        a, b = times[name, "sdpa"], times[name, "kernel"]
        print(f"{name}: sdpa {statistics.median(a):.2f}, kernel {statistics.median(b):.2f}, "
              f"{statistics.median(y / x for x, y in zip(a, b)):.3f}")


if __name__ == "__main__":
    main()
