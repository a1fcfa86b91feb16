"""The two products of bf16 weights on CPUs without AMX tiles, side by side on the same packed
weight (kernels/linear_cpu.cpp): VDPBF16PS pair products (linear_packed_dp) and fp32 fused
multiply-adds of each pair widened as it is read (linear_packed_fma). One thread; the demo
target's seven weights of a layer (q, k, v, o, gate, up, down: 256 wide, MLP 768) at 1-160
rows, the weights warm as in a forward's layers; the two take turns in each of 15 rounds and
each keeps its fastest. Which one linear_packed takes in this process: linear_bf16_path
(measured once, at the first call; BATCHSPEC_CPU_BF16_PRODUCT=pairs or fma chooses).

    python benchmarks/bench_bf16_products.py [--rows 1,2,5,8,16,32,40,64,160]

Whole forwards of the demo target under each choice:

    BATCHSPEC_CPU_BF16_PRODUCT=pairs python benchmarks/window_profile.py --batch-size 32
    BATCHSPEC_CPU_BF16_PRODUCT=fma python benchmarks/window_profile.py --batch-size 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.config import cpu_matmul_isa, cpu_model  # noqa: E402
from batchspec.spec._build import load  # noqa: E402

SHAPES = [(256, 256), (128, 256), (128, 256), (256, 256), (768, 256), (768, 256), (256, 768)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5,8,16,32,40,64,160")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = load(False)
    if not ops.linear_bf16_available():
        sys.exit("this CPU has no AVX512-BF16: neither product runs here")
    fma, pairs = ops.linear_bf16_rates()
    print(f"{cpu_model()} ({cpu_matmul_isa()}); one core's multiply-adds a second: fp32 FMA "
          f"{fma:.1f} billion, VDPBF16PS {pairs:.1f} billion; linear_packed takes: "
          f"{ops.linear_bf16_path()}")
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).bfloat16()
        weights.append((ops.pack_linear_weight(w), k, n))
    paths = {"pairs": ops.linear_packed_dp, "fma": ops.linear_packed_fma}
    print(f"{'rows':>5} {'pairs us':>9} {'GMAC/s':>7} {'fma us':>9} {'GMAC/s':>7} "
          f"{'pairs / fma':>11}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k, generator=g).bfloat16() for _, k, _ in weights]
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.rounds):
            for name, op in paths.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    for (p, k, n), x in zip(weights, xs):
                        op(x, p, k, n, None)
                best[name] = min(best[name], (time.perf_counter() - t0) / 10)
        macs = sum(m * k * n for _, k, n in weights)
        print(f"{m:>5} {best['pairs'] * 1e6:>9.1f} {macs / best['pairs'] / 1e9:>7.1f} "
              f"{best['fma'] * 1e6:>9.1f} {macs / best['fma'] / 1e9:>7.1f} "
              f"{best['pairs'] / best['fma']:>11.2f}")


if __name__ == "__main__":
    main()
