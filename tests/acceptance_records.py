"""Acceptance records for tests, built from their rounds so that every field agrees with the
others the way the engine writes them (batchspec/contract.py RECORD_FIELDS)."""
from __future__ import annotations

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.contract import ACCEPTANCE_SCHEMA


def make_record(request_id: str, rounds: list[tuple[int, int]], *, positions=None,
                domain="chat", draft="d0", temperature=0.0, k=4, job_id="job0",
                target="t0", skipped=0, fallback=False, speedup=1.5, wall_s=1.0,
                sources=None) -> dict:
    """rounds: (drafted, accepted) per decode round; a round emits accepted + 1 tokens after
    the first token (which the prefill pass emits), so the output position of each round
    follows unless `positions` gives them. sources: who drafted each round (default: the
    draft, for every round that drafted)."""
    if sources is None:
        sources = [draft if n else None for n, _ in rounds]
    if positions is None:
        positions = [1 + sum(a + 1 for _, a in rounds[:i]) for i in range(len(rounds))]
    depth_drafted, depth_accepted = [0] * k, [0] * k
    for n, a in rounds:
        assert 0 <= a <= n <= k
        for d in range(n):
            depth_drafted[d] += 1
            depth_accepted[d] += d < a
    drafted, accepted = sum(n for n, _ in rounds), sum(a for _, a in rounds)
    tokens = 1 + sum(a + 1 for _, a in rounds)
    return dict(
        request_id=request_id, job_id=job_id, shard="part-00000", domain=domain,
        target=target, draft=draft, temperature=temperature, k_max=k,
        confidence_threshold=0.0, tokens_generated=tokens, rounds=len(rounds),
        total_drafted=drafted, total_accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=(tokens - 1) / len(rounds) if rounds else None,
        drafted_per_depth=depth_drafted, accepted_per_depth=depth_accepted,
        round_output_pos=positions, round_drafted=[n for n, _ in rounds],
        round_accepted=[a for _, a in rounds], round_source=sources,
        skipped_by_confidence=skipped,
        fallback_triggered=fallback, speedup_theoretical=speedup, wall_s=wall_s)


def plain_record(request_id: str, num_tokens: int, **kw) -> dict:
    """A request decoded without speculation: the prefill token, then one token per round."""
    kw.setdefault("speedup", None)
    return make_record(request_id, [(0, 0)] * (num_tokens - 1), draft=None, **kw)


def write_records(path: str, records: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records, schema=ACCEPTANCE_SCHEMA), path)
    return path


def write_job(out_dir: str, shards: list[list[dict]]) -> str:
    """A job output dir with one acceptance/part-NNNNN.parquet per shard."""
    for i, records in enumerate(shards):
        write_records(os.path.join(out_dir, "acceptance", f"part-{i:05d}.parquet"), records)
    return out_dir


DOMAINS = ["chat", "code", "rag"]
DRAFTS = ["d-small", "ngram"]
TEMPERATURES = [0.0, 0.15, 0.3, 0.5, 0.7, 0.9, 1.0, 1.3]


def synthetic_records(n: int, seed: int = 0, job_id: str = "job0") -> list[dict]:
    """n requests of varied domain, draft, temperature, window size and length, with a few
    plain ones; acceptance falls with temperature so that breakdowns differ."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        if i % 10 == 9:
            records.append(plain_record(f"{job_id}-{i}", rng.randint(1, 40), job_id=job_id,
                                        domain=rng.choice(DOMAINS),
                                        wall_s=rng.uniform(0.5, 2.0)))
            continue
        k, temperature = rng.choice([2, 4, 5]), rng.choice(TEMPERATURES)
        p = max(0.05, 0.9 - 0.4 * temperature - rng.random() * 0.3)
        rounds = []
        for _ in range(rng.randint(1, 60)):
            n_draft = rng.randint(0, k)
            a = 0
            while a < n_draft and rng.random() < p:
                a += 1
            rounds.append((n_draft, a))
        records.append(make_record(
            f"{job_id}-{i}", rounds, domain=rng.choice(DOMAINS), draft=rng.choice(DRAFTS),
            temperature=temperature, k=k, job_id=job_id, skipped=rng.randint(0, 3),
            fallback=rng.random() < 0.1, speedup=rng.uniform(1, 3),
            wall_s=rng.uniform(0.2, 1.0)))
    return records
