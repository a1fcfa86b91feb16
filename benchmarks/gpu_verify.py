"""GPU benchmark of the verification op: achieved bandwidth of the CUDA kernel against the
torch reference and, when importable, FlashInfer's chain_speculative_sampling.

    python benchmarks/gpu_verify.py            # B in {1,32,256} x k in {1,4,8} x V in {32k,128k,152k}
    python benchmarks/gpu_verify.py --quick    # B=32, k=4, V=32000 only

Bandwidth = bytes of target logits (bf16, read once: (N+B) * V * 2) / time per call.
FlashInfer takes probabilities, so its time is given for the sampling kernel alone and with
the softmax that turns our logits into its input. Run by scripts/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from bench_verify import make_inputs  # noqa: E402

from batchspec.spec.verify import rejection_sample  # noqa: E402


def cuda_ms(fn, budget_ms=200.0, max_iters=50):
    """Mean ms per call over an adaptive number of iterations (~budget_ms), CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    iters = int(max(3, min(max_iters, budget_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def flashinfer_fns(args, B, k):
    """(chain only, softmax + chain) closures, or None when FlashInfer is missing/incompatible."""
    try:
        from flashinfer.sampling import chain_speculative_sampling
    except Exception:  # noqa: BLE001 - optional dependency
        return None
    logits, q, drafts, _, T, _, _ = args
    V = logits.shape[1]
    q3, d2 = q.view(B, k, V), drafts.view(B, k).int()

    def probs():
        return torch.softmax(logits.float() / T.repeat_interleave(k + 1)[:, None], -1).view(B, k + 1, V)

    p3 = probs()
    attempts = [lambda p: chain_speculative_sampling(q3, d2, p),           # flashinfer >= 0.2
                lambda p: chain_speculative_sampling(                       # 0.1.x: uniforms
                    q3, d2, torch.rand(B, k + 1, device=q.device), p)]
    for chain in attempts:
        try:
            chain(p3)
            break
        except Exception as e:  # noqa: BLE001 - report and try the older signature
            err = e
    else:
        print(f"flashinfer chain_speculative_sampling unusable: {err}")
        return None
    return (lambda: chain(p3)), (lambda: chain(probs()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    dev = torch.device("cuda")
    shapes = [(32, 4, 32000)] if args.quick else [
        (B, k, V) for V in (32000, 128256, 151936) for B in (1, 32, 256) for k in (1, 4, 8)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 logits, T=1")
    head = (f"{'B':>4} {'k':>2} {'V':>7} {'acc':>5} | {'cuda ms':>8} {'GB/s':>7} | "
            f"{'torch ms':>8} {'GB/s':>7} | {'fi ms':>7} {'fi+smax':>7} | same")
    print(head + "\n" + "-" * len(head))
    for B, k, V in shapes:
        print(bench_shape(B, k, V, dev), flush=True)
        torch.cuda.empty_cache()


def bench_shape(B, k, V, dev) -> str:
    """One table row: the CUDA kernel, the torch reference and FlashInfer on one shape."""
    inputs, _ = make_inputs(B, k, V, "random", device=dev)
    gbytes = inputs[0].numel() * inputs[0].element_size() / 1e9
    out, acc = rejection_sample(*inputs, backend="cuda")
    ref, _ = rejection_sample(*inputs, backend="torch")
    same = bool(torch.equal(out, ref))
    t_cuda = cuda_ms(partial(rejection_sample, *inputs, backend="cuda"))
    t_ref = cuda_ms(partial(rejection_sample, *inputs, backend="torch"), max_iters=5)
    fi = flashinfer_fns(inputs, B, k)
    fi_txt = " ".join(f"{cuda_ms(f):>7.3f}" for f in fi) if fi else f"{'n/a':>7} {'n/a':>7}"
    return (f"{B:>4} {k:>2} {V:>7} {float(acc.float().mean()) / k:>5.2f} | "
            f"{t_cuda:>8.3f} {gbytes / t_cuda * 1e3:>7.0f} | "
            f"{t_ref:>8.2f} {gbytes / t_ref * 1e3:>7.0f} | {fi_txt} | {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
