"""The contract from row to record: what goes into the engine (a Request and its seed) and
what comes out of it (one acceptance record per request, its Arrow schema, and every
aggregate over records). Each fact is defined here once; the engine, `_job.json`,
`batchspec report`, `evaluate` and `bench` import it (docs/design.md, "The contract").

Plain Python: importing this module loads neither torch, pyarrow nor polars. The aggregate
formulas take plain numbers or Polars expressions alike, so the report's group-bys and the
job summary compute the same thing.

speedup_theoretical = E[tokens per target pass] / (1 + k * c) with
E = (1 - p^(k+1)) / (1 - p) (Leviathan et al. 2023), k the drafts a round, c the draft's cost
relative to the target, estimated by the ratio of parameter counts (0 for n-gram and suffix
drafts), and p the per-token acceptance probability: accepted / (accepted + rounds that ended
in a rejection). p, not α = accepted / drafted, is the i.i.d. rate the formula assumes: α also
counts the drafts after a rejection, which are never judged. A request's rounds need not
draft k alike (adaptive lengths choose each round's, plain steps draft none; a routed row's
lookup rounds cost no draft forward): its speedup_theoretical takes each round's own count n
(expected_tokens_per_round: the mean of E at n over its rounds, E = 1 at n = 0; over 1 + c
times the tokens draft models drafted a round: rounds_speedup_theoretical), which is the
formula above where every round drafts k from a model."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchspec.sampling import SamplingParams

if TYPE_CHECKING:
    from batchspec.engine.sequence import Sequence

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# A record's round_source: the draft model's path for its rounds, these for lookup drafts'
NGRAM = "ngram"
SUFFIX = "suffix"
LOOKUP_SOURCES = (NGRAM, SUFFIX)   # drafts that look tokens up instead of running a model


# ---- the request going in ------------------------------------------------------------------

@dataclass
class Request:
    """One prompt, encoded, with everything that decides its output."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    domain: str | None = None


