"""Benchmark of the verification op on CPU: the C++ twin ("cpu") against the torch reference.

    python benchmarks/bench_verify.py            # the table of docs/benchmarks.md
    python benchmarks/bench_verify.py --quick    # one shape
    python benchmarks/bench_verify.py --draws    # the cpu twin's vectorised host paths
                                                 # against its generic loops (plain draws
                                                 # and speculating rows), and the drafts'
                                                 # greedy tokens against torch's argmax

Every request drafts k tokens from a draft distribution close to the target's (acceptance
around 0.6-0.8); both backends get the same inputs and must return the same tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.spec.verify import greedy_tokens, rejection_sample  # noqa: E402


def make_inputs(B, k, V, mode, dtype=torch.bfloat16, seed=0, device="cpu"):
    """mode: "random" (T=1), "greedy" (T=0), "top-p" (T=0.8, top_p=0.9, top_k=50)."""
    g = torch.Generator(device).manual_seed(seed)
    opt = dict(generator=g, device=device)
    N = B * k
    logits = torch.randn(N + B, V, **opt) * 3                               # [N+B, V]
    is_draft = torch.ones(N + B, dtype=torch.bool, device=device)
    is_draft[torch.arange(B, device=device) * (k + 1) + k] = False
    q = torch.softmax(logits[is_draft] + 0.5 * torch.randn(N, V, **opt), -1)  # [N, V]
    drafts = torch.multinomial(q, 1, generator=g)[:, 0].int() if N else \
        torch.zeros(0, dtype=torch.int32, device=device)
    cu = (torch.arange(B + 1, device=device) * k).int()
    T = torch.full((B,), {"random": 1.0, "greedy": 0.0, "top-p": 0.8}[mode], device=device)
    kw = {}
    if mode == "top-p":
        kw = dict(top_k=torch.full((B,), 50, dtype=torch.int32, device=device),
                  top_p=torch.full((B,), 0.9, device=device))
    seeds = torch.arange(B, device=device) + 1
    args = (logits.to(dtype), q, drafts, cu, T, seeds, torch.zeros_like(seeds))
    return args, kw


def time_ms(fn, repeat):
    fn()                                                   # warm-up (and the one-time build)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compare_draws(repeat):
    """The cpu twin with its host paths (the vectorised bonus draw of verify_host.h and the
    row passes of verify_host_rows.h) and with the generic loops, in one process, on fp32
    logits as the engine passes them: plain draws (k = 0) and speculating rows (k = 4)."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 logits, median "
          f"of {repeat}: cpu ms, host paths / generic loops")
    shapes = [(B, 0, V, T, "random") for B, V in ((32, 4096), (64, 4096), (64, 32000))
              for T in (0.3, 0.8, 1.5)]
    shapes += [(B, 4, 4096, T, mode) for B in (8, 32) for T, mode in
               ((0.0, "greedy"), (0.8, "random"), (0.8, "top-p"))]
    for B, k, V, T, mode in shapes:
        inputs, kw = make_inputs(B, k, V, mode, dtype=torch.float32)
        inputs = (inputs[0] * 2,) + inputs[1:4] + (torch.full((B,), T),) + inputs[5:]
        times = {}
        for _ in range(2):
            for name, env in (("host", "1"), ("generic", "0")):
                os.environ["BATCHSPEC_VERIFY_HOST_DRAW"] = env
                fn = partial(rejection_sample, *inputs, backend="cpu", **kw)
                times.setdefault(name, []).append(time_ms(fn, repeat))
                times.setdefault(name + "_out", fn()[0])
        os.environ.pop("BATCHSPEC_VERIFY_HOST_DRAW")
        assert torch.equal(times["host_out"], times["generic_out"]), "draws disagree"
        host, generic = min(times["host"]), min(times["generic"])
        label = mode if mode != "random" else f"T={T}"
        print(f"B={B:>3} k={k} V={V:>6} {label:>7}: {host:.2f} / {generic:.2f} ms "
              f"({generic / host:.1f}x)")
    print("drafts' greedy tokens, fp32 logits: greedy_tokens (the twin's argmax_rows) / "
          "torch argmax(-1), ms")
    for B in (1, 8, 32, 64):
        logits = torch.randn(B, 4096) * 3
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
        ours = min(time_ms(partial(greedy_tokens, logits), repeat * 20) for _ in range(2))
        ref = min(time_ms(partial(logits.argmax, -1), repeat * 20) for _ in range(2))
        print(f"B={B:>3} V=  4096: {ours:.3f} / {ref:.3f} ms ({ref / ours:.1f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only B=64, k=4, V=32000, random")
    ap.add_argument("--draws", action="store_true", help="compare the host paths with the generic loops")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.draws:
        return compare_draws(args.repeat)
    shapes = [(64, 4, 32000, "random")]
    if not args.quick:
        shapes += [(64, 4, 32000, "greedy"), (64, 4, 32000, "top-p"), (64, 0, 32000, "random"),
                   (8, 4, 32000, "random"), (64, 8, 32000, "random"), (16, 4, 128256, "random")]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
          f"(load average {load}), bf16 logits, median of {args.repeat}")
    print(f"{'B':>4} {'k':>2} {'V':>7} {'mode':>7} {'accept':>7} {'torch ms':>9} "
          f"{'cpu ms':>8} {'speedup':>8}")
    for B, k, V, mode in shapes:
        inputs, kw = make_inputs(B, k, V, mode)
        ref = rejection_sample(*inputs, backend="torch", **kw)
        out = rejection_sample(*inputs, backend="cpu", **kw)
        assert torch.equal(ref[0], out[0]), f"backends disagree at {(B, k, V, mode)}"
        accept = float(ref[1].float().mean() / k) if k else float("nan")
        t_ref, t_cpu = (time_ms(partial(rejection_sample, *inputs, backend=b, **kw), args.repeat)
                        for b in ("torch", "cpu"))
        print(f"{B:>4} {k:>2} {V:>7} {mode:>7} {accept:>7.2f} {t_ref:>9.2f} {t_cpu:>8.2f} "
              f"{t_ref / t_cpu:>7.1f}x")


if __name__ == "__main__":
    main()
