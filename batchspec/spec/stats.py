"""Acceptance records: one per request (DESIGN.md "Acceptance record"), built from the
sequence's speculation bookkeeping. job_id and shard are filled in by the job runner.

speedup_theoretical = E[tokens per target pass] / (1 + k * c) with
E = (1 - p^(k+1)) / (1 - p) (Leviathan et al. 2023), k the request's k_max, c the draft's cost
relative to the target, estimated by the ratio of parameter counts (0 for n-gram drafts), and
p the per-token acceptance probability: accepted / (accepted + rounds that ended in a
rejection). p, not α = accepted / drafted, is the i.i.d. rate the formula assumes: α also
counts the drafts after a rejection, which are never judged."""
from __future__ import annotations

from batchspec.engine.sequence import Sequence


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def acceptance_record(seq: Sequence, *, target: str, draft_path: str | None, k_max: int,
                      confidence_threshold: float, cost_ratio: float) -> dict:
    s = seq.spec
    drafted = sum(s.round_drafted)
    accepted = sum(s.round_accepted)
    alpha = accepted / drafted if drafted else None
    speedup = None
    if alpha is not None:
        judged = s.num_accepted + s.num_rejections
        p = s.num_accepted / judged if judged else 0.0
        speedup = expected_tokens_per_pass(p, k_max) / (1.0 + k_max * cost_ratio)
    n_out = seq.num_output_tokens
    return {
        "request_id": seq.request_id,
        "domain": seq.domain,
        "target": target,
        "draft": draft_path,
        "temperature": float(seq.params.temperature),
        "k_max": k_max,
        "confidence_threshold": float(confidence_threshold),
        "tokens_generated": n_out,
        "rounds": s.rounds,
        "total_drafted": drafted,
        "total_accepted": accepted,
        "acceptance_rate": alpha,
        # tokens per target pass over decode rounds (the first token comes from prefill)
        "mean_accepted_length": (n_out - 1) / s.rounds if s.rounds else None,
        "drafted_per_depth": list(s.drafted_per_depth),
        "accepted_per_depth": list(s.accepted_per_depth),
        "round_output_pos": list(s.round_output_pos),
        "round_drafted": list(s.round_drafted),
        "round_accepted": list(s.round_accepted),
        "skipped_by_confidence": s.skipped_by_confidence,
        "fallback_triggered": s.fallback_triggered,
        "speedup_theoretical": speedup,
        # from admission to the batch to the last token: the request's own decode time,
        # without the time it queued behind others (RequestOutput.latency_s includes that)
        "wall_s": (seq.finish_time or seq.arrival_time)
        - (seq.first_scheduled_time or seq.arrival_time),
    }
