"""`batchspec bench`: transformers and batchspec side by side, in one process, on the same
prompts and the same target.

Methods: `hf` (transformers generate, padded batches), `hf-assisted` (transformers assisted
generation with the general draft, k constant, batch size 1 as it requires), `plain`
(batchspec without drafts), `spec` (general draft), `spec-domain` (a draft per domain),
`spec-adaptive` (a draft per domain, each row's draft length chosen per step by expected
goodput: adaptive_k), `ngram` (prompt lookup), `suffix` (suffix drafts: the request's own text
and the outputs of earlier requests in the same run; every timed run starts with an empty
job-wide trie), `suffix-adaptive` (suffix drafts with adaptive_k) and `spec-routed` (each
domain's draft routed per row and round with suffix drafts, adaptive_k). For each batch size and temperature it reports tokens/s, α, tokens
per target pass, speedups over each baseline and observed / theoretical speedup, where
theoretical = E[tokens per pass] / (1 + k c f) (Leviathan et al. 2023) with the per-token
acceptance probability of batchspec.contract, c = draft/target parameter ratio, f = share of
rounds a draft model drafted (1 for a model draft at fixed k; routed and adaptive rows also
have lookup or plain rounds, which cost no draft pass, and a plain round makes one token),
and observed = tokens/s over batchspec plain at the same batch size and T. With --repeats N
(N rounds in which the methods take turns) each speedup is the fastest run's over the
baseline's fastest run, and `x_<baseline>_paired` the median over rounds of the ratio of the
two runs of one round: on a machine whose speed drifts, the fastest runs of two methods may
come from different stretches, while one round's runs come from the same one. In a round the
batchspec methods take turns in slices of steps (--turns steps, the default: each engine steps
for --slice-ms, then the next, and a method's time is the sum of its own steps'; an engine
whose job is done keeps stepping, untimed, until the last is done), so that even a slow
stretch shorter than a run lands on all of them alike; --turns runs runs each method's whole
job in turn. transformers methods always run whole runs in turn. Model drafts score their
draft_vocab.json's tokens for rows at T = 0 and every token above, as a job's do (the engine
chooses per row: config.draft_vocab_for; rows of spec methods say which in `draft_vocab`)."""
from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time
from collections import Counter
from functools import cache, partial

import click

from batchspec.config import draft_vocab_for
from batchspec.contract import DEFAULT_NUM_SPECULATIVE_TOKENS
from batchspec.jobs.commands import clear_errors
from batchspec.tools.evaluate import Finite, check_writable, load_prompts

METHODS = ("hf", "hf-assisted", "plain", "spec", "spec-domain", "spec-adaptive",
           "spec-routed", "ngram", "suffix", "suffix-adaptive")
LOOKUP_METHODS = {"ngram": "ngram", "suffix": "suffix", "suffix-adaptive": "suffix"}
# the methods whose engine sets each row's draft length per step (adaptive_k: the policy)
ADAPTIVE_METHODS = tuple(m for m in METHODS if m.endswith(("-adaptive", "-routed")))


def templated_prompts(num: int) -> list[dict]:
    """A repetitive job: every row asks for a summary of one function of the held-out
    standard-library files (never seen in training) with the same template, so rows share
    phrasing with each other more than with their own prompt. Domain `code`."""
    import ast

    from batchspec.demo.corpus import _cached_corpus
    rows = []
    for name, text in _cached_corpus()["code"]["heldout"]:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                src = (ast.get_source_segment(text, node) or "")[:300]
                rows.append({"prompt": f"{src}\n\n# Summary of {node.name}() in {name}:\n"
                                       f"# The function", "domain": "code"})
                if len(rows) == num:
                    return rows
    return rows


def _csv(kind: click.ParamType, required: bool = False):
    """A callback reading comma-separated values of a click type; required: at least one
    (an empty list ran nothing and printed a bare header)."""
    def parse(ctx, param, value):
        values = [kind(v, param, ctx) for v in (value or "").split(",") if v.strip()]
        if required and not values:
            raise click.BadParameter("give at least one value", ctx, param)
        return values
    return parse


