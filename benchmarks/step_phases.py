"""Where an engine step's time goes, per method, on the demo models: ms per step and per
token of the scheduler, the drafts (model drafts' calls and lookup sources apart), the rest
of proposing (routing, the adaptive policy's plans), the target's forwards (those with a
prompt's rows and the decode / verification forwards apart), verification, committing the
tokens, and what is left (Python between them, the policy's bookkeeping). Each method runs
the job twice, one after the other, and the second run is timed (the first warms the
caches, the kernels and the policy's start-up costs).

    python benchmarks/step_phases.py --batch-size 1 --domain code --methods plain,spec-domain
    python benchmarks/step_phases.py --batch-size 32 --methods plain,suffix-adaptive

The phases are timed by wrapping the engine's methods with a clock (a few microseconds a
step); the wall time per token it prints is this process's, not a side-by-side ratio
(`batchspec bench` is the tool for those).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import batchspec.engine.engine as engine_module  # noqa: E402
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.spec.proposer import DraftModelProposer  # noqa: E402
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.bench import METHODS, _params, _start_afresh, make_llm  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402

PHASES = ["schedule", "draft models", "draft lookups", "propose, rest", "forward, prompts",
          "forward, decode", "verify", "commit", "rest"]


class Clock:
    """Seconds per phase of the current step."""
    def __init__(self):
        self.step: dict[str, float] = {}

    def wrap(self, fn, phase):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[phase] = self.step.get(phase, 0.0) + time.perf_counter() - t0
        return timed


def instrument(llm, clock: Clock) -> None:
    eng = llm.engine
    eng.scheduler.schedule = clock.wrap(eng.scheduler.schedule, "schedule")
    for proposer in eng.proposers.values():
        phase = "draft models" if isinstance(proposer, DraftModelProposer) else "draft lookups"
        proposer.propose = clock.wrap(proposer.propose, phase)
    propose = eng.propose

    def propose_rest(*args, **kwargs):
        # proposing's own time: the drafts it calls are timed apart (a lookup may also
        # draft outside it, e.g. for a routed row's unused drafts)
        drafts = clock.step.get("draft models", 0.0) + clock.step.get("draft lookups", 0.0)
        t0 = time.perf_counter()
        try:
            return propose(*args, **kwargs)
        finally:
            inner = clock.step.get("draft models", 0.0) + clock.step.get("draft lookups", 0.0)
            clock.step["propose, rest"] = clock.step.get("propose, rest", 0.0) + \
                time.perf_counter() - t0 - (inner - drafts)
    eng.propose = propose_rest
    forward = eng.target.forward

    def target_forward(tokens, computed, tables, num_logits, **kwargs):
        # a decode or verification row asks for a logit per token it feeds; a prompt's rows
        # (or a preempted row's recompute) feed more tokens than they ask logits for
        phase = "forward, prompts" if any(len(t) > n for t, n in zip(tokens, num_logits)) \
            else "forward, decode"
        return clock.wrap(forward, phase)(tokens, computed, tables, num_logits, **kwargs)
    eng.target.forward = target_forward
    eng.commit = clock.wrap(eng.commit, "commit")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="plain,spec-domain,spec-adaptive")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--domain", default=None, help="code or docs (default: both)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="default: max(32, 8 x batch size)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="auto: the CPU's dtype for the demo, as batchspec bench runs it")
    ap.add_argument("--draft-after-target", action="store_true",
                    help="also time the first model draft's round back to back and right "
                         "after a target forward (what the target's forward leaves of the "
                         "draft's weights in the caches)")
    args = ap.parse_args()
    engine_methods = [m for m in METHODS if not m.startswith("hf")]   # transformers' are not
    unknown = [m for m in args.methods.split(",") if m not in engine_methods]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}: engine methods are "
                 f"{', '.join(engine_methods)}")
    torch.set_num_threads(1)
    models = demo_models()
    dtype = default_dtype(models["target"], "cpu") if args.dtype == "auto" else args.dtype
    num = args.num_prompts or max(32, 8 * args.batch_size)
    prompts = load_prompts(None, args.domain, num, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    verify = engine_module.verify
    clock = Clock()
    engine_module.verify = clock.wrap(verify, "verify")
    columns = []
    after = []   # the draft round's check, for the first method with a model draft
    for method in args.methods.split(","):
        llm = make_llm(method, models, args.batch_size, args.k, 0, 0.0, 1, dtype)
        instrument(llm, clock)
        totals = dict.fromkeys(PHASES, 0.0)
        steps = tokens = 0
        wall = 0.0
        for timed in (False, True):
            _start_afresh(llm)
            llm.add_requests(ids, _params(args.temperature, 1.0, args.max_tokens), domains)
            while llm.engine.has_unfinished():
                clock.step = {}
                t0 = time.perf_counter()
                _, made = llm.step()
                seconds = time.perf_counter() - t0
                if not timed:
                    continue
                steps, tokens, wall = steps + 1, tokens + made, wall + seconds
                s = clock.step
                s["rest"] = seconds - sum(s.values())
                for phase, v in s.items():
                    totals[phase] += v
        columns.append((totals, steps, tokens, wall))
        if args.draft_after_target and not after and any(
                isinstance(p, DraftModelProposer) for p in llm.engine.proposers.values()):
            after.append(lambda llm=llm: draft_after_target(llm, args.batch_size, args.k,
                                                            args.temperature))
        del llm
    print(f"batch size {args.batch_size}, T={args.temperature}, {dtype}, {len(ids)} prompts, "
          f"{args.max_tokens} new tokens each; ms per step (ms per token)")
    print(f"{'phase':<18}" + "".join(f"{m:>22}" for m in args.methods.split(",")))
    for phase in PHASES + ["step"]:
        cells = []
        for totals, steps, tokens, wall in columns:
            v = wall if phase == "step" else totals[phase]
            cells.append(f"{v / steps * 1e3:.3f} ({v / max(tokens, 1) * 1e3:.3f})")
        print(f"{phase:<18}" + "".join(f"{c:>22}" for c in cells))
    print(f"{'tokens a step':<18}" + "".join(f"{t / s:>22.2f}" for _, s, t, _ in columns))
    print(f"{'tokens/s':<18}" + "".join(f"{t / w:>22.0f}" for _, _, t, w in columns))
    for check in after:
        check()


def draft_after_target(llm, rows: int, k: int, temperature: float, ctx: int = 150,
                       blocks: int = 15) -> None:
    """A model draft's round of k steps over `rows` rows (one C++ call where the draft has
    it), timed back to back and right after a target forward of rows x (k + 1) tokens, as
    in the engine's steps: blocks of 10 calls in turns, the median call of each way."""
    eng = llm.engine
    runner = next((eng.proposers[eng.source_for(name, temperature)].runner
                   for name in eng.config.drafts
                   if isinstance(eng.proposers[name], DraftModelProposer)), None)
    if runner is None:
        return
    bs = eng.config.block_size
    per_row = -(-(ctx + k + 1) // bs)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(2 * rows)]
    if runner.steps_in_one_call:
        def draft():
            runner.draft_steps([[7, 7]] * rows, [ctx] * rows, tables[rows:], [k] * rows)
    else:
        def draft():
            for step in range(k):
                runner.forward([[7]] * rows, [ctx + step] * rows, tables[rows:], [1] * rows)

    def target():
        eng.target.forward([[7] * (k + 1)] * rows, [ctx] * rows, tables[:rows],
                           [k + 1] * rows)
    times = {"back to back": [], "after a target forward": []}
    for _ in range(blocks):
        for way in times:
            for _ in range(10):
                if way != "back to back":
                    target()
                t0 = time.perf_counter()
                draft()
                times[way].append(time.perf_counter() - t0)
    print(f"\na draft round of {k} steps over {rows} row(s), median ms: " + ", ".join(
        f"{way} {statistics.median(v) * 1e3:.3f}" for way, v in times.items()))


if __name__ == "__main__":
    main()