class RequestError(ValueError):
    """A prompt that cannot run; `kind` names why (the error_type of a job's error row)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def request_seed(base_seed: int, request_id: str) -> int:
    """The seed of a request that gives none: from the LLM's (or job's) seed and the request
    id, so a request's tokens depend on neither its batch, its shard nor its position.
    `LLM.generate`, `batchspec run` and `batchspec submit` all seed through here."""
    digest = hashlib.sha256(f"{base_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# ---- the record coming out -----------------------------------------------------------------

# (name, Arrow type, meaning). One record per request; counters cover its whole generation.
RECORD_FIELDS: list[tuple[str, str, str]] = [
    ("request_id", "string", ""),
    ("job_id", "string", "filled in by the job runner"),
    ("shard", "string", "filled in by the job runner"),
    ("domain", "string", ""),
    ("target", "string", "path of the target model"),
    ("draft", "string", "the domain's draft setting (model path, 'ngram', 'suffix', or "
     "PATH+ngram|suffix), or null for plain decoding"),
    ("temperature", "float32", ""),
    ("k_max", "int32", "most drafts per round"),
    ("confidence_threshold", "float32", ""),
    ("prompt_tokens", "int32", ""),
    ("cached_prompt_tokens", "int32", "prompt tokens whose KV came from the prefix cache"),
    ("tokens_generated", "int32", ""),
    ("rounds", "int32", "decode passes of the target (the first token comes from prefill)"),
    ("total_drafted", "int32", ""),
    ("total_accepted", "int32", ""),
    ("acceptance_rate", "float64", "acceptance_rate(); null if nothing was drafted"),
    ("mean_accepted_length", "float64", "mean_accepted_length(): tokens per decode pass"),
    ("drafted_per_depth", "list<int32>", "index d: drafts proposed at depth d of a window"),
    ("accepted_per_depth", "list<int32>", ""),
    ("round_output_pos", "list<int32>", "output position at the start of each round"),
    ("round_drafted", "list<int32>", ""),
    ("round_accepted", "list<int32>", ""),
    ("round_source", "list<string>",
     "which source drafted each round (a draft model's path, 'ngram' or 'suffix'; null for a "
     "round without drafts): a row with DIR+ngram|suffix chooses per round"),
    ("skipped_by_confidence", "int32", "rounds the confidence threshold cut short"),
    ("fallback_triggered", "bool", ""),
    ("speedup_theoretical", "float64", "rounds_speedup_theoretical()"),
    ("wall_s", "float64", "from admission to the batch to the last token"),
]
RECORD_NAMES = [name for name, _, _ in RECORD_FIELDS]


def acceptance_schema():
    """The Arrow schema of acceptance records (imports pyarrow)."""
    import pyarrow as pa
    types = {"string": pa.string(), "float32": pa.float32(), "float64": pa.float64(),
             "int32": pa.int32(), "bool": pa.bool_(), "list<int32>": pa.list_(pa.int32()),
             "list<string>": pa.list_(pa.string())}
    return pa.schema([(name, types[t]) for name, t, _ in RECORD_FIELDS])


def __getattr__(name):  # ACCEPTANCE_SCHEMA, built on first use so that pyarrow loads lazily
    if name == "ACCEPTANCE_SCHEMA":
        schema = acceptance_schema()
        globals()[name] = schema
        return schema
    raise AttributeError(name)


def acceptance_record(seq: Sequence, *, target: str, draft_path: str | None, k_max: int,
                      confidence_threshold: float, cost_ratio: float) -> dict:
    """The record of a finished sequence (job_id and shard are the job runner's to fill)."""
    s = seq.spec
    drafted, accepted = sum(s.round_drafted), sum(s.round_accepted)
    n_out = seq.num_output_tokens
    p = token_acceptance_prob(s.num_accepted, s.num_rejections)
    return {
        "request_id": seq.request_id,
        "domain": seq.domain,
        "target": target,
        "draft": draft_path,
        "temperature": float(seq.params.temperature),
        "k_max": k_max,
        "confidence_threshold": float(confidence_threshold),
        "prompt_tokens": seq.num_prompt_tokens,
        "cached_prompt_tokens": seq.num_cached_prompt_tokens,
        "tokens_generated": n_out,
        "rounds": s.rounds,
        "total_drafted": drafted,
        "total_accepted": accepted,
        "acceptance_rate": acceptance_rate(accepted, drafted),
        "mean_accepted_length": mean_accepted_length(decode_tokens(n_out), s.rounds),
        "drafted_per_depth": list(s.drafted_per_depth),
        "accepted_per_depth": list(s.accepted_per_depth),
        "round_output_pos": list(s.round_output_pos),
        "round_drafted": list(s.round_drafted),
        "round_accepted": list(s.round_accepted),
        "round_source": list(s.round_source),
        "skipped_by_confidence": s.skipped_by_confidence,
        "fallback_triggered": s.fallback_triggered,
        "speedup_theoretical": None if not drafted else
        rounds_speedup_theoretical(p or 0.0, s.rounds, s.drafted_per_depth,
                                   model_drafted(s.round_drafted, s.round_source), cost_ratio),
        "wall_s": (seq.finish_time or seq.arrival_time)
        - (seq.first_scheduled_time or seq.arrival_time),
    }


# ---- aggregates: one formula each, for numbers and Polars expressions -----------------------

def _is_expr(x) -> bool:
    return type(x).__module__.startswith("polars")


def ratio(num, den):
    """num / den, None (null) where den is 0: never NaN, since results go to JSON."""
    if _is_expr(num) or _is_expr(den):
        import polars as pl
        return pl.when(den > 0).then(num / den)
    return num / den if den else None


def decode_tokens(tokens_generated):
    """Tokens produced by decode rounds: a request's first token comes from its prefill pass,
    which `rounds` does not count."""
    if _is_expr(tokens_generated):
        return (tokens_generated.cast(int) - 1).clip(lower_bound=0)
    return max(int(tokens_generated) - 1, 0)


def acceptance_rate(accepted, drafted):
    """α = accepted / drafted, pooled: the number people tune by."""
    return ratio(accepted, drafted)


def token_acceptance_prob(accepted, rejections):
    """p = accepted / (accepted + rounds that ended in a rejection): the per-token acceptance
    of Leviathan et al., the rate that goes into expected_tokens_per_pass."""
    return ratio(accepted, accepted + rejections)


def mean_accepted_length(decode_tokens_, rounds):
    """Tokens per target decode pass: Σ decode_tokens / Σ rounds (1.0 for plain decoding)."""
    return ratio(decode_tokens_, rounds)


def draft_token_share(accepted, tokens_generated):
    """Share of the output tokens that came from accepted drafts: what speculation made of a
    job. An engine with adaptive lengths decodes plainly where drafts do not pay, and its α
    then rests on the few rounds it drafted; this says so."""
    return ratio(accepted, tokens_generated)


def prompt_cache_hit_rate(cached_prompt_tokens, prompt_tokens):
    """Share of prompt tokens whose KV came from the prefix cache instead of being computed."""
    return ratio(cached_prompt_tokens, prompt_tokens)


def throughput(amount, seconds):
    """A job's rate (tokens/s, requests/s): what its shards that ran produced over its wall
    seconds. Shards found done count in its rows and tokens, not here: a resume that ran one
    shard of six is not six times as fast. None without time."""
    return ratio(amount, seconds)


def expected_tokens_per_pass(p: float, k):
    """(1 - p^(k+1)) / (1 - p): tokens per target pass with windows of k and i.i.d. p
    (k an int or a Polars expression)."""
    if p >= 1.0:
        return k + 1.0
    return (1.0 - p ** (k + 1)) / (1.0 - p)


def expected_tokens_per_round(p: float, rounds: int, drafted_per_depth) -> float | None:
    """The mean over `rounds` rounds of expected_tokens_per_pass(p, n), n each round's drafts
    (one token where a round drafted none), from drafted_per_depth[d], the rounds that drafted
    more than d tokens: a round of n drafts makes 1 + p + ... + p^n. None without rounds."""
    if not rounds:
        return None
    return 1.0 + sum(n * p ** (d + 1) for d, n in enumerate(drafted_per_depth)) / rounds


def model_drafted(round_drafted: Iterable[int], round_source: Iterable[str | None]) -> int:
    """Tokens that draft models drafted in these rounds (a lookup's cost no forward)."""
    return sum(n for n, src in zip(round_drafted, round_source, strict=True)
               if n and src not in LOOKUP_SOURCES)


def rounds_speedup_theoretical(p: float, rounds: int, drafted_per_depth, model_drafted_: int,
                               cost_ratio: float) -> float | None:
    """speedup_theoretical over rounds of their own draft counts (a record's, or several
    records' summed): expected_tokens_per_round over 1 + c times the tokens draft models
    drafted a round (model_drafted). A row of an adaptive engine that drafted one round in
    41 is priced near plain decoding's 1.0, not at what drafting k every round would make;
    where every round drafts k from a model, Leviathan's E(p, k) / (1 + k c). None without
    rounds."""
    tokens = expected_tokens_per_round(p, rounds, drafted_per_depth)
    return None if tokens is None else tokens / (1.0 + cost_ratio * model_drafted_ / rounds)


SUMMARY_COUNTERS = ("prompt_tokens", "cached_prompt_tokens", "tokens_generated",
                    "decode_tokens", "rounds", "total_drafted", "total_accepted", "rejections",
                    "requests_with_fallback")


def totals(records: Iterable[Mapping]) -> dict:
    """Counters summed over acceptance records (dicts with the record's fields)."""
    t = dict.fromkeys(SUMMARY_COUNTERS, 0)
    t["requests"] = 0
    for r in records:
        t["requests"] += 1
        t["prompt_tokens"] += r.get("prompt_tokens") or 0
        t["cached_prompt_tokens"] += r.get("cached_prompt_tokens") or 0
        n = r.get("tokens_generated") or 0
        t["tokens_generated"] += n
        t["decode_tokens"] += decode_tokens(n)
        t["rounds"] += r.get("rounds") or 0
        t["total_drafted"] += r.get("total_drafted") or 0
        t["total_accepted"] += r.get("total_accepted") or 0
        t["rejections"] += sum(a < d for d, a in zip(r.get("round_drafted") or [],
                                                      r.get("round_accepted") or []))
        t["requests_with_fallback"] += bool(r.get("fallback_triggered"))
    return t


def add_totals(a: Mapping, b: Mapping) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}


def summarize(t: Mapping) -> dict:
    """The acceptance summary of counters from `totals`: what `_job.json`, `evaluate` and
    `bench` report, and what `batchspec report` computes per group with the same formulas."""
    return {
        "requests": t.get("requests", 0),
        "prompt_tokens": t.get("prompt_tokens", 0),
        "cached_prompt_tokens": t.get("cached_prompt_tokens", 0),
        "prompt_cache_hit_rate": prompt_cache_hit_rate(t.get("cached_prompt_tokens", 0),
                                                       t.get("prompt_tokens", 0)),
        "tokens_generated": t["tokens_generated"],
        "rounds": t["rounds"],
        "total_drafted": t["total_drafted"],
        "total_accepted": t["total_accepted"],
        "acceptance_rate": acceptance_rate(t["total_accepted"], t["total_drafted"]),
        "token_acceptance_prob": token_acceptance_prob(t["total_accepted"], t["rejections"]),
        "mean_accepted_length": mean_accepted_length(t["decode_tokens"], t["rounds"]),
        "requests_with_fallback": t["requests_with_fallback"],
    }