def run_hf(model, prompt_ids, *, batch_size, temperature, max_tokens, eos_id, seed):
    from batchspec.tools import hfref
    t0 = time.perf_counter()
    outs = hfref.generate(model, prompt_ids, max_tokens=max_tokens, temperature=temperature,
                          eos_id=eos_id, seed=seed, batch_size=batch_size)
    return {"tokens": sum(len(o) for o in outs), "wall_s": time.perf_counter() - t0}


def run_assisted(model, draft, prompt_ids, *, temperature, max_tokens, eos_id, seed, k):
    import torch
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
        if temperature > 0 else dict(do_sample=False)
    tokens, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for i, ids in enumerate(prompt_ids):
            torch.manual_seed(seed + i)
            gen = model.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                dtype=torch.long), assistant_model=draft, max_new_tokens=max_tokens,
                num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0, pad_token_id=eos_id,
                eos_token_id=eos_id, **sample)
            tokens += gen.shape[1] - len(ids)
    return {"tokens": tokens, "wall_s": time.perf_counter() - t0}


def run_engine(llm, prompt_ids, *, domains, temperature, max_tokens, top_p=1.0,
               fresh_prompts=False):
    """One run of one engine method over prompt_ids (a whole job, timed as a whole);
    fresh_prompts: see _start_afresh."""
    _start_afresh(llm, fresh_prompts)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids, _params(temperature, top_p, max_tokens, len(prompt_ids)),
                        domains=domains[:len(prompt_ids)], use_tqdm=False)
    return _engine_result(outs, time.perf_counter() - t0)


SLICE_S = 0.05   # seconds an engine steps in a turn of --turns steps


def run_engines_in_turns(llms, prompt_ids, *, domains, temperature, max_tokens, top_p=1.0,
                        slice_s=SLICE_S, on_step=None, fresh_prompts=False):
    """One run of each engine method ({method: LLM}) over the same prompts (temperature: one
    for all, or a list the rows take in turn), the engines
    taking turns: each takes steps for slice_s seconds (at least one step; slice_s=0: one
    step), then the next, in the turns' orders of balanced_turns (each engine's slice comes
    right after each other engine's equally often). A method's time is the sum of its
    own steps' times, so a stretch in which a shared machine runs slower (seconds long, up to
    3x on a 2-core VM) lands on every method alike, where whole runs in turns leave it to
    whichever method ran then. An engine whose job is done keeps stepping, untimed, over the
    same prompts again until the last job is done: every timed step runs beside the same
    engines, whichever finishes first (a step right after other engines' runs 4-30% slower
    than back to back, its weights and cache evicted: benchmarks/bench_turns.py
    --interleave), and the last stretch of the slowest job is paired too. on_step(turn,
    method, seconds, tokens) follows every timed step; fresh_prompts: see _start_afresh.
    Returns run_engine's result per method."""
    params = _params(temperature, top_p, max_tokens, len(prompt_ids))
    seqs, spent = {}, dict.fromkeys(llms, 0.0)
    for method, llm in llms.items():
        _start_afresh(llm, fresh_prompts)
        seqs[method] = llm.add_requests(prompt_ids, params, domains[:len(prompt_ids)])
    names = list(llms)
    orders = [[names[i] for i in turn] for turn in balanced_turns(len(names))]
    results, turn = {}, 0
    try:
        while len(results) < len(llms):
            for method in orders[turn % len(orders)]:
                llm, timed = llms[method], method not in results
                t_end = time.perf_counter() + slice_s
                while True:
                    t0 = time.perf_counter()
                    _, tokens = llm.step()
                    t1 = time.perf_counter()
                    if timed:
                        spent[method] += t1 - t0
                        if on_step is not None:
                            on_step(turn, method, t1 - t0, tokens)
                    if not llm.engine.has_unfinished():
                        if timed:
                            results[method] = _engine_result(
                                [llm.output(s) for s in seqs[method]], spent[method])
                        if len(results) < len(llms):   # beside the others until they finish
                            llm.add_requests(prompt_ids, params, domains[:len(prompt_ids)])
                        break
                    if t1 >= t_end:
                        break
            turn += 1
    finally:   # done or interrupted: leave every engine clean, as LLM.generate does
        for llm in llms.values():
            if llm.engine.has_unfinished():
                llm.engine.abort_all()
    return results


