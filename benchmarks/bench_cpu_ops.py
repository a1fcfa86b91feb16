"""The CPU ops behind the engine's CPU choices, one thread:

1. linear layers, `F.linear` vs weights prepacked for oneDNN vs the C++ op
   (batchspec.models.llama, kernels/linear_cpu.cpp: bf16 on AMX tiles, or AVX512-BF16 on
   CPUs without them; fp32 on AVX2, which stores fp32 weights of bf16 values in bf16), with
   the weights cycled through 48 MB so that they come from memory, as in decoding; then
   (bf16) the demo target's five weights at ragged row counts, as a batch's steps have them
   when verification windows differ in length and prompts join: oneDNN, which makes a
   primitive for each row count and weight shape and keeps 1,024 of them, against the C++
   op, which has no per-shape state (also alone: --ragged);
2. attention of 32 short rows (4 query / 2 KV heads, head dim 64, 208 keys), SDPA vs the
   grouped matmuls batchspec uses for bf16 on CPU (batchspec.layers.attention);
3. a layer's elementwise ops in fp32 and bf16 at the demo target's widths (hidden 256, MLP
   768, 4 query and 2 KV heads of 64), the C++ ops (kernels/fused_cpu.cpp) on their explicit
   AVX2 / AVX-512 paths and on the loops the compiler vectorises, vs the torch expressions
   they replace: RMSNorm with the residual add, SwiGLU and RoPE, at 32 rows (a decode step
   at batch size 32) and 160 (its verification windows of 5 tokens);
4. a draft's output layer (the demo drafts' 4,096 x 192) in bf16 on AMX tiles vs its int8
   copy (kernels/head_int8_cpu.cpp: AVX512-VNNI up to 7 rows, AMX-INT8 tiles from 8), at
   1-64 rows, the weight read warm as in a round's draft steps;
5. a round of a demo draft's k = 4 steps at 1-32 rows (contexts of 120 tokens; bf16
   where the CPU computes bf16, else fp32): one C++ call (kernels/draft_steps_cpu.cpp) vs
   the runner's forward and the argmax per step; and the call sampling at T = 0.8 (q and
   the draw every step).

    python benchmarks/bench_cpu_ops.py [--ragged]
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.layers.attention import _grouped_attention  # noqa: E402
from batchspec.models.llama import apply_rope, fused_ops, linear, prepack, rms_norm, weight_packer  # noqa: E402


def per_call_us(fn, args_list, rounds=3):
    for args in args_list:
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for args in args_list:
            fn(*args)
    return (time.perf_counter() - t0) / (rounds * len(args_list)) * 1e6


def elementwise_cases(ops, dt, rows):
    """name -> (C++ op, its arguments, the torch expression it replaces) at the demo target's
    widths"""
    w = torch.randn(256, dtype=dt)
    freqs = torch.outer(torch.arange(2048).float(),
                        1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    h, res = torch.randn(rows, 256).to(dt), torch.randn(rows, 256).to(dt)
    gate_up = torch.randn(rows, 2 * 768).to(dt)
    qkv = torch.randn(rows, 512).to(dt)
    pos = torch.randint(0, 2048, (rows,))
    return {
        "add + RMSNorm": (lambda a, b: ops.add_rms_norm_(a, b, w, 1e-6), (h, res),
                          lambda a, b: rms_norm(a + b, w, 1e-6)),
        "SwiGLU": (ops.silu_mul, (gate_up,), lambda x: F.silu(x[:, :768]) * x[:, 768:]),
        "RoPE": (lambda x: ops.rope_qk(x, cos, sin, pos, 4, 2), (qkv,),
                 lambda x: apply_rope(x[:, :384].view(rows, 6, 64), cos[pos].unsqueeze(1),
                                      sin[pos].unsqueeze(1))),
    }


def ragged_rows(lo: int = 32, hi: int = 300, passes: int = 3):
    """The demo target's five bf16 weights (qkv, o, gate_up, down, the output layer) at
    every row count in [lo, hi) in a shuffled order, pass after pass: ms per row count (the
    five products) by oneDNN (prepacked) and by the C++ op, and what oneDNN's primitives
    added to the process's resident memory. The weights stay warm (one copy each): what
    differs is the per-shape work."""
    import random
    kind, pack = weight_packer(torch.bfloat16, torch.device("cpu"))
    try:   # oneDNN packs bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT)
        prepack(torch.zeros(16, 16).bfloat16())
    except RuntimeError as e:
        print(f"\nbf16 products at ragged row counts: skipped, oneDNN cannot pack bf16 "
              f"weights on this CPU ({e})")
        return
    if kind not in ("amx", "avx512_bf16"):
        print("\nbf16 products at ragged row counts: skipped, the C++ op has no bf16 path "
              "on this CPU")
        return
    shapes = [(512, 256), (256, 256), (1536, 256), (256, 768), (4096, 256)]
    ws = [torch.randn(n, k).bfloat16() for n, k in shapes]
    counts = list(range(lo, hi))
    xs = {m: {k: torch.randn(m, k).bfloat16() for k in (256, 768)} for m in counts}

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20

    print(f"\nbf16 products of the demo target's 5 weights at each of {len(counts)} row counts "
          f"({lo}-{hi - 1}), shuffled, ms per row count, pass by pass")
    rng = random.Random(0)
    for name, packed in (("oneDNN", [prepack(w) for w in ws]), ("C++ op", [pack(w) for w in ws])):
        before, times = rss_mb(), []
        for _ in range(passes):
            order = counts[:]
            rng.shuffle(order)
            t0 = time.perf_counter()
            for m in order:
                for (_, k), w in zip(shapes, packed):
                    linear(xs[m][k], w)
            times.append((time.perf_counter() - t0) / len(counts) * 1e3)
        print(f"{name:<7} " + " ".join(f"{t:7.3f}" for t in times) +
              f"   resident memory +{rss_mb() - before:.0f} MB")


def main():
    torch.set_num_threads(1)
    if "--ragged" in sys.argv[1:]:
        ragged_rows()
        return
    packers = {dt: weight_packer(dt, torch.device("cpu")) for dt in (torch.bfloat16,
                                                                         torch.float32)}
    layout, pack_amx = packers[torch.bfloat16]
    print("weight [out x in]  dtype       rows  F.linear us  prepacked us  C++ op us")
    shapes = [((1536, 256), torch.bfloat16, r) for r in (1, 5, 32, 96, 160)] + \
        [((4096, 256), torch.bfloat16, r) for r in (1, 5, 32, 96)] + \
        [((1536, 256), torch.float32, r) for r in (1, 5, 32, 160)] + \
        [((256, 768), torch.float32, r) for r in (1, 5)] + [((4096, 256), torch.float32, 5)] + \
        [((1536, 256), "bf16 values", r) for r in (1, 5, 32)]
    for (n, k), dt, rows in shapes:
        # "bf16 values": fp32 weights that are bf16 numbers (a bf16 checkpoint run in fp32),
        # which the AVX2 op stores in bf16
        values = dt
        dt = torch.float32 if dt == "bf16 values" else dt
        ws = [torch.randn(n, k, dtype=dt) for _ in range(max(4, (48 << 20) // (n * k * 2)))]
        if values == "bf16 values":
            ws = [w.bfloat16().float() for w in ws]
        x = torch.randn(rows, k, dtype=dt)
        plain = per_call_us(F.linear, [(x, w) for w in ws])
        try:   # oneDNN packs bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT)
            packed = per_call_us(linear, [(x, prepack(w)) for w in ws])
        except RuntimeError:
            packed = None
        kind, pack = packers[dt]   # the C++ op: AMX or AVX512-BF16 (bf16), AVX2 (fp32)
        mine = per_call_us(linear, [(x, pack(w)) for w in ws]) \
            if kind in ("amx", "avx512_bf16", "avx2") else None
        name = values if isinstance(values, str) else str(dt)[6:]
        print(f"{n:>5} x {k:<9} {name:<11} {rows:>4} {plain:>10.1f} "
              f"{'-' if packed is None else f'{packed:.1f}':>13} "
              f"{'-' if mine is None else f'{mine:.1f}':>10}")
    B, hq, hkv, nq, ctx, d = 32, 4, 2, 1, 208, 64
    mask = (torch.rand(B, 1, nq, ctx) > 0.1)
    print(f"\nattention, {B} rows x {nq} query, {ctx} keys: SDPA us / grouped matmuls us")
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(B, h, n, d, dtype=dt) for h, n in ((hq, nq), (hkv, ctx),
                                                                 (hkv, ctx)))
        sdpa = per_call_us(lambda *a: F.scaled_dot_product_attention(
            *a, attn_mask=mask, enable_gqa=True), [(q, k, v)] * 50)
        grouped = per_call_us(lambda *a: _grouped_attention(*a, mask, d ** -0.5),
                              [(q, k, v)] * 50)
        print(f"{str(dt)[6:]:<9} {sdpa:10.0f} {grouped:10.0f}")
    ops = fused_ops(torch.bfloat16, torch.device("cpu"))
    if ops is None:
        return
    user_switch = os.environ.get("BATCHSPEC_CPU_FUSED_PORTABLE")
    print("\nelementwise ops, us per call: C++ op / its compiler-vectorised loops "
          "(BATCHSPEC_CPU_FUSED_PORTABLE) / torch ops")
    for dt in (torch.float32, torch.bfloat16):
        for rows in (32, 160):
            cells = []
            for name, (op, args, ref) in elementwise_cases(ops, dt, rows).items():
                times = []
                for portable in (False, True):   # (the op reads the switch on every call)
                    os.environ.pop("BATCHSPEC_CPU_FUSED_PORTABLE", None)
                    if portable:
                        os.environ["BATCHSPEC_CPU_FUSED_PORTABLE"] = "1"
                    times.append(per_call_us(op, [args] * 200))
                times.append(per_call_us(ref, [args] * 200))
                cells.append(f"{name} {' / '.join(f'{t:.1f}' for t in times)}")
            print(f"{str(dt)[6:]:<9} {rows:>4} rows: " + "   ".join(cells))
    os.environ.pop("BATCHSPEC_CPU_FUSED_PORTABLE", None)
    if user_switch is not None:   # the rest of the run as the caller set it
        os.environ["BATCHSPEC_CPU_FUSED_PORTABLE"] = user_switch
    if layout == "amx" and ops.head_int8_fast():
        print("\ndraft output layer 4,096 x 192, us per call: int8 copy / bf16 on AMX tiles")
        head = torch.randn(4096, 192).bfloat16() * 0.05
        packed, scales, sums = ops.pack_head_int8(head)
        bf16 = pack_amx(head)
        for rows in (1, 4, 8, 32, 64):
            x = torch.randn(rows, 192).bfloat16()
            int8 = per_call_us(lambda a: ops.head_int8(a, packed, scales, sums, 4096), [(x,)] * 300)
            tiles = per_call_us(lambda a: linear(a, bf16, float_out=True), [(x,)] * 300)
            print(f"{rows:>4} rows: {int8:6.1f} / {tiles:6.1f}")
    ragged_rows()
    draft_steps()


def draft_steps(k: int = 4, ctx: int = 120):
    from batchspec.config import default_dtype
    from batchspec.demo import demo_models
    from batchspec.engine.runner import ModelRunner
    from batchspec.spec.verify import greedy_tokens
    path = demo_models()["draft-code"]
    dtype = default_dtype(path, "cpu")   # bf16 where the CPU computes it, else fp32
    runner = ModelRunner(path, "cpu", dtype)
    runner.use_int8_head()   # as the engine does for drafts (where the CPU has a fast path)
    per_row = -(-(ctx + k + 1) // 16)
    runner.allocate_kv_cache(32 * per_row, 16)
    if not runner.steps_in_one_call:
        return
    print(f"\na round of the demo code draft's {k} steps ({dtype}), us per round: one C++ "
          f"call / forward and argmax per step (greedy), and one C++ call sampled at T = 0.8")
    for rows in (1, 8, 32):
        tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
        runner.forward([list(range(1, ctx + 1))] * rows, [0] * rows, tables, [1] * rows)

        def loop(rows, tables):
            cur = [[7]] * rows
            for step in range(k):
                logits = runner.forward(cur, [ctx + step] * rows, tables, [1] * rows)
                cur = [[t] for t in greedy_tokens(logits).tolist()]

        def call(rows, tables, sampled=False):
            sampling = ([0.8] * rows, list(range(rows)), [0] * rows, [0] * rows,
                        [1.0] * rows) if sampled else None
            runner.draft_steps([[7]] * rows, [ctx] * rows, tables, [k] * rows,
                               sampling=sampling)

        # the three in turns, ten blocks of 20 calls each, the fastest block of each: a
        # shared machine's slow stretches then fall on all three
        ways = (call, loop, lambda *a: call(*a, sampled=True))
        best = [float("inf")] * len(ways)
        for _ in range(10):
            for i, f in enumerate(ways):
                best[i] = min(best[i], per_call_us(f, [(rows, tables)] * 20, rounds=1))
        one, step_by_step, sampled = best
        print(f"{rows:>4} rows: {one:8.1f} / {step_by_step:8.1f}   sampled {sampled:8.1f} "
              f"(+{sampled - one:.1f})")


if __name__ == "__main__":
    main()
