"""How much of a side-by-side ratio is the machine: two engines on the demo models, over the
same prompts, timed as whole runs in turns and in slices of steps in turns (what `batchspec
bench --turns runs|steps` does; --slice-ms 0: one step a turn), each round's ratio second /
first. Two engines of one method
(the default, plain against plain) have a true ratio of 1: the spread of the per-round
ratios is what each way of taking turns adds (docs/benchmarks.md).

    python benchmarks/bench_turns.py --batch-size 32 --temperature 0.8 --num-prompts 256
    python benchmarks/bench_turns.py --methods plain,spec-adaptive --turns steps --repeats 4

With --trace (step by step, the second method adaptive), each round also prints the second
engine's stretches of plain steps, speculating steps and tries, each with both engines'
tokens/s over the same turns: where a ratio below 1 comes from.

With --interleave, what one engine's step costs right after other engines' steps, against
back to back (why the bench takes turns in slices of steps, and keeps engines whose job is
done stepping): the first method's steps in alternating blocks of 8, back to back, then each
right after one step of each other method (two or more), their medians printed.

    python benchmarks/bench_turns.py --interleave --methods plain,suffix,spec-domain,spec-adaptive --temperature 0

With --predecessors, the methods (two or more) take turns as the bench runs them, and each
method's steps over a full batch are put apart by what stepped before them: the first step of
its slice by the method whose slice came before, the others as "own slice" (an adaptive
method's plain steps only: what its plain steps cost after each engine, beside plain's); medians
and counts over --repeats rounds.

    python benchmarks/bench_turns.py --predecessors --methods plain,spec-domain,spec-adaptive --repeats 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.llm import freeze_heap  # noqa: E402
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.bench import (  # noqa: E402
    METHODS,
    SLICE_S,
    _params,
    make_llm,
    run_engine,
    run_engines_in_turns,
)
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--methods", default="plain,plain",
                    help="first,second, of " + ",".join(m for m in METHODS
                                                       if m not in ("hf", "hf-assisted")))
    ap.add_argument("--turns", choices=["runs", "steps", "both"], default="both")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slice-ms", type=float, default=SLICE_S * 1000,
                    help="step by step: how long each engine steps in a turn (0: one step)")
    ap.add_argument("--trace", action="store_true",
                    help="print each round's stretches of the second engine's steps")
    ap.add_argument("--interleave", action="store_true",
                    help="the first method's step back to back against right after the "
                    "others' (--methods: two or more)")
    ap.add_argument("--predecessors", action="store_true",
                    help="each method's steps by the method that stepped before them, in "
                    "the bench's turns (--methods: two or more)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = demo_models()
    prompts = load_prompts(None, None, args.num_prompts, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    kw = dict(domains=[p["domain"] for p in prompts], temperature=args.temperature,
              max_tokens=args.max_tokens)
    dtype = default_dtype(models["target"], "cpu")
    methods = args.methods.split(",")
    many = args.interleave or args.predecessors
    if not (len(methods) == 2 or many and len(methods) > 2) or \
            not set(methods) <= set(METHODS) - {"hf", "hf-assisted"}:
        ap.error(f"--methods: two (--interleave, --predecessors: two or more) of "
                 f"{', '.join(METHODS[2:])}")
    llms = {name: make_llm(m, models, args.batch_size, 4, 0, 0.0, 1, dtype)
            for name, m in zip("abcdefghij", methods)}
    for llm in llms.values():
        run_engine(llm, ids[:args.batch_size], **kw)
    freeze_heap()
    if args.interleave:
        return interleave(llms, methods, ids, kw, args)
    if args.predecessors:
        return predecessors(llms, methods, ids, kw, args)
    print(f"{methods[1]} over {methods[0]}, B={args.batch_size} T={args.temperature}, "
          f"{len(ids)} prompts, {args.repeats} rounds")
    for turns in ("runs", "steps") if args.turns == "both" else (args.turns,):
        ratios = []
        for _ in range(args.repeats):
            steps = []
            res = run_engines_in_turns(llms, ids, **kw, slice_s=args.slice_ms / 1000,
                                       on_step=lambda *a, steps=steps:
                                       steps.append((*a, _side(llms["b"])))) \
                if turns == "steps" else \
                {name: run_engine(llm, ids, **kw) for name, llm in llms.items()}
            tok_s = {name: r["tokens"] / r["wall_s"] for name, r in res.items()}
            ratios.append(tok_s["b"] / tok_s["a"])
            if args.trace and steps:
                print(f"round {len(ratios)}: {ratios[-1]:.3f}")
                print_stretches(steps)
        print(f"turns {turns}: ratios {' '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.3f}, spread {min(ratios):.3f}-"
              f"{max(ratios):.3f}")


def interleave(llms, methods, ids, kw, args, blocks=60):
    """The first engine's steps in alternating blocks of 8: back to back, then each right
    after one step of every other engine (an engine whose job is done starts it again)."""
    params = _params(args.temperature, 1.0, args.max_tokens)
    first, *others = llms.values()
    for llm in llms.values():
        llm.add_requests(ids, params, kw["domains"])
    times = {"back to back": [], "after the others": []}
    for block in range(blocks):
        for _ in range(8):
            if block % 2:
                for llm in others:
                    if not llm.engine.has_unfinished():
                        llm.add_requests(ids, params, kw["domains"])
                    llm.step()
            if not first.engine.has_unfinished():
                first.add_requests(ids, params, kw["domains"])
            t0 = time.perf_counter()
            first.step()
            times["after the others" if block % 2 else "back to back"].append(
                time.perf_counter() - t0)
    for llm in llms.values():
        llm.engine.abort_all()
    alone, after = (statistics.median(v) * 1e3 for v in times.values())
    print(f"{methods[0]} step at B={args.batch_size}, T={args.temperature}, between "
          f"{'+'.join(methods[1:])}: back to back {alone:.2f} ms, after the others "
          f"{after:.2f} ms (x{after / alone:.2f}); medians of {len(times['back to back'])} "
          "steps each")


def predecessors(llms, methods, ids, kw, args):
    """Each engine's full-batch steps in the bench's turns, by the engine that stepped
    before (the first step of a slice) or in its own slice; an adaptive engine's plain
    steps only."""
    label = dict(zip(llms, methods))
    last, before = [None], {}
    for name, llm in llms.items():
        def step(inner=llm.step, name=name, engine=llm.engine):
            rows = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            before[name] = (last[0] if last[0] != name else "own slice", rows)
            last[0] = name
            return inner()
        llm.step = step
    times: dict[tuple[str, str], list[float]] = {}

    def on_step(turn, name, seconds, tokens):
        after, rows = before[name]
        policy = llms[name].engine.policy
        if after is None or rows < args.batch_size or \
                policy.costs is not None and policy._speculated:
            return
        times.setdefault((name, label.get(after, after)), []).append(seconds)
    for _ in range(args.repeats):
        run_engines_in_turns(llms, ids, **kw, slice_s=args.slice_ms / 1000, on_step=on_step)
    print(f"B={args.batch_size} T={args.temperature}, {args.repeats} rounds: each method's "
          "full-batch steps (adaptive: plain steps), median ms (steps) by what stepped before")
    for name in llms:
        parts = sorted((after, statistics.median(v) * 1e3, len(v))
                       for (n, after), v in times.items() if n == name)
        print(f"{label[name]:>15}: " + ", ".join(f"after {after} {ms:.2f} ({count})"
                                                  for after, ms, count in parts))


def _side(llm):
    """(speculated, part of a try, speculation leads) after the engine's last step."""
    p = llm.engine.policy
    return p._speculated, p._trying, p._winner