@cache
def balanced_turns(n: int) -> tuple[tuple[int, ...], ...]:
    """Orders of n engines for successive turns (run_engines_in_turns takes them in a cycle)
    in which each engine's slice follows each other engine's exactly once a cycle, across the
    turns' boundaries too: n - 1 turns, each an order of all n, whose n(n - 1) successions
    are every ordered pair of two engines. An engine's first step of a slice runs slower than
    its next ones (its weights and cache evicted), and by how much depends on the engine
    before it: at 32 rows and T = 0.8, `spec-adaptive`'s plain steps took 5.32 ms (median)
    right after `spec-domain`'s slice, 4.90 ms after plain's and 3.57 ms within its own
    slice; plain's 5.15 ms after `spec-domain`'s, 4.97 ms after `spec-adaptive`'s and 3.52
    ms within its own (benchmarks/bench_turns.py --predecessors). With the first of each turn
    rotating (plain, spec-domain, spec-adaptive; then spec-domain, spec-adaptive, plain;
    ...), three engines followed one order twice as often as the other: `spec-adaptive` came
    after `spec-domain` in two slices of three, plain in one. The orders are found by a
    depth-first search (at once for the handful of methods a bench runs; a cycle exists for
    every n tried, 2-8; found once per n)."""
    if n <= 2:
        return (tuple(range(n)),)
    perms = list(itertools.permutations(range(n)))
    used: set[tuple[int, int]] = set()
    turns: list[tuple[int, ...]] = []

    def extend() -> bool:
        if len(turns) == n - 1:   # the cycle closes: the last engine hands to the first
            return (turns[-1][-1], turns[0][0]) not in used
        for perm in perms:
            if not turns and perm[0]:
                continue
            pairs = list(zip(perm, perm[1:]))
            if turns:
                pairs.append((turns[-1][-1], perm[0]))
            if len(set(pairs)) < len(pairs) or any(a == b or (a, b) in used
                                                   for a, b in pairs):
                continue
            used.update(pairs)
            turns.append(perm)
            if extend():
                return True
            turns.pop()
            used.difference_update(pairs)
        return False
    if not extend():     # (not met for any n tried; the rotation then, as the bench had)
        return tuple(tuple(range(t, n)) + tuple(range(t)) for t in range(n))
    return tuple(turns)


def _params(temperature, top_p, max_tokens, num_rows=None):
    """The rows' SamplingParams: one for all, or with a list of temperatures (and num_rows)
    one per row, the rows taking the temperatures in turn."""
    from batchspec import SamplingParams
    if isinstance(temperature, (list, tuple)):
        return [SamplingParams(temperature=temperature[i % len(temperature)], top_p=top_p,
                               max_tokens=max_tokens) for i in range(num_rows)]
    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)


def _start_afresh(llm, fresh_prompts=False):
    """Each run starts with empty job-wide suffix tries; with fresh_prompts, with an empty
    prefix cache too, so that it computes its prompts as a job of new prompts does (else a
    run after the first reads the full blocks of the same prompts from the cache)."""
    from batchspec.spec.suffix import SuffixProposer
    for proposer in llm.engine.proposers.values():
        if isinstance(proposer, SuffixProposer):
            proposer.domains.clear()
    if fresh_prompts:
        llm.engine.block_manager.reset_prefix_cache()


