"""What draft sources can make over plain decoding on a whole job, by this machine's step
costs: one run of the job per method, its rounds priced four ways. "drafts as run": every
draft the method verified; "best admission": the same drafts, each round verifying them
only while their survival (the product of their classes' acceptance in this very run, by
depth; a suffix draft's class is its evidence, suffix.evidence_class) stays above a
threshold, the best threshold taken: what per-slot admission could make with its estimates
right from the first step; "accepted drafts only": an oracle that verifies exactly the drafts
the target accepts; "all k accepted": every round drafting k tokens, all accepted. Each is
given end to end (the prompt tokens the run computed included: plain decoding pays them
too, and no draft makes them cheaper; those read from the prefix cache cost nothing, and
after --warm-up, as in `batchspec bench`'s rounds after the first, most are) and for the
decode steps alone.

Prices come from one engine's start-up timings (batchspec.spec.policy.StepCosts) at the
job's batch size, shared by every method of the run: a row's share of a decode step, what a
verified token adds to a forward, what a prompt token adds. Left out: what a step costs
besides its forwards, on both sides (Python, sampling, bookkeeping; per step, so a little
less per token for speculation's fewer steps); a model draft's own forwards (lookup sources
draft for free); the steps an adaptive engine runs plain; and the end of the job, where
fewer rows than the batch remain. So the figures are no bound: the bench measured 0.92 or
so of the drafts-as-run figure at 32 rows, T = 0 in the twenty-fourth round, 0.94-1.00 of
it in the twenty-fifth (the same drafts, their source's upkeep cheaper; docs/benchmarks.md).
`batchspec bench` measures what a method makes; this says what its drafts, and better
ones, are worth by the forwards' costs.

    python benchmarks/job_bound.py                  # suffix, 32 rows, T = 0, a fresh engine
    python benchmarks/job_bound.py --methods suffix,suffix-adaptive --warm-up --k 8
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import SamplingParams  # noqa: E402
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.engine.engine import Engine  # noqa: E402
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.bench import METHODS, _start_afresh, make_llm  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def needed_acceptance(bar: float, k: int, plain_s: float, prompt_s: float, decodes: int,
                      row_s: float, token_s: float) -> float | None:
    """The per-token acceptance probability p at which rounds that each draft k tokens (each
    accepted with probability p given the ones before) make `bar` x plain end to end, by
    bisection; None if even p = 1 does not."""
    def ratio(p):
        tokens = sum(p ** i for i in range(k + 1))      # a round's expected tokens
        return plain_s / (prompt_s + decodes / tokens * (row_s + k * token_s))
    if ratio(1.0) < bar:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < bar else (lo, mid)
    return hi


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="suffix",
                    help="comma-separated engine methods of `batchspec bench` that draft")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--bar", type=float, default=1.4, help="a ratio to plain to solve for")
    ap.add_argument("--warm-up", action="store_true",
                    help="run the job once before the run counted, as `batchspec bench` does "
                         "(adaptive lengths start with what they learned; prompts are mostly "
                         "in the prefix cache)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    models = demo_models()
    dtype = default_dtype(models["target"], "cpu")
    prompts = load_prompts(None, None, a.num_prompts, split="heldout")
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    methods = a.methods.split(",")
    if bad := [m for m in methods if m not in METHODS or m in ("hf", "hf-assisted", "plain")]:
        ap.error(f"not a drafting method of `batchspec bench`: {', '.join(bad)}")
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)
    domains = [p["domain"] for p in prompts]
    b, costs = a.batch_size, None
    for method in methods:
        llm = make_llm(method, models, b, a.k, 0, 0.0, 1, dtype)
        if costs is None:   # one set of start-up timings prices every method
            costs = llm.engine.policy.costs or llm.engine.measure_step_costs()
            row_s = costs.target_s(b, 1) / b               # a row's share of a decode step
            token_s = costs.verified_token_s(b)            # a verified token beside it
            print(f"{len(ids)} prompts of {sum(map(len, ids)) / len(ids):.1f} tokens, "
                  f"{a.max_tokens} new tokens, batch {b}, T = {a.temperature}, {dtype}, k = {a.k}")
            print(f"step costs at {b} rows: a decoded token {row_s * 1e3:.4f} ms, a verified "
                  f"token {token_s * 1e3:.4f} ms ({token_s / row_s:.2f} of it), a prompt token "
                  f"{costs.prompt_token_s * 1e3:.4f} ms")
            print(f"{'x plain, by the forwards':24}" + "".join(f"{c:>22}" for c in CASES))
        if a.warm_up:
            llm.generate(ids, params, domains=domains, use_tqdm=False)
            _start_afresh(llm)
        rounds_log, outs = _run_logged(llm, ids, params, domains)
        llm.close()
        decodes = sum(max(o.stats["tokens_generated"] - 1, 0) for o in outs)  # (1st: prefill)
        # the prompt tokens computed (not read from the prefix cache: after --warm-up, most
        # of them, as in `batchspec bench`'s rounds); plain decoding would compute the same
        computed = sum(len(o.prompt_token_ids) - o.num_cached_prompt_tokens for o in outs)
        prompt_s = computed * costs.prompt_token_s
        plain_decode = decodes * row_s
        plain = prompt_s + plain_decode
        cases = [_decode_s(rounds_log, lambda r: r[1], decodes, row_s, token_s),
                 min(_decode_s(rounds_log, _admission(rounds_log, tau), decodes, row_s, token_s)
                     for tau in TAUS),
                 _decode_s(rounds_log, lambda r: r[2], decodes, row_s, token_s),
                 math.ceil(decodes / (a.k + 1)) * (row_s + a.k * token_s)]
        slots, accepted = sum(r[1] for r in rounds_log), sum(r[2] for r in rounds_log)
        print(f"{method:24}" + "".join(
            f"{plain / (prompt_s + t):>13.3f} / {plain_decode / t:.3f}" for t in cases) +
            f"   ({len(rounds_log)} rounds, {slots / len(rounds_log):.2f} drafts and "
            f"{accepted / len(rounds_log):.2f} accepted a round; {computed} prompt tokens "
            f"computed, {prompt_s / plain:.1%} of plain decoding's forwards)")
    print("(end to end / decode steps alone)")
    p = needed_acceptance(a.bar, a.k, plain, prompt_s, decodes, row_s, token_s)
    print(f"{a.bar}x end to end with every round drafting {a.k}: " +
          (f"a per-token acceptance of {p:.3f} or more" if p is not None else "out of reach"))


def _decode_s(rounds_log, admitted, decodes: int, row_s: float, token_s: float) -> float:
    """Seconds of the job's decode steps if each round verified admitted(round) of its drafts
    (and the job's rounds made tokens at the rate these rounds do)."""
    tokens = seconds = 0.0
    for r in rounds_log:
        n = admitted(r)
        tokens += 1 + min(r[2], n)
        seconds += row_s + n * token_s
    return decodes / tokens * seconds


CASES = ("drafts as run", "best admission", "accepted drafts only", "all k accepted")


def _run_logged(llm, ids, params, domains):
    """Run the job; (classes, drafts, accepted) of every round (as Engine.commit counts
    rounds: not a row's prompt step), and the outputs."""
    rounds_log: list[tuple[list[int], int, int]] = []
    commit = Engine.commit

    def logged_commit(self, scheduled, out_ids, num_accepted):
        sampling = [s for s in scheduled if s.is_sampling]
        for s, m in zip(sampling, num_accepted, strict=True):
            if s.seq.num_output_tokens > 0:
                p = s.proposal
                rounds_log.append((list(p.classes or []) if p is not None else [],
                                   s.num_drafts, m))
        return commit(self, scheduled, out_ids, num_accepted)

    Engine.commit = logged_commit
    try:
        outs = llm.generate(ids, params, domains=domains, use_tqdm=False)
    finally:
        Engine.commit = commit
    return rounds_log, outs


# survival thresholds tried for the best admission
TAUS = [i / 20 for i in range(1, 20)]


def _admission(rounds_log, tau: float):
    """An admission rule that knows each draft class's acceptance in this very run: a round
    verifies its drafts while their survival (the product of their classes' acceptance,
    per depth 0, 1, 2, 3+ given the drafts before; drafts without a class in one class per
    depth) stays at least tau. The best such rule over tau is what per-slot admission could
    make with its estimates right from the first step."""
    counts: dict[tuple[int, int], list[int]] = {}
    for classes, n, m in rounds_log:
        for d in range(min(n, m + 1)):
            c = counts.setdefault(_key(classes, d), [0, 0])
            c[0] += d < m
            c[1] += 1

    def admitted(r) -> int:
        classes, n, _ = r
        survive = 1.0
        for d in range(n):
            acc, judged = counts.get(_key(classes, d), (0, 0))
            survive *= (acc + 1) / (judged + 2)
            if survive < tau:
                return d
        return n
    return admitted


def _key(classes: list[int], d: int) -> tuple[int, int]:
    return (classes[d] if d < len(classes) else -1, min(d, 3))


if __name__ == "__main__":
    main()
