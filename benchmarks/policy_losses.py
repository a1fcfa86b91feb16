"""Where an adaptive engine loses time beside a plain engine, step by step: the two engines
(demo models, held-out prompts) take turns as `batchspec bench` runs them
(batchspec.tools.bench.run_engines_in_turns), after the bench's warm-up (one batch, then a
round at T = 0 first when --temperature is above 0: the bench's cells run T = 0 first on the
same engines), and each of the adaptive engine's timed steps is put in a class:

  plain            a plain step the policy ran without weighing plans (SpecPolicy.plain_step)
  plain weighed    a plain step after weighing plans
  plain try        a step of a try of plain while speculation leads
  spec lead        a speculating step while speculation leads
  spec try         a step of a try of speculation while plain leads (its first, which
                   catches the drafts up, included)

apart for full batches ("full") and a job's last rows ("tail", fewer rows than the batch
size). Each class's loss is its seconds beyond what the plain engine took for the same tokens
at the same batch size (its pace per eighth of a full batch, over the same round), as a share
of the adaptive engine's run; the shares add up to about 1 - the round's ratio.

    python benchmarks/policy_losses.py --batch-size 64 --temperature 0.8 --rounds 6
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import batchspec.tools.bench as bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="spec-adaptive", choices=bench.ADAPTIVE_METHODS)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts a round runs [the bench's: max(64, 8 x batch size)]")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    B, T = a.batch_size, a.temperature
    models, dtype, ids, domains = bench.demo_workload(a.num_prompts or max(64, 8 * B))
    llms = {m: bench.make_llm(m, models, B, 4, 0, 0.0, 1, dtype) for m in ("plain", a.method)}
    engine = llms[a.method].engine
    policy = engine.policy
    weighed = [False]
    plain_step = policy.plain_step

    def plain_step_seen(*args, **kwargs):
        runs_plain = plain_step(*args, **kwargs)
        weighed[0] = not runs_plain
        return runs_plain
    policy.plain_step = plain_step_seen
    rows = {}     # each engine's rows (running and waiting) before its step

    for m, llm in llms.items():
        def step(inner=llm.step, m=m, llm=llm):
            rows[m] = len(llm.engine.scheduler.running) + len(llm.engine.scheduler.waiting)
            return inner()
        llm.step = step

    def warm(t):
        for llm in llms.values():
            bench.run_engine(llm, ids[:max(2, B)], domains=domains, temperature=t,
                             max_tokens=a.max_tokens)
    warm(0.0)
    if T:
        bench.run_engines_in_turns(llms, ids, domains=domains, temperature=0.0,
                                   max_tokens=a.max_tokens)
        warm(T)
    eighth = max(1, B // 8)
    plain_pace = collections.defaultdict(lambda: [0.0, 0])  # eighth -> seconds, tokens
    steps = []     # the adaptive engine's: (class, full or tail, eighth, seconds, tokens)

    def on_step(turn, method, seconds, tokens):
        band = min(rows[method], B) // eighth
        if method == "plain":
            p = plain_pace[band]
            p[0] += seconds
            p[1] += tokens
            return
        kind = ("spec try" if policy._trying else "spec lead") if policy._speculated \
            else "plain try" if policy._trying else \
            "plain weighed" if weighed[0] else "plain"
        weighed[0] = False
        steps.append((kind, "full" if band >= 8 else "tail", band, seconds, tokens))

    for r in range(a.rounds):
        plain_pace.clear()
        steps.clear()
        res = bench.run_engines_in_turns(llms, ids, domains=domains, temperature=T,
                                         max_tokens=a.max_tokens, on_step=on_step)
        plain, adaptive = res["plain"], res[a.method]
        ratio = plain["wall_s"] / adaptive["wall_s"] * adaptive["tokens"] / plain["tokens"]
        total_s = sum(s for *_, s, _ in steps)
        overall = sum(p[0] for p in plain_pace.values()) / sum(p[1] for p in plain_pace.values())
        kinds = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
        for kind, part, band, seconds, tokens in steps:
            p = plain_pace.get(band)
            pace = p[0] / p[1] if p and p[1] else overall
            k = kinds[(kind, part)]
            k[0] += 1
            k[1] += seconds
            k[2] += tokens
            k[3] += seconds - tokens * pace
        print(f"round {r}: {a.method} {ratio:.3f}x plain")
        for (kind, part), (n, seconds, tokens, loss) in sorted(kinds.items()):
            print(f"  {kind:14} {part:4} {n:5d} steps {1e3 * seconds / n:6.2f} ms "
                  f"{tokens / n:6.1f} tokens  loss {100 * loss / total_s:+.2f}% of the run")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