def _engine_result(outs, wall):
    from batchspec.contract import model_drafted, totals
    per_depth: list[int] = []    # the rows' drafted_per_depth, summed
    for o in outs:
        for d, n in enumerate(o.stats["drafted_per_depth"]):
            if d == len(per_depth):
                per_depth.append(0)
            per_depth[d] += n
    return {"tokens": sum(len(o.token_ids) for o in outs), "wall_s": wall,
            "totals": totals(o.stats for o in outs), "drafted_per_depth": per_depth,
            "model_drafted": sum(model_drafted(o.stats["round_drafted"], o.stats["round_source"])
                                 for o in outs)}


def demo_workload(num_prompts: int, domain: str | None = None):
    """What the scripts under benchmarks/ run on: the demo models, the dtype bench runs them
    in on this CPU, and num_prompts held-out prompts (of one domain, or taking turns) as
    token ids with their domains: (models, dtype, ids, domains)."""
    from batchspec.config import default_dtype
    from batchspec.demo import demo_models
    from batchspec.tools import hfref
    models = demo_models()
    prompts = load_prompts(None, domain, num_prompts, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    return models, default_dtype(models["target"], "cpu"), ids, [p["domain"] for p in prompts]


def make_llm(method, models, batch_size, k, seed, threshold, threads, dtype, **engine):
    from batchspec import LLM
    domain_drafts = {"default": models["draft"], "code": models["draft-code"],
                     "docs": models["draft-docs"]}
    drafts = {"plain": {}, "spec": {"default": models["draft"]},
              "spec-domain": domain_drafts, "spec-adaptive": domain_drafts,
              "spec-routed": {d: f"{path}+suffix" for d, path in domain_drafts.items()},
              **{m: {"default": src} for m, src in LOOKUP_METHODS.items()}}[method]
    # min_acceptance=0: measure speculation itself, without the production fallback. The KV
    # cache is written whole at start-up (prefault_kv_cache): with pages faulted in as rows
    # first write them, only a method whose outputs change from run to run paid for them in
    # its timed runs (adaptive lengths at T > 0: a repeat of a seeded plain or fixed-k run
    # writes the same blocks, whose hashes are registered already, so they go back to the free
    # blocks and are taken again; new outputs' blocks stay cached and new ones are taken), 1 ms
    # of a 5 ms plain step at 64 rows, T = 0.8.
    engine.setdefault("prefault_kv_cache", True)
    return LLM(models["target"], drafts=drafts, num_speculative_tokens=k, device="cpu",
               dtype=dtype, seed=seed, max_num_seqs=batch_size, min_acceptance=0.0,
               confidence_threshold=threshold, num_threads=threads,
               adaptive_k=method in ADAPTIVE_METHODS, **engine)


def draft_cost(llm, temperature: float) -> float:
    """The cost ratio c of a method's model drafts for rows at this temperature (the mean
    over them: the demo's are of one size and vocabulary), as its records price them
    (Engine.cost_ratio of Engine.source_for); 0 without."""
    if llm is None:
        return 0.0
    engine = llm.engine
    costs = [engine.cost_ratio(engine.source_for(name, temperature))
             for name in engine.config.drafts if engine.proposers[name].num_params]
    return sum(costs) / len(costs) if costs else 0.0


def finish_row(row, k, cost):
    from batchspec.contract import rounds_speedup_theoretical, summarize
    row["tok_s"] = round(row["tokens"] / row["wall_s"], 1)
    if cost:
        row["cost_ratio"] = round(cost, 4)
    t = row.pop("totals", None)
    per_depth, by_models = row.pop("drafted_per_depth", None), row.pop("model_drafted", 0)
    if t and t["total_drafted"]:
        s = summarize(t)
        row["alpha"] = round(s["acceptance_rate"], 4)
        row["tokens_per_pass"] = round(s["mean_accepted_length"], 3)
        # p, not α: the per-token acceptance the formula assumes (batchspec.contract), at
        # each round's own drafts (adaptive lengths' plain steps make one token), a model's
        # cost paid only for the tokens it drafted (not lookup or plain rounds)
        theory = None if per_depth is None else rounds_speedup_theoretical(
            s["token_acceptance_prob"] or 0.0, t["rounds"], per_depth, by_models, cost)
        if theory is not None:
            row["speedup_theoretical"] = round(theory, 3)
    return row


def add_speedups(rows):
    """Speedups of every row over each baseline at the same temperature (hf and plain at the
    same batch size; assisted generation exists at batch size 1 only)."""
    def find(method, b, t):
        return next((r for r in rows if r["method"] == method and r["batch_size"] == b
                     and r["temperature"] == t), None)
    for r in rows:
        for base, b in (("hf", r["batch_size"]), ("hf-assisted", 1), ("plain", r["batch_size"])):
            ref = find(base, b, r["temperature"])
            if ref is not None and ref is not r:
                r[f"x_{base}"] = round(r["tok_s"] / ref["tok_s"], 3)
                runs, ref_runs = r.get("runs_tok_s", []), ref.get("runs_tok_s", [])
                if len(runs) > 1 and len(runs) == len(ref_runs):
                    # the two methods' runs of each round ran one after the other: their
                    # ratio is free of the machine's slower drifts, and the median of those
                    # ratios of one fast run's luck
                    r[f"x_{base}_paired"] = round(statistics.median(
                        a / b for a, b in zip(runs, ref_runs)), 3)
        if "speedup_theoretical" in r and "x_plain" in r:
            r["observed_over_theoretical"] = round(r["x_plain"] / r["speedup_theoretical"], 3)


def print_table(rows):
    cols = [("method", "{:<12}"), ("batch_size", "{:>3}"), ("temperature", "{:>5}"),
            ("tok_s", "{:>8}"), ("alpha", "{:>7}"), ("tokens_per_pass", "{:>8}"),
            ("x_hf", "{:>7}"), ("x_hf-assisted", "{:>9}"), ("x_plain", "{:>8}"),
            ("x_plain_paired", "{:>8}"), ("speedup_theoretical", "{:>7}"),
            ("observed_over_theoretical", "{:>9}")]
    heads = ["method", "B", "T", "tok/s", "alpha", "tok/pass", "x hf", "x assist", "x plain",
             "paired", "theory", "obs/theo"]
    print(" ".join(f.format(h) for h, (_, f) in zip(heads, cols)))
    for r in rows:
        print(" ".join(f.format("-" if r.get(c) is None else r[c]) for c, f in cols))


@click.command()
@click.option("--target", envvar="BATCHSPEC_TARGET", help="Target dir (default: demo target).")
@click.option("--draft", help="General draft (default: the demo draft).")
@click.option("--draft-code", help="Draft for domain `code` (default: the demo one).")
@click.option("--draft-docs", help="Draft for domain `docs` (default: the demo one).")
@click.option("--data", type=click.Path(exists=True, dir_okay=False),
              help="Parquet with prompt [, domain]; default: held-out standard-library prompts.")
@click.option("--domain", help="Only prompts of this domain.")
@click.option("--workload", type=click.Choice(["corpus", "templated"]), default="corpus",
              show_default=True, help="Without --data: held-out corpus excerpts, or a "
              "repetitive job (one summary template over held-out functions).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=32, show_default=True,
              help="Prompts per cell, at least (see --min-batches).")
@click.option("--min-batches", type=click.IntRange(min=0), default=4, show_default=True,
              help="Each batch size's cell runs at least this many full batches: "
              "max(--num-prompts, N x batch size) prompts. A job refills its batch as rows "
              "finish; a run of one or two batches is mostly its start and its drain.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--batch-sizes", default="1,32", show_default=True,
              callback=_csv(click.IntRange(min=1), required=True))
@click.option("--temperatures", default="0,0.8", show_default=True,
              callback=_csv(Finite(min=0), required=True))
@click.option("--methods", callback=_csv(click.STRING), help=f"Comma-separated, of "
              f"{','.join(METHODS)} [all; with --target but no --draft: hf, plain and the "
              f"lookup drafts].")
@click.option("--k", type=click.IntRange(min=0), default=DEFAULT_NUM_SPECULATIVE_TOKENS,
              show_default=True, help="Draft tokens per round.")
@click.option("--confidence-threshold", "threshold", type=click.FloatRange(0, 1, max_open=True),
              default=0.0, show_default=True,
              help="batchspec drafts stop below this draft probability.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per cell, the methods taking turns; the fastest is reported, and "
              "with 2 or more the median of each round's ratio to each baseline (paired).")
@click.option("--turns", type=click.Choice(["steps", "runs"]), default="steps",
              show_default=True, help="How batchspec methods take turns in a round: in "
              "slices of engine steps (each method's time is its own steps'), or whole runs.")
@click.option("--slice-ms", type=click.FloatRange(min=0), default=SLICE_S * 1000,
              show_default=True, help="With --turns steps: how long each engine steps in a "
              "turn (at least one step; 0: one step a turn).")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads for every method "
              "(default: as the engine picks for this target).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help="For every method alike; auto: as the engine runs the "
              "target on this CPU.")
