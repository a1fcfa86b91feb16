"""batchspec.report.analysis against answers computed independently (plain Python, numpy) from
synthetic acceptance records written as real Parquet job output dirs."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from fractions import Fraction

import numpy as np
import pytest

from batchspec.report.analysis import NoAcceptanceData, analyze, find_acceptance_files
from tests.acceptance_records import (
    make_record,
    plain_record,
    synthetic_records,
    write_job,
    write_records,
)


@pytest.fixture(scope="module")
def records():
    return synthetic_records(400, seed=1)


@pytest.fixture(scope="module")
def job(tmp_path_factory, records):
    out = str(tmp_path_factory.mktemp("job"))
    return write_job(out, [records[:150], [], records[150:]])   # with an empty shard


@pytest.fixture(scope="module")
def result(job):
    return analyze([job], by=("domain", "draft", "temperature"))


def speculative(records):
    return [r for r in records if r["total_drafted"] > 0]


def quantiles(alphas):
    return list(np.quantile(alphas, [0.5, 0.9, 0.99])) if alphas else [None] * 3


def temperature_bucket(t: float) -> str:
    # On the float64 temperatures the records were made from, not the stored float32 ones.
    return ("0" if t == 0 else "(0, 0.3]" if t <= 0.3 else "(0.3, 0.7]" if t <= 0.7
            else "(0.7, 1]" if t <= 1 else ">1")


def test_overall_aggregates(result, records):
    drafted = sum(r["total_drafted"] for r in records)
    accepted = sum(r["total_accepted"] for r in records)
    rejections = sum(a < n for r in records for n, a in zip(r["round_drafted"], r["round_accepted"], strict=True))
    spec = [r for r in records if r["draft"] is not None]
    s = result["summary"]
    assert s["requests"] == len(records) and s["speculative_requests"] == len(spec)
    assert result["files"] == 3
    assert result["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert result["token_acceptance_prob"] == pytest.approx(accepted / (accepted + rejections))
    # the first token of each request comes from prefill, not from a round
    assert s["mean_accepted_length"] == pytest.approx(sum(r["tokens_generated"] - 1 for r in records)
                                                 / sum(r["rounds"] for r in records))
    assert s["skip_rate"] == pytest.approx(sum(r["skipped_by_confidence"] for r in spec)
                                           / sum(r["rounds"] for r in spec))
    assert s["fallback_rate"] == pytest.approx(np.mean([r["fallback_triggered"] for r in spec]))
    alphas = [r["acceptance_rate"] for r in speculative(records)]
    assert [s["p50"], s["p90"], s["p99"]] == pytest.approx(quantiles(alphas))


@pytest.mark.parametrize("key,field,label", [
    ("domain", "domain", lambda v: v), ("draft", "draft", lambda v: v),
    ("temperature", "temperature", temperature_bucket)])
def test_breakdowns(result, records, key, field, label):
    groups = defaultdict(list)
    for r in records:
        groups[None if r[field] is None else label(r[field])].append(r)
    rows = {g[key]: g for g in result["by"][key]}
    assert set(rows) == set(groups)
    for name, rs in groups.items():
        row, drafted = rows[name], sum(r["total_drafted"] for r in rs)
        assert row["requests"] == len(rs)
        expected = sum(r["total_accepted"] for r in rs) / drafted if drafted else None
        assert row["acceptance_rate"] == pytest.approx(expected)
        alphas = [r["acceptance_rate"] for r in speculative(rs)]
        assert [row["p50"], row["p90"], row["p99"]] == pytest.approx(quantiles(alphas))


def test_alpha_by_depth(result, records):
    drafted, accepted = defaultdict(int), defaultdict(int)
    for r in records:
        for d, (n, a) in enumerate(zip(r["drafted_per_depth"], r["accepted_per_depth"], strict=True)):
            drafted[d] += n
            accepted[d] += a
    rows = result["by_depth"]
    assert [g["depth"] for g in rows] == sorted(drafted)
    assert [g["drafted"] for g in rows] == [drafted[d] for d in sorted(drafted)]
    assert [g["acceptance_rate"] for g in rows] == pytest.approx(
        [accepted[d] / drafted[d] for d in sorted(drafted)])
    p = result["token_acceptance_prob"]
    assert [g["iid_prediction"] for g in rows] == pytest.approx([p ** (d + 1) for d in sorted(drafted)])


def test_histogram_and_outliers(result, records):
    counts = [0] * 20
    for r in speculative(records):   # bins [lo, hi) on the exact fraction; α = 1 in the last
        counts[min(19, int(Fraction(r["total_accepted"], r["total_drafted"]) * 20))] += 1
    assert [h["count"] for h in result["histogram"]] == counts
    lowest = sorted(speculative(records), key=lambda r: (r["acceptance_rate"], -r["total_drafted"]))
    got = result["outliers"]
    assert [o["acceptance_rate"] for o in got] == pytest.approx(
        [r["acceptance_rate"] for r in lowest[:10]])
    by_id = {r["request_id"]: r for r in records}
    assert all(by_id[o["request_id"]]["total_accepted"] == o["total_accepted"] for o in got)


def test_speedup(result, records):
    spec = [r for r in records if r["draft"] is not None]
    plain = [r for r in records if r["draft"] is None]
    p, sp = result["token_acceptance_prob"], result["speedup"]
    rounds = sum(r["rounds"] for r in spec)
    assert sp["tokens_per_pass"] == pytest.approx(
        sum(r["tokens_generated"] - 1 for r in spec) / rounds)
    # a round of n drafts makes (1 - p^(n+1)) / (1 - p) tokens (one where it drafted none)
    counts = [n for r in spec for n in r["round_drafted"]]
    assert 0 in counts and len(set(counts)) > 2    # rounds of several lengths, plain ones too
    predicted = sum((1 - p ** (n + 1)) / (1 - p) for n in counts) / rounds
    assert sp["predicted_tokens_per_pass"] == pytest.approx(predicted)
    assert sp["speedup_theoretical_mean"] == pytest.approx(
        np.mean([r["speedup_theoretical"] for r in spec]))
    rate = lambda rs: sum(r["tokens_generated"] for r in rs) / sum(r["wall_s"] for r in rs)  # noqa: E731
    assert sp["observed_speedup"] == pytest.approx(rate(spec) / rate(plain))


def test_temperature_buckets_at_boundaries(tmp_path):
    temps = [0.0, 0.29, 0.3, 0.31, 0.69, 0.7, 0.71, 0.99, 1.0, 1.01, 1.3]
    recs = [make_record(f"r{i}", [(2, 1)], temperature=t) for i, t in enumerate(temps)]
    r = analyze([write_job(str(tmp_path), [recs])], by=["temperature"])
    counts = {g["temperature"]: g["requests"] for g in r["by"]["temperature"]}
    assert counts == {"0": 1, "(0, 0.3]": 2, "(0.3, 0.7]": 3, "(0.7, 1]": 3, ">1": 2}


def test_position_buckets_at_boundaries(tmp_path):
    positions = [0, 9, 10, 49, 50, 99, 100, 199, 200, 1000]
    rounds = [(1, 1), (2, 0), (3, 3), (4, 1), (1, 0), (2, 2), (3, 1), (4, 4), (1, 1), (2, 1)]
    rec = make_record("r0", rounds, positions=positions, k=4)
    r = analyze([write_job(str(tmp_path), [[rec]])])
    got = {g["position"]: (g["rounds"], g["drafted"], g["accepted"], g["rejections"])
           for g in r["by_position"]}
    assert got == {"0-9": (2, 3, 1, 1), "10-49": (2, 7, 4, 1), "50-99": (2, 3, 2, 1),
                   "100-199": (2, 7, 5, 1), "200+": (2, 3, 2, 1)}


def test_several_jobs_globs_and_files(tmp_path, records):
    a = write_job(str(tmp_path / "jobs" / "a"), [records[:100]])
    b = write_job(str(tmp_path / "jobs" / "b"), [records[100:250], records[250:]])
    total = analyze([a, b])
    assert total["summary"]["requests"] == len(records) and total["files"] == 3
    assert total["acceptance_rate"] == pytest.approx(
        sum(r["total_accepted"] for r in records) / sum(r["total_drafted"] for r in records))
    (tmp_path / "jobs" / "logs").mkdir()            # matched by the glob below, skipped
    for paths in ([str(tmp_path / "jobs")], [str(tmp_path / "jobs" / "*")],
                  [str(tmp_path / "jobs" / "*" / "acceptance" / "*.parquet")],
                  [os.path.join(a, "acceptance"), os.path.join(b, "acceptance", "part-00000.parquet"),
                   os.path.join(b, "acceptance", "part-00001.parquet")]):
        assert analyze(paths)["summary"] == total["summary"]


def test_hive_partitions_become_columns_but_never_overwrite_fields(tmp_path):
    for day, n in (("2026-11-01", 3), ("2026-11-02", 5)):
        recs = [make_record(f"{day}-{i}", [(2, 1)], job_id="recorded") for i in range(n)]
        write_records(str(tmp_path / f"day={day}" / "job_id=from-path" / "acceptance" /
                          "part-00000.parquet"), recs)
    r = analyze([str(tmp_path)], by=["day", "job"])
    assert {str(g["day"]): g["requests"] for g in r["by"]["day"]} == {"2026-11-01": 3,
                                                                       "2026-11-02": 5}
    assert [(g["job"], g["requests"]) for g in r["by"]["job"]] == [("recorded", 8)]


def test_all_plain_job(tmp_path):
    recs = [plain_record(f"r{i}", 5 + i) for i in range(4)]
    r = analyze([write_job(str(tmp_path), [recs])])
    assert r["acceptance_rate"] is None and r["token_acceptance_prob"] is None
    assert r["summary"]["requests"] == 4 and r["summary"]["mean_accepted_length"] == 1.0
    assert all(g["acceptance_rate"] is None for g in r["by_depth"] + r["by_position"])
    assert r["outliers"] == [] and sum(h["count"] for h in r["histogram"]) == 0
    assert r["speedup"]["predicted_tokens_per_pass"] is None


def test_empty_shards_and_empty_dirs(tmp_path):
    only_empty = write_job(str(tmp_path / "a"), [[]])
    os.makedirs(tmp_path / "b" / "acceptance")                      # job with nothing written
    open(tmp_path / "b" / "acceptance" / "part-00000.parquet", "w").close()  # zero-byte debris
    r = analyze([only_empty, str(tmp_path / "b")])
    assert r["summary"]["requests"] == 0 and r["acceptance_rate"] is None
    assert r["files"] == 1 and r["by"]["domain"] == []


def test_paths_without_acceptance_files_are_errors(tmp_path):
    (tmp_path / "outputs").mkdir()
    with pytest.raises(NoAcceptanceData, match="no acceptance/ directory"):
        find_acceptance_files([str(tmp_path)])
    with pytest.raises(NoAcceptanceData, match="no such path"):
        find_acceptance_files([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="cannot break down by"):
        analyze([write_job(str(tmp_path / "j"), [[]])], by=["colour"])


def test_sums_do_not_overflow_int32(tmp_path):
    big = 2**31 - 10                     # fits one record's int32 counter; two do not
    recs = [make_record(f"r{i}", [(2, 1)]) | dict(total_drafted=big, total_accepted=big // 2,
                                                   tokens_generated=big, rounds=big)
            for i in range(2)]
    s = analyze([write_job(str(tmp_path), [recs])])["summary"]
    assert (s["total_drafted"], s["total_accepted"], s["rounds"]) == (2 * big, 2 * (big // 2), 2 * big)
    assert s["acceptance_rate"] == pytest.approx((big // 2) / big)


def test_only_done_shards_of_a_job_count(tmp_path, records):
    # Shard 1 wrote its acceptance file but not its outputs file: not done, a rerun redoes it.
    job = write_job(str(tmp_path / "job"), [records[:100], records[100:200]])
    (tmp_path / "job" / "outputs").mkdir()
    (tmp_path / "job" / "outputs" / "part-00000.parquet").write_bytes(b"PAR1")
    r = analyze([job])
    assert r["files"] == 1 and r["summary"]["requests"] == 100
    # Passed directly, an acceptance file is read whatever the state of its shard.
    assert analyze([os.path.join(job, "acceptance", "part-00001.parquet")])["files"] == 1


def test_result_is_strict_json_even_with_nan_inputs(tmp_path):
    nan = float("nan")
    recs = [make_record("r0", [(2, 0)], temperature=nan, speedup=nan, wall_s=nan),
            make_record("r1", [(2, 1)], speedup=2.0), plain_record("r2", 3, wall_s=nan)]
    r = analyze([write_job(str(tmp_path), [recs])])
    json.dumps(r, allow_nan=False)
    assert r["speedup"]["speedup_theoretical_mean"] == 2.0
    assert {g["temperature"]: g["requests"] for g in r["by"]["temperature"]} == {"0": 2, None: 1}
    assert r["outliers"][0]["request_id"] == "r0" and r["outliers"][0]["temperature"] is None


def test_alpha_by_source(tmp_path):
    """Rounds pooled by the source that drafted them (routed rows switch per round); rounds
    without drafts count nowhere; records without round_source (older files) give none."""
    rounds = [(4, 4), (3, 1), (0, 0), (2, 0)]
    routed = make_record("r", rounds, draft="m+suffix", sources=["suffix", "m", None, "suffix"])
    other = make_record("o", [(4, 2)], draft="m")
    write_records(str(tmp_path / "job" / "acceptance" / "part-00000.parquet"), [routed, other])
    by = {g["source"]: g for g in analyze([str(tmp_path / "job")])["by_source"]}
    assert set(by) == {"suffix", "m"}
    assert (by["suffix"]["rounds"], by["suffix"]["drafted"], by["suffix"]["accepted"]) == (2, 6, 4)
    assert by["suffix"]["token_acceptance_prob"] == pytest.approx(4 / 5)
    assert (by["m"]["rounds"], by["m"]["drafted"], by["m"]["accepted"]) == (2, 7, 3)
    assert by["m"]["acceptance_rate"] == pytest.approx(3 / 7)
    import polars as pl
    old = pl.read_parquet(str(tmp_path / "job" / "acceptance" / "part-00000.parquet"))
    old.drop("round_source").write_parquet(str(tmp_path / "old.parquet"))
    assert analyze([str(tmp_path / "old.parquet")])["by_source"] == []
