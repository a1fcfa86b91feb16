"""Acceptance analysis: lazy Polars queries over the per-request acceptance records that jobs
write to OUT/acceptance/part-*.parquet (docs/design.md, "Data formats").

Two rates, both pooled over records (long requests weigh more than short ones):
  acceptance_rate (α)      total accepted / total drafted; the number people tune by.
  token_acceptance_prob p  total accepted / tokens verified before the first rejection of each
                           round; the per-token α of Leviathan et al., the one that goes into
                           tokens per target pass = (1 - p^(k+1)) / (1 - p).
α counts every draft behind a rejection as not accepted, so α < p whenever windows hold more
than one draft. Percentiles (P50/P90/P99) are over per-request α. See
docs/acceptance-analysis.md.

    from batchspec.report.analysis import analyze
    result = analyze(["out/job-a", "out/job-b"], by=("domain", "temperature"))
    result["acceptance_rate"], result["by"]["domain"]
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Sequence

import polars as pl

from batchspec import contract

# scan_acceptance and NoAcceptanceData are part of this module's API too.
from batchspec.report.records import (  # noqa: F401
    NoAcceptanceData,
    find_acceptance_files,
    scan_acceptance,
    scan_files,
)

TEMPERATURE_BUCKETS = ["0", "(0, 0.3]", "(0.3, 0.7]", "(0.7, 1]", ">1"]
POSITION_BUCKETS = ["0-9", "10-49", "50-99", "100-199", "200+"]
NUM_HIST_BINS = 20


def _sum(name: str, where: pl.Expr | None = None) -> pl.Expr:
    # Counters are int32 per request; their sum over millions of requests is not.
    col = pl.col(name).cast(pl.Int64)
    return (col if where is None else col.filter(where)).sum()


_ratio = contract.ratio


def _bucket_index(x: pl.Expr, edges: Sequence[float]) -> pl.Expr:
    """i for edges[i-1] < x <= edges[i], len(edges) above the last edge; null stays null.
    Counting the edges below x is much cheaper than a when/then chain over millions of rounds."""
    return functools.reduce(operator.add, [(x > e).cast(pl.UInt8) for e in edges])


def _bucket_label(index: pl.Expr, labels: Sequence[str]) -> pl.Expr:
    return index.replace_strict(dict(enumerate(labels)), return_dtype=pl.Enum(labels))


def temperature_bucket() -> pl.Expr:
    # temperature is float32: 0.3f is 0.30000001, which must still land in (0, 0.3].
    t = pl.col("temperature").cast(pl.Float64).round(6).fill_nan(None)
    return _bucket_label(_bucket_index(t, [0.0, 0.3, 0.7, 1.0]), TEMPERATURE_BUCKETS)


BREAKDOWN_KEYS = {"domain": pl.col("domain"), "draft": pl.col("draft"),
                  "temperature": temperature_bucket(), "target": pl.col("target"),
                  "job": pl.col("job_id"), "k": pl.col("k_max")}

request_alpha = contract.acceptance_rate(pl.col("total_accepted"), pl.col("total_drafted"))
is_speculative = pl.col("draft").is_not_null()
decode_tokens = contract.decode_tokens(pl.col("tokens_generated"))


def _rates() -> list[pl.Expr]:
    """Aggregates shared by the overall summary and every breakdown row."""
    drafted, accepted = _sum("total_drafted"), _sum("total_accepted")
    tokens, rounds = _sum("tokens_generated"), _sum("rounds")
    return [
        pl.len().alias("requests"),
        is_speculative.sum().alias("speculative_requests"),
        drafted.alias("total_drafted"), accepted.alias("total_accepted"),
        contract.acceptance_rate(accepted, drafted).alias("acceptance_rate"),
        *(request_alpha.quantile(q, "linear").alias(f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)),
        tokens.alias("tokens_generated"), rounds.alias("rounds"),
        contract.mean_accepted_length(decode_tokens.sum(), rounds).alias("mean_accepted_length"),
        _ratio(_sum("skipped_by_confidence", is_speculative),
               _sum("rounds", is_speculative)).alias("skip_rate"),
        _ratio(pl.col("fallback_triggered").filter(is_speculative).sum(),
               is_speculative.sum()).alias("fallback_rate"),
    ]


def _prompt_counts(columns: Sequence[str]) -> list[pl.Expr]:
    """Prompt tokens and those served by the prefix cache (records written before these
    columns existed have none)."""
    if "cached_prompt_tokens" not in columns:
        return []
    prompt, cached = _sum("prompt_tokens"), _sum("cached_prompt_tokens")
    return [prompt.alias("prompt_tokens"), cached.alias("cached_prompt_tokens"),
            contract.prompt_cache_hit_rate(cached, prompt).alias("prompt_cache_hit_rate")]


def summary_query(lf: pl.LazyFrame, columns: Sequence[str] = ()) -> pl.LazyFrame:
    return lf.select(_rates() + _prompt_counts(columns))


def breakdown_query(lf: pl.LazyFrame, key: str) -> pl.LazyFrame:
    expr = BREAKDOWN_KEYS.get(key, pl.col(key))
    return lf.group_by(expr.alias(key)).agg(_rates()).sort(key, nulls_last=True)


def depth_query(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Drafted/accepted at each depth d of the draft window. A draft at depth d is accepted
    only if every draft before it was, so α(d) falls like p^(d+1) under i.i.d. acceptance."""
    lists = ["drafted_per_depth", "accepted_per_depth"]
    return (lf.select(lists)
            .with_columns(pl.int_ranges(pl.col(lists[0]).list.len()).alias("depth"))
            .explode(["depth", *lists])
            .drop_nulls("depth")
            .group_by("depth")
            .agg(_sum(lists[0]).alias("drafted"), _sum(lists[1]).alias("accepted"))
            .with_columns(_ratio(pl.col("accepted"), pl.col("drafted")).alias("acceptance_rate"))
            .sort("depth"))