@click.option("--fresh-prompts", is_flag=True, help="Empty every engine's prefix cache before "
              "each run, so that every run computes its prompts as a job of new prompts "
              "does (by default runs after the first read their full blocks from the cache).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@clear_errors
def bench(target, draft, draft_code, draft_docs, data, domain, workload, num_prompts,
          min_batches, max_tokens, batch_sizes, temperatures, methods, k, threshold, repeats,
          turns, slice_ms, threads, dtype, fresh_prompts, seed, json_path):
    """Benchmark transformers and batchspec side by side on the same prompts and target."""
    import torch

    from batchspec.llm import freeze_heap
    from batchspec.models.loader import num_parameters
    from batchspec.tools import hfref
    models = {"target": target, "draft": draft, "draft-code": draft_code,
              "draft-docs": draft_docs}
    if target is None:  # the demo family
        from batchspec.demo import demo_models
        models = {name: path or demo_models()[name] for name, path in models.items()}
    elif draft is not None:  # a target of one's own: domain drafts default to its draft
        models = {name: path or draft for name, path in models.items()}
    methods = methods or (list(METHODS) if models["draft"] else ["hf", "plain", *LOOKUP_METHODS])
    if bad := set(methods) - set(METHODS):
        raise click.BadParameter(f"unknown methods {sorted(bad)}; choose from {METHODS}")
    if not models["draft"] and (needs := [m for m in methods
                                          if m.startswith("spec") or m == "hf-assisted"]):
        raise click.BadParameter(f"methods {needs} need a draft model: give --draft")
    # Fail before any model loads or runs: paths (transformers would ask the Hugging Face
    # Hub for a missing one), vocabularies, where --json goes, the prompts.
    hfref.check_vocabularies(models["target"], {p for name, p in models.items()
                                                if name != "target" and p})
    if json_path:
        check_writable(json_path)
    def cell_size(b: int) -> int:   # prompts a cell of batch size b runs
        return max(num_prompts, min_batches * b)
    most = max(cell_size(b) for b in batch_sizes)
    if workload == "templated" and data is None:
        prompts = templated_prompts(most)
    else:
        prompts = load_prompts(data, domain, most, split="heldout", seed=seed)
    tok = hfref.load_tokenizer(models["target"])
    prompt_ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    # One thread count for every method; by default the engine's own choice for this target.
    from batchspec.engine.engine import SMALL_MODEL_PARAMS
    if threads is None and num_parameters(models["target"]) < SMALL_MODEL_PARAMS:
        threads = 1
    torch.set_num_threads(threads or torch.get_num_threads())
    if dtype == "auto":
        from batchspec.config import default_dtype
        dtype = default_dtype(models["target"], "cpu")
    torch_dtype = getattr(torch, dtype)
    t_model = hfref.load_causal_lm(models["target"], torch_dtype) if {"hf", "hf-assisted"} & set(methods) \
        else None
    d_model = hfref.load_causal_lm(models["draft"], torch_dtype) if "hf-assisted" in methods else None
    common = dict(max_tokens=max_tokens, eos_id=tok.eos_token_id, seed=seed)
    rows = []
    all_ids, all_domains = prompt_ids, domains
    for b in batch_sizes:
        # the first prompts of one pool: a larger batch's cell runs a superset of a smaller's
        # (load_prompts gives the domains in turns: each cell holds an even share of each)
        prompt_ids, domains = all_ids[:cell_size(b)], all_domains[:cell_size(b)]
        cell_domains = dict(sorted(Counter(domains).items()))   # (in each row of --json)
        cell_methods = [m for m in methods if m != "hf-assisted" or b == 1]
        llms = runs = {}    # (the last cell's engines, held by both, go before this cell's load)
        llms = {m: make_llm(m, models, b, k, seed, threshold, torch.get_num_threads(), dtype)
                for m in cell_methods if m not in ("hf", "hf-assisted")}
        freeze_heap()    # a full collection's pause lands on whichever method allocated
        for t in temperatures:
            runs = {}
            for method in cell_methods:
                if method == "hf":
                    runs[method] = partial(run_hf, t_model, batch_size=b, temperature=t,
                                           **common)
                elif method == "hf-assisted":
                    runs[method] = partial(run_assisted, t_model, d_model, temperature=t, k=k,
                                           **common)
                else:
                    runs[method] = partial(run_engine, llms[method], domains=domains,
                                           temperature=t, max_tokens=max_tokens,
                                           fresh_prompts=fresh_prompts)
                # one batch first: first-call costs (allocation, lazy init) and what adaptive
                # lengths learn in a job's first steps are not the throughput of a long job
                runs[method](prompt_ids[:max(2, b)])
            # Methods take turns, so a busy stretch of a shared machine hits all of them; the
            # fastest of each method's runs is its least disturbed one. With --turns steps
            # the engines' runs of a round step in turns (one run for all of them).
            results: dict[str, list[dict]] = {m: [] for m in runs}
            stepped = [m for m in runs if m in llms] if turns == "steps" else []
            for _ in range(repeats):
                if len(stepped) > 1:
                    for method, res in run_engines_in_turns(
                            {m: llms[m] for m in stepped}, prompt_ids, domains=domains,
                            temperature=t, max_tokens=max_tokens,
                            slice_s=slice_ms / 1000, fresh_prompts=fresh_prompts).items():
                        results[method].append(res)
                for method, run in runs.items():
                    if method not in stepped or len(stepped) == 1:
                        results[method].append(run(prompt_ids))
            for method, res in results.items():
                best = min(res, key=lambda r: r["wall_s"])
                row = {"method": method, "batch_size": b, "temperature": t,
                       "num_prompts": len(prompt_ids), "domains": cell_domains, **best,
                       "runs_tok_s": [round(r["tokens"] / r["wall_s"], 1) for r in res]}
                if method.startswith("spec"):
                    row["draft_vocab"] = draft_vocab_for(t)
                rows.append(finish_row(row, k, draft_cost(llms.get(method), t)))
                click.echo(f"{method} B={b} T={t}: {rows[-1]['tok_s']} tok/s "
                           f"(runs {row['runs_tok_s']})", err=True)
    add_speedups(rows)
    print_table(rows)
    if json_path:
        from batchspec.config import cpu_matmul_isa, cpu_model
        info = {"machine": {"platform": platform.platform(), "cpu": cpu_model(),
                            "isa": cpu_matmul_isa(), "cpus": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
                "models": models, "workload": "data" if data else workload,
                "num_prompts": len(prompts), "min_batches": min_batches,
                "max_tokens": max_tokens,
                "k": k, "dtype": dtype, "confidence_threshold": threshold, "repeats": repeats,
                "turns": turns, "slice_ms": slice_ms if turns == "steps" else None,
                "fresh_prompts": fresh_prompts,
                "rows": rows}
        with open(json_path, "w") as f:
            json.dump(info, f, indent=1)


COMMANDS = [bench]
