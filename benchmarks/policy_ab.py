"""The adaptive policy (batchspec/spec/policy.py) of the working tree against the same file at
another git revision, in one process, on the demo models: a plain engine and two engines of
one method, one of which runs the other revision's SpecPolicy (over the same measured step
costs), take turns step by step (batchspec.tools.bench.run_engines_in_turns), so that a
stretch in which a shared machine runs slower lands on all three alike. Prints each
round's speedup over plain of both policies and the medians (the first round, each
engine's first job, where the policies start from nothing, is printed and left out of the
medians); `batchspec bench` runs its
methods in separate engines too, but compares only the tree it runs from.

    python benchmarks/policy_ab.py --against HEAD~1 --method suffix-adaptive \\
        --batch-size 32 --temperature 0.8 --repeats 4

--speculation-leads pairs the tree's policy with itself held in speculation's lead (plain
never takes it back; each step still runs the plan the policy weighs best, which may be
plain): what speculating would make where the policy keeps plain. --plain-leads pairs it
with itself held in plain's lead (speculation is never tried): what the adaptive engine
costs beside a plain engine when it never speculates, and what its tries cost.
--both-speculate, with --against, holds both policies in speculation's lead: what each one's
plans make. --with-fixed-k adds an engine of the same drafts with a fixed k (`spec-domain` for
`spec-adaptive`, `suffix` for `suffix-adaptive`) to the turns: what the policy's plans make
against drafting every row's k. --prompt-tokens N lengthens each prompt to N tokens or more
with the next held-out prompts of its domain (long contexts); with it, give --fresh-prompts,
which empties every engine's prefix cache before each run: engines whose KV holds fewer of the
last run's long prompts recompute more of them, and rounds' ratios spread over 0.57-1.23.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "batchspec/spec/policy.py"


# an adaptive method -> the method of the same drafts with a fixed k
FIXED_K = {"spec-adaptive": "spec-domain", "suffix-adaptive": "suffix"}


def load_policy_at(rev: str):
    """The policy module as it was at rev, imported under a name of its own."""
    text = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="policy_ab_"), "policy_at_rev.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("policy_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    if not hasattr(module.SpecPolicy, "observe_catch_up"):   # (the engine calls it)
        module.SpecPolicy.observe_catch_up = lambda self, name, seconds, num_rows: None
    if not hasattr(module.SpecPolicy, "record_rounds"):      # (nor did it count in one call)
        def record_rounds(self, rounds):
            for r in rounds:
                self.record(*r)
        module.SpecPolicy.record_rounds = record_rounds
    return module


def held_in_speculation(module=None):
    """The tree's SpecPolicy (or `module`'s), made never to hand plain the lead: speculation's corrected rate
    is taken as beyond plain's, plain is never tried, and a weighing whose best plan drafts
    nothing leaves speculation the lead, so that every step runs the plan weighed best (no
    slot at all where none pays). Refusing plain the lead at the switch
    alone did not hold it: a try of plain that showed plain ahead left every later step
    weighed as a try of plain, and those steps ran plain (0.00 of the rows' rounds drafted
    in most runs)."""
    from batchspec.spec import policy
    policy = module or policy

    class Held(policy.SpecPolicy):
        def _slowdown(self, speculate: bool) -> float:   # (policies before _corrected_rate)
            return 1e-9 if speculate else super()._slowdown(speculate)

        def _corrected_rate(self, plan) -> float:
            return float("inf")

        def _switch(self, speculate: bool, fresh: bool) -> None:
            # (a weighing whose best plan drafts nothing would hand plain the lead)
            super()._switch(True, fresh)

        def _may_explore(self) -> bool:
            return False
    return Held


def held_in_plain():
    """The tree's SpecPolicy, made never to leave plain: speculation's corrected rate is
    taken as far below plain's, and it is never tried (plans are still weighed at the
    policy's intervals, as while plain leads)."""
    from batchspec.spec import policy

    class Held(policy.SpecPolicy):
        def _corrected_rate(self, plan) -> float:
            return 0.0

        def _may_explore(self) -> bool:
            return False
    return Held


