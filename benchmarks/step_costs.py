"""The start-up costs an adaptive engine measures (batchspec.spec.policy.StepCosts): one
target forward over B rows of q tokens each (q = 1: a decode step; q = k + 1: k drafts
verified) and one forward of each draft over B rows, in ms, on this machine. What q = k + 1
adds over q = 1, per token, against q = 1's time per row is what a verified token costs
against a decoded one: the nearer to 1, the less speculation saves at that batch size.
The last line is the most any draft source could make over plain decoding at each batch size
if every draft were accepted and drafting cost nothing: a pass of q tokens makes q tokens in
t(q) where plain decoding makes one in t(1), so the best over q of q * t(1) / t(q).

With --context N the forwards are timed again at N tokens of context (the engine times them
at STEP_COST_CONTEXT, 128): a longer context makes a decode step's attention, which reads the whole cache, a
larger part of its time, and a window's extra tokens add to its products only.

    python benchmarks/step_costs.py [--batch-size 64] [--k 4] [--context 512]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.engine.engine import STEP_COST_CONTEXT  # noqa: E402
from batchspec.tools.bench import make_llm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=64, help="the engine's max rows")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=None,
                    help="tokens of context to time the forwards at (default: the engine's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = demo_models()
    dtype = default_dtype(models["target"], "cpu")
    llm = make_llm("spec-adaptive", models, args.batch_size, args.k, 0, 0.0, 1, dtype)
    costs, context = llm.engine.policy.costs, STEP_COST_CONTEXT
    if args.context is not None:
        costs = llm.engine.measure_step_costs(ctx_len=args.context)
        context = args.context
    context = max(1, min(context, llm.engine.max_model_len - args.k - 1))  # as it clamps
    print(f"demo target, {dtype}, one thread, {context} tokens of context; ms per forward")
    print("rows      " + "".join(f"{b:>8}" for b in costs.batch_sizes))
    for q, values in sorted(costs.target.items()):
        print(f"target q={q}" + "".join(f"{v * 1e3:8.2f}" for v in values))
    top = max(costs.target)
    print(f"q={top} / q=1" + "".join(f"{a / b:8.2f}" for a, b in
                                      zip(costs.target[top], costs.target[1], strict=True)))
    for name, values in costs.draft.items():
        print(f"draft {name:5}" + "".join(f"{v * 1e3:8.2f}" for v in values))
    print("ceiling   " + "".join(
        f"{max(q * costs.target[1][i] / costs.target[q][i] for q in costs.target):8.2f}"
        for i in range(len(costs.batch_sizes))))


if __name__ == "__main__":
    main()
