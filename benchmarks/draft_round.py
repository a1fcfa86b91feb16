"""A draft's round (k greedy steps in one call, ModelRunner.draft_steps, as the engine runs
it on CPU) at B rows, with the draft's vocabulary (its draft_vocab.json) and with the whole
vocabulary, the two runners taking turns in blocks of rounds (the fastest block of each
kept): what scoring part of the vocabulary saves a draft's step. One thread, the draft's
int8 output layer where the CPU has one (as the engine sets drafts up).

    python benchmarks/draft_round.py                           # the demo code draft
    python benchmarks/draft_round.py --draft models/smollm2-135m --k 4
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", help="a draft model directory with draft_vocab.json "
                    "(default: the demo code draft)")
    ap.add_argument("--k", type=int, default=4, help="steps a round")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=128, help="tokens each row has seen")
    ap.add_argument("--blocks", type=int, default=8)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from batchspec.config import default_dtype
    from batchspec.demo import demo_models
    from batchspec.engine.runner import ModelRunner
    from batchspec.models.loader import read_config
    from batchspec.spec import draft_vocab
    torch.set_num_threads(1)
    path = args.draft or demo_models()["draft-code"]
    V = read_config(path).vocab_size
    ids = draft_vocab.load(path, V)
    if ids is None:
        sys.exit(f"{path} has no {draft_vocab.FILE}: write one with `batchspec draft-vocab`")
    dtype = default_dtype(path, "cpu")
    B, ctx, block = args.batch_size, args.context, 16
    per_row = -(-(ctx + args.k + 1) // block)
    runners = {}
    for name, rows in (("draft vocabulary", torch.tensor(ids)), ("whole vocabulary", None)):
        r = ModelRunner(path, "cpu", dtype, head_rows=rows)
        int8 = r.use_int8_head()
        r.allocate_kv_cache(B * per_row, block)
        if not r.steps_in_one_call:
            sys.exit("the C++ draft steps do not run for this model here")
        runners[name] = r
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(B)]
    call = ([[1]] * B, [ctx] * B, tables, [args.k] * B)
    reps = max(5, int(200 / args.k / B))
    best = dict.fromkeys(runners, float("inf"))
    for r in runners.values():
        for _ in range(3):
            r.draft_steps(*call)
    for _ in range(args.blocks):
        for name, r in runners.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                r.draft_steps(*call)
            best[name] = min(best[name], (time.perf_counter() - t0) / reps)
    print(f"{os.path.basename(path.rstrip('/'))}: {dtype}, output layer "
          f"{'int8' if int8 else dtype}; a round of {args.k} steps at {B} row(s), "
          f"context {ctx}, one thread")
    for name, s in best.items():
        scored = len(ids) if name == "draft vocabulary" else V
        print(f"{name:>17} ({scored:>6} tokens): {s * 1e3:.3f} ms a round")
    print(f"ratio: {best['whole vocabulary'] / best['draft vocabulary']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
