"""CPU attention of short rows: the C++ paged kernel (kernels/paged_attention_cpu.cpp; its
AVX-512 path and its portable path) against gather + SDPA (grouped matmuls in bf16), as the
time of one whole forward of a demo model over B rows of q new tokens each at a context of
--ctx tokens. The three take turns `--repeats` times within each shape; the fastest of each
is reported.

    python benchmarks/bench_attention.py --model target --ctx 160,700 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from batchspec.demo import demo_models  # noqa: E402
from batchspec.engine.runner import ModelRunner  # noqa: E402
from batchspec.layers import attention  # noqa: E402
from batchspec.spec._build import load  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="target", help="demo model: target, draft, ...")
    ap.add_argument("--ctx", default="160,700")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--q", default="1,2,3,5", help="new tokens per row (5: k = 4 verified)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runner = ModelRunner(demo_models()[args.model], "cpu", args.dtype)
    runner.allocate_kv_cache(8192, 16)
    kernel = load(False).paged_decode_attention
    print(f"{args.model}, {args.dtype}, 1 thread: forward ms, kernel (AVX-512) / kernel "
          "(portable) / gather + SDPA")
    for ctx in map(int, args.ctx.split(",")):
        for b in map(int, args.batch_sizes.split(",")):
            cells = []
            for q in map(int, args.q.split(",")):
                per_row = -(-(ctx + q) // 16)
                tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(b)]
                call = ([[1] * q] * b, [ctx] * b, tables, [q] * b)
                best = {}
                for _ in range(args.repeats):
                    for name, op in (("kernel", kernel), ("portable", kernel),
                                     ("gather", False)):
                        attention._cpu_op = op   # False: the gather + SDPA path
                        if name == "portable":
                            os.environ["BATCHSPEC_CPU_ATTENTION_PORTABLE"] = "1"
                        else:
                            os.environ.pop("BATCHSPEC_CPU_ATTENTION_PORTABLE", None)
                        runner.forward(*call)
                        t0 = time.perf_counter()
                        for _ in range(5):
                            runner.forward(*call)
                        best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / 5)
                cells.append(f"q={q} {best['kernel'] * 1e3:.1f} / {best['portable'] * 1e3:.1f}"
                             f" / {best['gather'] * 1e3:.1f}")
            print(f"ctx={ctx} B={b}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