def main() -> int:
    sys.path.insert(0, ROOT)
    from batchspec.tools.bench import ADAPTIVE_METHODS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="git revision of the other policy")
    ap.add_argument("--speculation-leads", action="store_true",
                    help="pair with the tree's policy held in speculation's lead instead")
    ap.add_argument("--plain-leads", action="store_true",
                    help="pair with the tree's policy held in plain's lead instead")
    ap.add_argument("--method", default="suffix-adaptive", choices=ADAPTIVE_METHODS,
                    help="an adaptive method of batchspec bench (default suffix-adaptive)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="default: max(64, 8 x batch size), as batchspec bench's cells")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="lengthen each prompt to at least this many tokens with the next "
                         "held-out prompts of its domain (a workload of long contexts)")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="empty every engine's prefix cache before each run, as batchspec "
                         "bench --fresh-prompts (engines whose KV holds fewer of the last "
                         "run's prompts would otherwise recompute more of them)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--both-speculate", action="store_true",
                    help="with --against: hold both policies in speculation's lead")
    ap.add_argument("--with-fixed-k", action="store_true",
                    help="also run the method's drafts with a fixed k in the turns")
    args = ap.parse_args()
    if bool(args.against) + args.speculation_leads + args.plain_leads != 1:
        ap.error("give one of --against REV, --speculation-leads, --plain-leads")
    if args.both_speculate and not args.against:
        ap.error("--both-speculate goes with --against REV")
    from batchspec.config import default_dtype
    from batchspec.demo import demo_models
    from batchspec.tools import hfref
    from batchspec.tools.bench import load_prompts, make_llm, run_engines_in_turns
    other = "speculation-leads" if args.speculation_leads else \
        "plain-leads" if args.plain_leads else args.against
    policy_class = held_in_speculation() if args.speculation_leads else \
        held_in_plain() if args.plain_leads else \
        held_in_speculation(load_policy_at(args.against)) if args.both_speculate else \
        load_policy_at(args.against).SpecPolicy
    torch.set_num_threads(1)
    models = demo_models()
    n = args.num_prompts or max(64, 8 * args.batch_size)
    prompts = load_prompts(None, None, n, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    if args.prompt_tokens:
        ids = lengthened(ids, domains, args.prompt_tokens)
    names = {"plain": "plain", "tree": args.method, other: args.method}
    if args.with_fixed_k:
        fixed = FIXED_K.get(args.method)
        if fixed is None:
            ap.error(f"--with-fixed-k: {args.method} has no fixed-k counterpart "
                     f"({', '.join(FIXED_K)} have)")
        names["fixed k"] = fixed
    dtype = default_dtype(models["target"], "cpu")    # as batchspec bench runs the demo
    llms = {name: make_llm(method, models, args.batch_size, 4, 0, 0.0, 1, dtype)
            for name, method in names.items()}
    engine = llms[other].engine
    policy = policy_class(engine.config, engine.max_model_len)
    policy.costs = engine.policy.costs      # the same start-up costs for both policies
    engine.policy = policy
    if args.both_speculate:
        engine = llms["tree"].engine
        held = held_in_speculation()(engine.config, engine.max_model_len)
        held.costs = engine.policy.costs
        engine.policy = held
    speedups: dict[str, list[float]] = {name: [] for name in names if name != "plain"}
    print(f"{args.method}, B={args.batch_size}, T={args.temperature}, {dtype}: x plain, "
          "paired (share of rows' rounds that drafted, drafts a round)")
    for r in range(args.repeats + 1):
        res = run_engines_in_turns(llms, ids, domains=domains, temperature=args.temperature,
                                   max_tokens=args.max_tokens,
                                   fresh_prompts=args.fresh_prompts)
        # tokens per second (at T > 0 the methods' outputs, so their lengths, differ)
        ratios = {name: res[name]["tokens"] / res[name]["wall_s"]
                  / (res["plain"]["tokens"] / res["plain"]["wall_s"]) for name in speedups}
        if r:
            for name, values in speedups.items():
                values.append(ratios[name])
        # the first round is each engine's first job (the policies start from nothing); it
        # is shown but left out of the medians, which are of jobs after it
        print(f"round {r}{' (first job, not in the medians)' if not r else ''}: " + ", ".join(
            f"{name} {ratios[name]:.3f} ({drafted_share(res[name]):.2f}, "
            f"{drafts_a_round(res[name]):.2f})"
            for name in speedups), flush=True)
    print("median: " + ", ".join(f"{name} {statistics.median(v):.3f}"
                                 for name, v in speedups.items()))
    return 0


def lengthened(ids: list[list[int]], domains: list[str], num_tokens: int) -> list[list[int]]:
    """Each prompt followed by the next prompts of its domain (in turn, from its own) until
    it holds at least num_tokens tokens: rows that start apart and read long contexts."""
    out = []
    for i, domain in enumerate(domains):
        same = [j for j in range(len(ids)) if domains[j] == domain]
        at, row = same.index(i), []
        while len(row) < num_tokens:
            row += ids[same[at % len(same)]]
            at += 1
        out.append(row)
    return out


def drafts_a_round(result: dict) -> float:
    """Draft tokens verified a round, on average over a run's rounds."""
    return sum(result["drafted_per_depth"] or [0]) / max(result["totals"]["rounds"], 1)


def drafted_share(result: dict) -> float:
    """The share of a run's rounds that drafted (those that drafted at depth 0)."""
    per_depth = result["drafted_per_depth"]
    return (per_depth[0] if per_depth else 0) / max(result["totals"]["rounds"], 1)


if __name__ == "__main__":
    sys.exit(main())
