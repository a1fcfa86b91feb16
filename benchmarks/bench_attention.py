"""CPU forward paths, side by side: the time of one whole forward of a demo model over B rows
of q new tokens each at a context of --ctx tokens, through each path of one choice. The paths
take turns `--repeats` times within each shape, in one process; the fastest of each is
reported.

--compare attention (default): attention of short rows through the C++ paged kernel
(kernels/paged_attention_cpu.cpp) by its default paths (bf16: AMX tiles where the CPU has
AMX, else pair products where it has AVX512-BF16; AVX-512 for the rest, else AVX2), by pair
products (bf16), AVX-512 alone and AVX2 alone where the CPU has them, by its portable path,
and through gather + SDPA (grouped matmuls in bf16).
--compare linear: the linear layers as the C++ op (kernels/linear_cpu.cpp: bf16 on AMX tiles
or AVX512-BF16, fp32 on AVX2, with a bf16 checkpoint's weights stored in bf16 and, beside it,
in fp32) against oneDNN on prepacked weights (BATCHSPEC_CPU_LINEAR=onednn).
--compare rmsnorm: the fused C++ RMSNorm (kernels/fused_cpu.cpp, residual add included)
against the torch ops it replaces.
--compare fused: every fused C++ op of a layer (RMSNorm, SwiGLU's silu(gate) * up, RoPE of q
and k), RMSNorm alone fused, and the torch ops.

    python benchmarks/bench_attention.py --model target --ctx 160,700
    python benchmarks/bench_attention.py --compare rmsnorm --model target,draft --ctx 160 --q 1,5
    python benchmarks/bench_attention.py --compare fused --model target,draft --ctx 160 --q 1,5
    python benchmarks/bench_attention.py --compare linear --model target,draft --ctx 160 --q 1,5
    python benchmarks/bench_attention.py --compare linear --dtype float32 --ctx 160 --q 1,5
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from batchspec.demo import demo_models  # noqa: E402
from batchspec.engine.runner import ModelRunner  # noqa: E402
from batchspec.layers import attention  # noqa: E402
from batchspec.spec._build import load  # noqa: E402


def attention_paths(runner):
    """The kernel by its default path (bf16: AMX tiles where the CPU has them, else pair
    products where it has AVX512-BF16; else AVX-512, else AVX2), by each explicit path this
    CPU has, by its portable path, and gather + SDPA."""
    from batchspec.config import cpu_matmul_isa
    kernel = load(False).paged_decode_attention
    switches = ("BATCHSPEC_CPU_ATTENTION_PORTABLE", "BATCHSPEC_CPU_ATTENTION_AMX",
                "BATCHSPEC_CPU_ATTENTION_AVX2", "BATCHSPEC_CPU_ATTENTION_DPBF16")

    def use(op, **env):
        def setup():
            attention._cpu_op = op   # False: the gather + SDPA path
            for name in switches:
                os.environ.pop(name, None)
            os.environ.update({f"BATCHSPEC_CPU_ATTENTION_{k.upper()}": v for k, v in env.items()})
        return setup
    isa = cpu_matmul_isa()
    paths = {"kernel (default path)": use(kernel)}
    if isa in ("amx", "avx512_bf16") and runner.model.dtype == torch.bfloat16:
        paths["pair-product kernel"] = use(kernel, amx="0")
    if isa in ("amx", "avx512_bf16", "avx512"):
        paths["AVX-512 kernel"] = use(kernel, amx="0", dpbf16="0")
    if isa != "other":
        paths["AVX2 kernel"] = use(kernel, avx2="1")
    return {**paths, "portable kernel": use(kernel, portable="1"),
            "gather + SDPA": use(False)}


def rmsnorm_paths(runner):
    fused = runner.model.fused
    if fused is None:
        sys.exit("the fused op is unavailable here (no compiler, or BATCHSPEC_CPU_FUSED=0)")

    def use(ops):
        def setup():
            runner.model.fused = ops
        return setup
    return {"fused RMSNorm": use(fused), "torch RMSNorm": use(None)}


def fused_paths(runner):
    fused = runner.model.fused
    if fused is None:
        sys.exit("the fused ops are unavailable here (no compiler, or BATCHSPEC_CPU_FUSED=0)")

    def use(ops, swiglu_rope):
        def setup():
            runner.model.fused = ops
            runner.model.fuse_swiglu_rope = swiglu_rope
        return setup
    return {"all fused": use(fused, True), "RMSNorm fused": use(fused, False),
            "torch ops": use(None, False)}


def linear_paths(runner):
    layout = runner.model.weight_layout
    if layout not in ("amx", "avx512_bf16", "avx2"):
        sys.exit("the C++ linear op is unavailable here (bf16 on a CPU with AMX tiles or "
                 "AVX512-BF16, or fp32 on a CPU with AVX2)")

    def load_model(choice):   # the model again, its linear layers as BATCHSPEC_CPU_LINEAR says
        os.environ["BATCHSPEC_CPU_LINEAR"] = choice
        model = ModelRunner(runner.path, "cpu", str(runner.model.dtype).removeprefix("torch."))
        del os.environ["BATCHSPEC_CPU_LINEAR"]
        return model.model
    other = load_model("onednn")
    assert other.weight_layout == "onednn"

    def use(model):
        def setup():
            runner.model.layers, runner.model.lm_head = model.layers, model.lm_head
        return setup
    mine = SimpleNamespace(layers=runner.model.layers, lm_head=runner.model.lm_head)
    paths = {f"C++ linear op ({layout})": use(mine)}
    if layout == "avx2":   # weights of bf16 values stored in bf16, and in fp32
        paths["C++ op, fp32-stored"] = use(load_model("avx2-fp32"))
    return paths | {"oneDNN": use(other)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", choices=["attention", "rmsnorm", "fused", "linear"],
                    default="attention")
    ap.add_argument("--model", default="target", help="demo models, comma-separated")
    ap.add_argument("--ctx", default="160,700")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--q", default="1,2,3,5", help="new tokens per row (5: k = 4 verified)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.model.split(","):
        runner = ModelRunner(demo_models()[name], "cpu", args.dtype)
        runner.allocate_kv_cache(8192, 16)
        paths = {"attention": attention_paths, "rmsnorm": rmsnorm_paths, "fused": fused_paths,
                 "linear": linear_paths}[args.compare](runner)
        print(f"{name}, {args.dtype}, 1 thread: forward ms, " + " / ".join(paths))
        for ctx in map(int, args.ctx.split(",")):
            for b in map(int, args.batch_sizes.split(",")):
                cells = []
                for q in map(int, args.q.split(",")):
                    per_row = -(-(ctx + q) // 16)
                    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(b)]
                    call = ([[1] * q] * b, [ctx] * b, tables, [q] * b)
                    best = {}
                    for _ in range(args.repeats):
                        for path, setup in paths.items():
                            setup()
                            runner.forward(*call)
                            t0 = time.perf_counter()
                            for _ in range(5):
                                runner.forward(*call)
                            best[path] = min(best.get(path, 1e9),
                                             (time.perf_counter() - t0) / 5)
                    cells.append(f"q={q} " + " / ".join(f"{best[p] * 1e3:.1f}" for p in paths))
                print(f"ctx={ctx} B={b}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
