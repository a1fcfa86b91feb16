"""What a CPU fast path is worth to a job: one speculative method on the demo models with
the path on and off, against plain decoding, in one process. The three take turns in every
round; each ratio is the median over rounds of a run over the plain run of its round
(docs/benchmarks.md). --compare host-paths (default): the verification op's host paths
against its generic loops and a scalar loop for the drafts' greedy tokens
(BATCHSPEC_VERIFY_HOST_DRAW=0); --compare draft-head: the drafts' int8 output layer against
their bf16 one (BATCHSPEC_CPU_DRAFT_HEAD=bf16); --compare draft-steps: a draft's steps in one
C++ call against the step-by-step loop (BATCHSPEC_CPU_DRAFT_STEPS=python); --compare
attention: the C++ attention kernel by its default path (AMX, pair products, AVX-512 or AVX2,
as the CPU has them) against its portable one (BATCHSPEC_CPU_ATTENTION_PORTABLE=1); --compare
dpbf16-attention: bf16 attention by pair products against the AVX-512 path
(BATCHSPEC_CPU_ATTENTION_DPBF16=0; a CPU with AVX512-BF16 and no AMX); --compare linear:
the linear layers' C++ op (AMX or AVX512-BF16 for bf16, AVX2 for fp32) against oneDNN's product
(BATCHSPEC_CPU_LINEAR=onednn); --compare compact-weights: fp32 models' weights of bf16 values
(bf16 checkpoints) stored in bf16 for the AVX2 op against stored in fp32
(BATCHSPEC_CPU_LINEAR=avx2-fp32). The last four change plain decoding too: plain decoding with
the path off runs beside the others (its own ratio to plain is what the path is worth to it),
and `--method plain` measures plain decoding alone.

    python benchmarks/bench_host_paths.py --batch-size 32 --temperature 0 --method spec-domain
    python benchmarks/bench_host_paths.py --batch-size 1 --domain code --num-prompts 16 \
        --compare draft-head
    python benchmarks/bench_host_paths.py --batch-size 8 --temperature 0.8 \
        --compare draft-steps
    python benchmarks/bench_host_paths.py --batch-size 32 --method plain --compare attention
    python benchmarks/bench_host_paths.py --batch-size 32 --method suffix \
        --compare dpbf16-attention
    python benchmarks/bench_host_paths.py --batch-size 1 --domain code --num-prompts 16 \
        --compare linear
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.config import cpu_matmul_isa, default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.bench import METHODS, make_llm, run_engine  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--method", default="spec-domain",
                    choices=[m for m in METHODS if m not in ("hf", "hf-assisted")])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--domain", default=None, help="prompts of one domain [code and docs]")
    ap.add_argument("--compare", choices=("host-paths", "draft-head", "draft-steps",
                                          "attention", "dpbf16-attention", "linear",
                                          "compact-weights"),
                    default="host-paths")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = demo_models()
    prompts = load_prompts(None, args.domain, args.num_prompts, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    dtype = default_dtype(models["target"], "cpu")
    if args.compare == "dpbf16-attention" and not (
            dtype == "bfloat16" and (cpu_matmul_isa() == "avx512_bf16" or (
                cpu_matmul_isa() == "amx" and
                os.environ.get("BATCHSPEC_CPU_ATTENTION_AMX") == "0"))):
        sys.exit("--compare dpbf16-attention times bf16 attention by pair products, which "
                 "runs on CPUs with AVX512-BF16 and no AMX (on an AMX CPU, set "
                 f"BATCHSPEC_CPU_ATTENTION_AMX=0); this one is {cpu_matmul_isa()}, {dtype}")
    env, on, off, labels = {"host-paths": ("BATCHSPEC_VERIFY_HOST_DRAW", "1", "0",
                                           ("host paths", "generic loops")),
                            "draft-head": ("BATCHSPEC_CPU_DRAFT_HEAD", "int8", "bf16",
                                           ("int8 draft head", "bf16 draft head")),
                            "draft-steps": ("BATCHSPEC_CPU_DRAFT_STEPS", "cpp", "python",
                                            ("C++ draft steps", "step by step")),
                            # None: the switch unset (the kernel reads whether it is set)
                            "attention": ("BATCHSPEC_CPU_ATTENTION_PORTABLE", None, "1",
                                          ("default attention", "portable attention")),
                            "dpbf16-attention": ("BATCHSPEC_CPU_ATTENTION_DPBF16", None, "0",
                                                 ("pair-product attention",
                                                  "AVX-512 attention")),
                            "linear": ("BATCHSPEC_CPU_LINEAR", None, "onednn",
                                       ("C++ linears", "oneDNN linears")),
                            "compact-weights": ("BATCHSPEC_CPU_LINEAR", None, "avx2-fp32",
                                                ("bf16-stored weights", "fp32-stored")),
                            }[args.compare]

    def switch(value):
        if value is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = value
    variants = {"plain": ("plain", on), f"{args.method} ({labels[0]})": (args.method, on),
                f"{args.method} ({labels[1]})": (args.method, off)}
    if args.compare in ("attention", "dpbf16-attention", "linear", "compact-weights") and \
            args.method != "plain":
        variants[f"plain ({labels[1]})"] = ("plain", off)
    llms = {}
    for name, (method, value) in variants.items():    # (each switch is read at load)
        switch(value)
        llms[name] = make_llm(method, models, args.batch_size, 4, 0, 0.0, 1, dtype)

    def run(name, prompt_ids):
        switch(variants[name][1])
        r = run_engine(llms[name], prompt_ids, domains=domains,
                       temperature=args.temperature, max_tokens=args.max_tokens,
                       top_p=args.top_p)
        return r["tokens"] / r["wall_s"]

    for name in variants:                       # warm-up: one batch each
        run(name, ids[:args.batch_size])
    tok_s = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:
            tok_s[name].append(run(name, ids))
    switch(None)
    print(f"B={args.batch_size} T={args.temperature} top-p {args.top_p} "
          f"{args.num_prompts} prompts "
          f"({args.domain or 'code and docs'}), "
          f"{args.repeats} rounds, one thread")
    for name, runs in tok_s.items():
        paired = statistics.median(a / b for a, b in zip(runs, tok_s["plain"]))
        print(f"{name:32s} fastest {max(runs):8.1f} tok/s  x plain (paired) {paired:.3f}  "
              f"runs {', '.join(f'{x:.0f}' for x in runs)}")


if __name__ == "__main__":
    main()
