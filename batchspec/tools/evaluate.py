"""`batchspec evaluate`: the acceptance rate α of a draft/target pair on held-out prompts,
overall, by domain and by temperature, with a gate so that a pipeline can refuse a draft that
no longer fits its target.

α = accepted / drafted draft tokens (k per round, as the engine counts). The engine backend
runs real speculative decoding with batchspec's LLM and reads its acceptance records; the
transformers backend replays it on the target's own continuations (see batchspec.tools.hfref),
which at T=0 gives the same numbers from one forward pass of each model."""
from __future__ import annotations

import functools
import json
import math
import os
import sys

import click

from batchspec import contract
from batchspec.contract import DEFAULT_NUM_SPECULATIVE_TOKENS
from batchspec.jobs.commands import clear_errors


class Finite(click.FloatRange):
    """A FloatRange that refuses nan and infinity, which pass its bounds' comparisons."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def check_writable(path: str) -> None:
    """Fail now, not after the whole run, where `path` cannot be written."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise click.ClickException(f"cannot write {path}: {e.strerror or e}") from None
    if not existed:
        os.remove(path)


def load_prompts(data: str | None, domain: str | None, num: int | None, *, split: str,
                 seed: int = 0) -> list[dict]:
    """[{prompt, domain}] from a Parquet file (columns prompt [, domain]) or, without one,
    from the demo corpus (the standard library) split `split`. Domains take turns
    (_interleave), so that the first n prompts, which `batchspec bench` gives the cells of
    its smaller batches, hold an even share of each."""
    if data is None:
        from batchspec.demo.corpus import DOMAINS, corpus_prompts
        if domain and domain not in DOMAINS:
            raise ValueError(f"the demo corpus has no domain {domain!r}; its domains: "
                             f"{', '.join(DOMAINS)}")
        domains = [domain] if domain else list(DOMAINS)
        per_domain = -(-(num or 64) // len(domains))
        return _interleave(corpus_prompts(split, domains, per_domain, seed=seed))[:num]
    import polars as pl
    try:
        df = pl.read_parquet(data)
    except (pl.exceptions.PolarsError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{data}: not a readable Parquet file ({first})") from None
    if "prompt" not in df.columns:
        raise click.UsageError(f"{data}: needs a 'prompt' column")
    if "domain" not in df.columns:
        df = df.with_columns(pl.lit("default").alias("domain"))
    if domain:
        df = df.filter(pl.col("domain") == domain)
    rows = df.select("prompt", "domain").to_dicts()
    if not rows:
        raise ValueError(f"{data}: no prompts" + (f" of domain {domain!r}" if domain else ""))
    for i, r in enumerate(rows):
        if not isinstance(r["prompt"], str) or not r["prompt"]:
            raise ValueError(f"{data}: prompt {i} is empty: give every row a prompt")
    if num and num < len(rows):  # an even share of each domain, not the file's first rows
        rows = _interleave(rows)
    return rows[:num] if num else rows


def _interleave(rows: list[dict]) -> list[dict]:
    """rows with their domains taking turns (each domain's rows in their order), the domains
    in the order they first appear. The demo corpus gives each domain's prompts one after
    the other: a bench of batch sizes 1 to 64 took the first 64 and 256 of 512 (its smaller
    cells) from code alone."""
    by_domain: dict[str, list[dict]] = {}
    for r in rows:
        by_domain.setdefault(r["domain"], []).append(r)
    groups = list(by_domain.values())
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


def _records_transformers(target, draft, prompts, *, k, temperature, max_tokens, seed, dtype):
    import torch

    from batchspec.tools import hfref
    tok = hfref.load_tokenizer(target)
    t_model = hfref.load_causal_lm(target, getattr(torch, dtype))
    d_model = hfref.load_causal_lm(draft, getattr(torch, dtype))
    if t_model.config.vocab_size != d_model.config.vocab_size:
        raise click.UsageError("target and draft have different vocabularies")
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    conts = hfref.generate(t_model, ids, max_tokens=max_tokens, temperature=temperature,
                           eos_id=tok.eos_token_id, seed=seed)
    return hfref.teacher_forced_acceptance(t_model, d_model, ids, conts, k=k,
                                           temperature=temperature, pad_id=tok.eos_token_id,
                                           seed=seed)


def _records_engine(target, draft, prompts, *, k, temperature, max_tokens, seed, dtype):
    from batchspec import LLM, SamplingParams
    # min_acceptance=0: never fall back to plain decoding, so every round is counted.
    llm = LLM(target, drafts={"default": draft}, num_speculative_tokens=k, device="cpu",
              dtype=dtype, seed=seed, min_acceptance=0.0)
    outs = llm.generate([p["prompt"] for p in prompts],
                        SamplingParams(temperature=temperature, max_tokens=max_tokens),
                        use_tqdm=False)
    return [{"rounds": o.stats["rounds"], "drafted": o.stats["total_drafted"],
             "accepted": o.stats["total_accepted"],
             "tokens": contract.decode_tokens(o.stats["tokens_generated"])}
            for o in outs]


def engine_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("batchspec.llm") is not None


def summarize(records: list[dict]) -> dict:
    """α and tokens per pass of records {rounds, drafted, accepted, tokens (decode tokens)},
    by the formulas of batchspec.contract."""
    drafted = sum(r["drafted"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    rounds = sum(r["rounds"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    alpha = contract.acceptance_rate(accepted, drafted)   # None: nothing drafted (k = 0)
    per_pass = contract.mean_accepted_length(tokens, rounds)
    return {"acceptance_rate": None if alpha is None else round(alpha, 4),
            "mean_accepted_length": None if per_pass is None else round(per_pass, 3),
            "num_requests": len(records), "drafted": drafted, "accepted": accepted}


def evaluate_pair(target: str, draft: str, prompts: list[dict], *, temperatures=(0.0,),
                  k: int = DEFAULT_NUM_SPECULATIVE_TOKENS, max_tokens: int = 64, seed: int = 0,
                  backend: str = "transformers", dtype: str = "auto") -> dict:
    """α of the pair over prompts at each temperature: overall, by domain, by temperature.
    dtype "auto" is what the engine picks for the target on this CPU (both backends use it:
    α depends a little on the arithmetic)."""
    from batchspec.config import default_dtype
    if dtype == "auto":
        dtype = default_dtype(target, "cpu")
    run = _records_engine if backend == "engine" else _records_transformers
    rows = []
    for t in temperatures:
        recs = run(target, draft, prompts, k=k, temperature=t, max_tokens=max_tokens, seed=seed,
                   dtype=dtype)
        rows += [dict(r, domain=p["domain"], temperature=t) for r, p in zip(recs, prompts)]
    by = lambda key: {str(v): summarize([r for r in rows if r[key] == v])  # noqa: E731
                      for v in sorted({r[key] for r in rows})}
    return {"target": target, "draft": draft, "k": k, "max_tokens": max_tokens,
            "backend": backend, "dtype": dtype, "overall": summarize(rows), "by_domain": by("domain"),
            "by_temperature": by("temperature")}


def print_report(result: dict, file=None):
    file = file or sys.stdout    # (looked up at call time: a test's or a caller's stdout)
    print(f"{'':<16}{'alpha':>8}{'tok/pass':>10}{'requests':>10}", file=file)
    lines = [("overall", result["overall"])]
    lines += [(f"domain={d}", s) for d, s in result["by_domain"].items()]
    lines += [(f"T={t}", s) for t, s in result["by_temperature"].items()]
    for name, s in lines:
        alpha, per_pass = s["acceptance_rate"], s["mean_accepted_length"]
        print(f"{name:<16}{'n/a' if alpha is None else f'{alpha:.3f}':>8}"
              f"{'n/a' if per_pass is None else f'{per_pass:.2f}':>10}"
              f"{s['num_requests']:>10}", file=file)


class UserError(click.ClickException):
    """A command that could not run exits 2, so that a pipeline tells it from a failed
    --min-acceptance gate (1)."""
    exit_code = 2


def exit_2(fn):
    """clear_errors (one line, no traceback), exiting 2 instead of 1."""
    clear = clear_errors(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return clear(*args, **kwargs)
        except click.ClickException as e:
            if e.exit_code != 1:
                raise
            raise UserError(e.message) from e
    return wrapper


@click.command()
@click.option("--target", required=True, envvar="BATCHSPEC_TARGET", help="Target model dir.")
@click.option("--draft", required=True, help="Draft model dir (same vocabulary).")
@click.option("--data", type=click.Path(exists=True, dir_okay=False),
              help="Parquet with prompt [, domain]; default: held-out standard-library prompts.")
@click.option("--domain", help="Only prompts of this domain.")
@click.option("--num-prompts", type=click.IntRange(min=1), help="Use at most this many prompts.")
@click.option("--temperature", "temperatures", type=Finite(min=0), multiple=True,
              default=[0.0], show_default=True, help="Repeat for several temperatures.")
@click.option("--k", type=click.IntRange(min=0), default=DEFAULT_NUM_SPECULATIVE_TOKENS,
              show_default=True, help="Draft tokens per round.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--min-acceptance", type=click.FloatRange(0, 1),
              help="Exit with status 1 when overall α is below (or nothing was drafted); "
              "a command that cannot run exits 2.")
@click.option("--backend", type=click.Choice(["auto", "engine", "transformers"]),
              default="auto", show_default=True, help="auto: the engine when installed.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help="auto: as the engine runs the target on this CPU.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results here.")
@exit_2
def evaluate(target, draft, data, domain, num_prompts, temperatures, k, max_tokens,
             min_acceptance, backend, dtype, seed, json_path):
    """Measure the acceptance rate α of DRAFT against TARGET; gate on --min-acceptance."""
    from batchspec.tools.hfref import check_vocabularies
    if backend == "auto":
        backend = "engine" if engine_available() else "transformers"
    check_vocabularies(target, [draft])
    if json_path:
        check_writable(json_path)
    prompts = load_prompts(data, domain, num_prompts, split="heldout", seed=seed)
    if not prompts:
        raise click.UsageError("no prompts to evaluate")
    result = evaluate_pair(target, draft, prompts, temperatures=temperatures, k=k,
                           max_tokens=max_tokens, seed=seed, backend=backend, dtype=dtype)
    result["min_acceptance"] = min_acceptance
    print_report(result)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    alpha = result["overall"]["acceptance_rate"]
    if min_acceptance is not None and alpha is None:
        click.echo(f"FAIL: nothing was drafted (k = {k}): no acceptance rate to hold to "
                   f"{min_acceptance}", err=True)
        sys.exit(1)
    if min_acceptance is not None and alpha < min_acceptance:
        click.echo(f"FAIL: acceptance rate {alpha:.3f} < {min_acceptance}", err=True)
        sys.exit(1)


COMMANDS = [evaluate]
