"""Where a verification window's time goes against a decode step's, on the demo target: one
target forward over B rows of q = 1 and of q = k + 1 tokens, timed back to back at a context
of --context tokens (min and median of --repeats), then what the profiler gives each op a
forward (the linear layers, attention, the rest), then the linear op alone on the target's
weights at 1 .. k + 1 rows (the weights warm, as a forward back to back has them), with the
multiply-adds a second it reaches. At one row a decode step's linear layers are bound by
reading their weights; a window's by arithmetic (compare `benchmarks/cpu_peak.py`).

    python benchmarks/window_profile.py [--batch-size 1] [--k 4] [--context 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.tools.bench import demo_workload, make_llm  # noqa: E402


def timed(fn, repeats: int, warm: int = 30) -> tuple[float, float]:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models, dtype, _, _ = demo_workload(1)
    llm = make_llm("plain", models, args.batch_size, args.k, 0, 0.0, 1, dtype)
    runner, B, ctx = llm.engine.target, args.batch_size, args.context
    per_row = -(-(ctx + args.k + 1) // llm.engine.config.block_size)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(B)]

    def forward(q):
        return lambda: runner.forward([[0] * q] * B, [ctx] * B, tables, [q] * B).sum().item()
    qs = (1, args.k + 1)
    print(f"demo target, {dtype}, one thread, {B} row(s), {ctx} tokens of context")
    for q in qs:
        lo, med = timed(forward(q), args.repeats)
        print(f"forward, q={q}: min {lo * 1e3:.3f} ms, median {med * 1e3:.3f} ms")
    from torch.profiler import ProfilerActivity, profile
    n = 200
    for q in qs:
        run = forward(q)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                run()
        ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        linear = ops.get("batchspec::linear_packed", 0.0)
        attention = ops.get("batchspec::paged_decode_attention", 0.0)
        print(f"profiled, q={q}: linear layers {linear / n / 1e3:.3f} ms, attention "
              f"{attention / n / 1e3:.3f} ms, the rest {(sum(ops.values()) - linear - attention) / n / 1e3:.3f} ms a forward")
    # the linear op alone on the target's own packed weights (its layers' and its head's)
    from batchspec.models.llama import PackedWeight, linear
    model = runner.model
    packed = [w for layer in model.layers for w in layer.values() if isinstance(w, PackedWeight)]
    if isinstance(model.lm_head, PackedWeight):
        packed.append(model.lm_head)
    if not packed:
        print("the target's linear weights are not packed for the C++ op here")
        return
    print("linear op alone, weights warm: us a forward's calls (GMAC/s)")
    for m in range(1, args.k + 2):
        total_s = macs = 0.0
        for w in packed:
            x = torch.randn(m * B, w.in_features).to(model.dtype)
            lo, _ = timed(lambda w=w, x=x: linear(x, w), 100, warm=20)
            total_s += lo
            macs += m * B * w.out_features * w.in_features
        print(f"  {m * B:3d} rows: {total_s * 1e6:7.1f} us ({macs / total_s / 1e9:.1f} GMAC/s)")


if __name__ == "__main__":
    main()