def print_stretches(steps):
    """Stretches of turns in which the second engine ("b") kept one side, each with both
    engines' tokens/s over the stretch's turns (the turns both stepped in)."""
    by_turn = {}   # turn: {engine: (seconds, tokens, side after its last step of the turn)}
    for turn, name, seconds, tokens, side in steps:
        s0, t0, _ = by_turn.setdefault(turn, {}).get(name, (0.0, 0, None))
        by_turn[turn][name] = (s0 + seconds, t0 + tokens, side)
    stretches = []
    for turn in sorted(by_turn):
        if "b" not in by_turn[turn]:
            continue
        side = by_turn[turn]["b"][2]
        if stretches and stretches[-1][0] == side[:2]:
            stretches[-1][1].append(turn)
        else:
            stretches.append((side[:2], [turn]))
    for (speculated, trying), turns in stretches:
        rate = {}
        for name in ("a", "b"):
            both = [by_turn[t][name] for t in turns if "a" in by_turn[t]]
            seconds = sum(x[0] for x in both)
            rate[name] = sum(x[1] for x in both) / seconds if seconds else 0.0
        kind = ("try of " if trying else "") + ("speculation" if speculated else "plain")
        ratio = f"{rate['b'] / rate['a']:.3f}" if rate["a"] else "-"
        print(f"  turns {turns[0]:4d}-{turns[-1]:4d} {kind:22s} b {rate['b']:7.0f} tok/s, "
              f"a {rate['a']:7.0f} tok/s, b/a {ratio}")


if __name__ == "__main__":
    main()
