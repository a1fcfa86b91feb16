"""How well the adaptive policy's acceptance estimates predict what verification accepts, on
the demo models and held-out prompts: an adaptive engine that speculates at every step and
admits every slot (so that every depth is judged on every row), job after job; per depth,
the mean predicted survival of the slots drafted (SpecPolicy.depth_probs, the product up to
that depth) against the share that survived, and the mean squared error; then the share of
first drafts accepted by band of output positions (the acceptance records' rounds).
--decay and --max-band set policy.REQUEST_DECAY and policy.MAX_POSITION_BAND (1.0 and 0:
a request's counts over all its rounds, no pools per band: the estimates before either
existed). The bands printed are the policy's default ones whatever --max-band is.

    python benchmarks/estimate_calibration.py [--method spec-adaptive] [--batch-size 8]
        [--temperature 0] [--decay 0.7] [--max-band 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import types
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import SamplingParams  # noqa: E402
from batchspec.spec import policy as policy_module  # noqa: E402
from batchspec.tools.bench import _start_afresh, demo_workload, make_llm  # noqa: E402


def every_slot(policy) -> None:
    """Speculation always leads, never tried against plain, and plans admit every slot."""
    policy._may_explore = lambda: False
    slowdown, plan = policy._slowdown, policy._plan
    policy._slowdown = types.MethodType(lambda self, spec: slowdown(spec) if spec else 1e9,
                                        policy)

    def full(self, rows, probs, skip, num_rows, extra_s=0.0, costs=None):
        _, rate, tokens, seconds, order, row, depth, _ = plan(rows, probs, skip, num_rows,
                                                             extra_s, costs)
        lengths = [0] * len(rows)
        for i, d in zip(row, depth):
            lengths[i] = max(lengths[i], d + 1)
        return len(order), rate, tokens, seconds, order, row, depth, lengths
    policy._plan = types.MethodType(full, policy)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="spec-adaptive")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--decay", type=float, default=policy_module.REQUEST_DECAY)
    ap.add_argument("--max-band", type=int, default=policy_module.MAX_POSITION_BAND)
    a = ap.parse_args()
    bands_shown = policy_module.MAX_POSITION_BAND
    if not a.method.endswith("-adaptive"):
        ap.error(f"{a.method} has no adaptive policy: give a method ending in -adaptive")
    policy_module.REQUEST_DECAY, policy_module.MAX_POSITION_BAND = a.decay, a.max_band
    torch.set_num_threads(1)
    models, dtype, ids, domains = demo_workload(a.num_prompts)
    llm = make_llm(a.method, models, a.batch_size, 4, 0, 0.0, 1, dtype)
    policy = llm.engine.policy
    every_slot(policy)
    predicted: dict[int, list[float]] = {}      # seq id -> this round's survivals
    sums = defaultdict(lambda: [0.0, 0, 0.0, 0])   # depth -> predicted, survived, sq err, n
    choose, record = policy.choose_lengths, policy.record_rounds

    def chosen(rows, *args, **kwargs):
        lengths = choose(rows, *args, **kwargs)
        classes = args[1] if len(args) > 1 else kwargs.get("classes")
        for i, ((seq, source, _, _), n) in enumerate(zip(rows, lengths)):
            if n:
                survive, s = [], 1.0
                for p in policy.depth_probs(seq, source, n,
                                            classes[i] if classes is not None else None):
                    s *= p
                    survive.append(s)
                predicted[seq.seq_id] = survive
        return lengths

    def recorded(rounds):
        for seq, _, num_drafted, num_accepted, _ in rounds:
            survive = predicted.pop(seq.seq_id, None)
            if survive is not None and len(survive) == num_drafted:
                for d, s in enumerate(survive):
                    held = d < num_accepted
                    c = sums[d]
                    c[0] += s
                    c[1] += held
                    c[2] += (s - held) ** 2
                    c[3] += 1
        return record(rounds)
    policy.choose_lengths, policy.record_rounds = chosen, recorded
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens,
                            ignore_eos=True, seed=0)
    print(f"{a.method}, {a.batch_size} rows, T={a.temperature}, every slot admitted; "
          f"REQUEST_DECAY {a.decay}, MAX_POSITION_BAND {a.max_band}")
    for job in range(a.jobs):
        sums.clear()
        _start_afresh(llm)
        outs = llm.generate(ids, params, domains=domains, use_tqdm=False)
        print(f"job {job + 1}: depth  predicted survival  survived  squared error  slots")
        for d, (pred, held, err, n) in sorted(sums.items()):
            print(f"       {d + 1:5}  {pred / n:18.3f}  {held / n:8.3f}  {err / n:13.4f}  {n:5}")
    bands = defaultdict(lambda: [0, 0])
    for o in outs:
        s = o.stats
        for pos, drafted, accepted in zip(s["round_output_pos"], s["round_drafted"],
                                          s["round_accepted"]):
            if drafted:
                band = bands[policy_module.position_band(pos, bands_shown)]
                band[0] += accepted > 0
                band[1] += 1
    print("first draft accepted, by output position (last job):")
    for band, (held, n) in sorted(bands.items()):
        lo = 0 if band == 0 else 1 << (band + 3)
        hi = "" if band == bands_shown else f"{(1 << (band + 4)) - 1}"
        print(f"  {lo:4}-{hi:<5} {held / n:.3f}  ({n} rounds)")


if __name__ == "__main__":
    main()
