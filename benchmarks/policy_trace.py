"""Which side each step of an adaptive engine ran, job after job on one engine (the demo
models, held-out prompts): per job its tokens per second and a line of one character a
step, `S` a speculating step, `t` a plain step of a try of plain while speculation leads,
`.` a plain step; then, for the band of batch sizes of the job's full batches, what each
side is judged with: plain's slowdown (predicted / measured tokens per second,
SpecPolicy._slowdown) and speculation's excess (what its steps measured beyond their
predicted seconds, on average: SpecPolicy._corrected_rate), with its slowdown too. The first job
is the engine's first: what a fresh worker does. To trace an earlier policy, put its
batchspec/spec/policy.py in the tree (git show REV:batchspec/spec/policy.py).

    python benchmarks/policy_trace.py --method suffix-adaptive --batch-size 32 --jobs 3

With --tries, each measured step of the last job's tries of speculation is listed too (its
predicted tokens and ms, from the start-up costs and the acceptance estimates, against the
tokens and ms measured), beside the plain steps' mean at full batches: what the side behind
is judged on.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import SamplingParams  # noqa: E402
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.spec import policy as policy_module  # noqa: E402
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.bench import ADAPTIVE_METHODS, _start_afresh, make_llm  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="suffix-adaptive", choices=ADAPTIVE_METHODS)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads [1]")
    ap.add_argument("--tries", action="store_true",
                    help="list the measured steps of the last job's tries of speculation")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    models = demo_models()
    prompts = load_prompts(None, None, a.num_prompts, split="heldout")
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    llm = make_llm(a.method, models, a.batch_size, 4, 0, 0.0, a.threads,
                   default_dtype(models["target"], "cpu"))
    engine, policy = llm.engine, llm.engine.policy
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)
    timed = []     # the job's measured steps: (chosen, seconds, tokens, full batch?)
    observe = policy.observe

    def logged(seconds, tokens, prompt_tokens=0, weight=0.1):
        if not prompt_tokens:
            timed.append((policy._chosen, seconds, tokens,
                          len(engine.scheduler.running) == a.batch_size))
        return observe(seconds, tokens, prompt_tokens, weight)
    policy.observe = logged
    for job in range(a.jobs):
        timed.clear()
        _start_afresh(llm)      # (each job starts with empty job-wide suffix tries)
        llm.add_requests(ids, params, [p["domain"] for p in prompts])
        steps, tokens, t0 = [], 0, time.perf_counter()
        while engine.has_unfinished():
            tokens += engine.step()[1]
            steps.append("S" if policy._speculated else "t" if policy._trying else ".")
        rate = tokens / (time.perf_counter() - t0)
        print(f"job {job + 1}: {rate:.0f} tok/s, {len(steps)} steps")
        line = "".join(steps)
        for i in range(0, len(line), 100):
            print("  " + line[i:i + 100])
        # the state of the full batches' band (the job's last steps are in smaller ones; a
        # policy of before the bands, swapped in to compare, has one state)
        band = getattr(policy_module, "batch_band", None)
        state = policy._mixes.get((policy._mix, band(a.batch_size))) if band else None
        measured = state[0] if state is not None else policy.measured
        current, policy.measured = policy.measured, measured   # (as the policy reads it)
        slowdowns = {side: policy._slowdown(side) for side in measured}
        policy.measured = current
        parts = [f"plain's slowdown {slowdowns[False]:.2f}"] if False in slowdowns else []
        if True in measured:
            m = measured[True]
            parts.append(f"speculation's excess {1e3 * (m[3] - m[1]):.2f} ms a step "
                         f"(slowdown {slowdowns[True]:.2f})")
        print("  at full batches: " + ", ".join(parts))
    if a.tries:
        plain = [(c[2], s) for c, s, _, full in timed
                 if c is not None and not c[0] and full]
        if plain:
            print(f"last job's plain steps at full batches: {len(plain)}, predicted "
                  f"{1e3 * sum(p for p, _ in plain) / len(plain):.2f} ms, measured "
                  f"{1e3 * sum(s for _, s in plain) / len(plain):.2f} ms (means)")
        print("its tries' measured steps of speculation: predicted tokens, ms -> measured")
        for c, s, tokens, full in timed:
            if c is not None and c[0] and c[3]:
                print(f"  {c[1]:6.1f} tokens {1e3 * c[2]:6.2f} ms -> {tokens:4d} tokens "
                      f"{1e3 * s:6.2f} ms{'' if full else ' (a smaller batch)'}")


if __name__ == "__main__":
    main()