def position_query(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Per-round counts pooled by the output position at which the round started. Also counts
    rejections (rounds that stopped before their window's end), from which p is estimated."""
    lists = ["round_output_pos", "round_drafted", "round_accepted"]
    return (_round_counts(lf.select(lists).explode(lists).drop_nulls("round_output_pos"),
                          _bucket_index(pl.col("round_output_pos"), [9, 49, 99, 199])
                          .alias("position"))
            .sort("position")
            .with_columns(_bucket_label(pl.col("position"), POSITION_BUCKETS)))


def source_query(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Per-round counts pooled by the source that drafted the round (a draft model's path,
    'ngram' or 'suffix'; rows routed between a model and a lookup choose per round). Rounds
    without drafts are left out."""
    lists = ["round_source", "round_drafted", "round_accepted"]
    return (_round_counts(lf.select(lists).explode(lists).drop_nulls("round_source"),
                          pl.col("round_source").alias("source"))
            .sort("source"))


def _round_counts(rounds: pl.LazyFrame, key: pl.Expr) -> pl.LazyFrame:
    """Rounds, drafted, accepted, rejections (rounds that stopped before their window's end),
    α and p of exploded per-round lists, grouped by key."""
    return (rounds.group_by(key)
            .agg(pl.len().alias("rounds"), _sum("round_drafted").alias("drafted"),
                 _sum("round_accepted").alias("accepted"),
                 (pl.col("round_accepted") < pl.col("round_drafted")).sum()
                 .alias("rejections"))
            .with_columns(contract.acceptance_rate(pl.col("accepted"), pl.col("drafted"))
                          .alias("acceptance_rate"),
                          contract.token_acceptance_prob(pl.col("accepted"), pl.col("rejections"))
                          .alias("token_acceptance_prob")))


def histogram_query(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Per-request α in NUM_HIST_BINS bins [lo, hi) over [0, 1]; α = 1 goes in the last bin.
    The bin is floor(bins * accepted / drafted) in integers: α = 0.15 is exactly on an edge,
    and floats would put it on either side."""
    bin_ = ((pl.col("total_accepted").cast(pl.Int64) * NUM_HIST_BINS) // pl.col("total_drafted"))
    return (lf.filter(pl.col("total_drafted") > 0)
            .select(bin_.clip(0, NUM_HIST_BINS - 1).cast(pl.Int32).alias("bin"))
            .group_by("bin").agg(pl.len().alias("count")))


def outliers_query(lf: pl.LazyFrame, n: int = 10, min_drafted: int = 1) -> pl.LazyFrame:
    """The n requests with the lowest α (ties: the one that drafted more first, then by job
    and request id, so the list does not depend on the order files are read in)."""
    cols = ["request_id", "job_id", "domain", "draft", "temperature", "total_drafted",
            "total_accepted"]
    return (lf.filter(pl.col("total_drafted") >= max(min_drafted, 1))
            .select(*cols, request_alpha.alias("acceptance_rate"))
            .sort(["acceptance_rate", "total_drafted", "job_id", "request_id"],
                  descending=[False, True, False, False], nulls_last=True)
            .head(n))


def speedup_query(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Rounds and wall time per (target, k) for speculative and plain requests."""
    theoretical = pl.col("speedup_theoretical").fill_nan(None)    # NaN is not JSON
    return (lf.group_by(pl.col("target"), is_speculative.alias("speculative"),
                        pl.col("k_max").alias("k"))
            .agg(pl.len().alias("requests"), _sum("tokens_generated"), _sum("rounds"),
                 decode_tokens.sum().alias("decode_tokens"),
                 pl.col("wall_s").fill_nan(None).sum(),
                 theoretical.sum().alias("speedup_theoretical_sum"),
                 theoretical.count().alias("speedup_theoretical_count")))


def _speedup(sp: pl.DataFrame, p: float | None, depth: pl.DataFrame) -> dict:
    """depth: depth_query's drafts per depth (plain requests draft none), which with the
    speculative requests' rounds give the tokens a pass their windows predict."""
    spec, plain = sp.filter("speculative"), sp.filter(~pl.col("speculative"))
    predicted = None if p is None else contract.expected_tokens_per_round(
        p, spec["rounds"].sum(), depth.sort("depth")["drafted"].to_list())
    out = spec.select(
        contract.mean_accepted_length(pl.col("decode_tokens").sum(), pl.col("rounds").sum())
        .alias("tokens_per_pass"),
        pl.lit(predicted, pl.Float64).alias("predicted_tokens_per_pass"),
        _ratio(pl.col("speedup_theoretical_sum").sum(), pl.col("speedup_theoretical_count").sum())
        .alias("speedup_theoretical_mean"),
        pl.col("k").unique().sort().implode().alias("k"),
    ).to_dicts()[0]

    def rate(df: pl.DataFrame) -> pl.DataFrame:
        return df.group_by("target").agg(pl.col("tokens_generated").sum(), pl.col("wall_s").sum())

    # Observed speedup: per-request decode rate (tokens / wall_s) of speculative requests over
    # that of plain requests of the same target, when the records hold both.
    both = rate(spec).join(rate(plain), on="target", suffix="_plain")
    out["observed"] = both.select(
        "target",
        _ratio(pl.col("tokens_generated"), pl.col("wall_s")).alias("tokens_per_s"),
        _ratio(pl.col("tokens_generated_plain"), pl.col("wall_s_plain")).alias("tokens_per_s_plain"),
    ).with_columns(_ratio(pl.col("tokens_per_s"), pl.col("tokens_per_s_plain")).alias("speedup")
                   ).sort("target").to_dicts()
    pooled = both.sum()
    out["observed_speedup"] = (None if both.is_empty() else pooled.select(_ratio(
        _ratio(pl.col("tokens_generated"), pl.col("wall_s")),
        _ratio(pl.col("tokens_generated_plain"), pl.col("wall_s_plain")))).item())
    return out


def analyze(source: Iterable[str] | pl.LazyFrame, by: Sequence[str] = ("domain", "draft",
            "temperature"), num_outliers: int = 10, min_drafted: int = 1) -> dict:
    """Every aggregate of the report as plain, JSON-ready Python values. `source` is paths
    (see find_acceptance_files) or a LazyFrame of acceptance records. All queries run in one
    collect_all, so Polars reads the files once."""
    files = None if isinstance(source, pl.LazyFrame) else find_acceptance_files(source)
    lf = source if files is None else scan_files(files)
    columns = lf.collect_schema().names()
    unknown = [k for k in by if k not in BREAKDOWN_KEYS and k not in columns]
    if unknown:
        raise ValueError(f"cannot break down by {unknown}; use {sorted(BREAKDOWN_KEYS)} "
                         f"or a column name")
    measured = [k for k in by if k in {e.meta.output_name() for e in _rates()}]
    if measured:        # (a breakdown row holds each of these as its aggregate)
        raise ValueError(f"cannot break down by {measured}: a breakdown measures it; use "
                         f"{sorted(BREAKDOWN_KEYS)} or another column")
    # records written before round_source existed have no per-round sources
    sources = source_query(lf) if "round_source" in columns else \
        pl.LazyFrame(schema={"source": pl.String})
    queries = [summary_query(lf, columns), depth_query(lf), position_query(lf),
               histogram_query(lf), outliers_query(lf, num_outliers, min_drafted),
               speedup_query(lf), sources,
               *(breakdown_query(lf, k) for k in by)]
    # The streaming engine runs the ~30M-row explode of the per-round lists in half the time.
    summary, depth, position, hist, outliers, sp, by_source, *groups = pl.collect_all(
        queries, engine="streaming")

    summary = summary.to_dicts()[0]
    accepted, rejections = position["accepted"].sum(), position["rejections"].sum()
    p = contract.token_acceptance_prob(accepted, rejections)
    depth = depth.with_columns((pl.lit(p, pl.Float64).pow(pl.col("depth") + 1))
                               .alias("iid_prediction"))
    counts = dict(zip(hist["bin"].to_list(), hist["count"].to_list(), strict=True))
    return {
        "acceptance_rate": summary["acceptance_rate"],
        "files": None if files is None else len(files),
        "token_acceptance_prob": p,
        "summary": summary,
        "speedup": _speedup(sp, p, depth),
        "by": {k: g.to_dicts() for k, g in zip(by, groups, strict=True)},
        "by_depth": depth.to_dicts(),
        "by_position": position.to_dicts(),
        "by_source": by_source.to_dicts(),
        "histogram": [{"lo": i / NUM_HIST_BINS, "hi": (i + 1) / NUM_HIST_BINS,
                       "count": counts.get(i, 0)} for i in range(NUM_HIST_BINS)],
        "outliers": outliers.with_columns(pl.col("temperature").cast(pl.Float64).round(6)
                                          .fill_nan(None))
                            .to_dicts(),
    }
