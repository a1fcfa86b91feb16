"""Turning logits into a sampling distribution: temperature, then top-k, then top-p
(the order vLLM and transformers use). Token choice itself happens in
batchspec.spec.verify.rejection_sample, which plain decoding calls with zero drafts."""
from __future__ import annotations

import torch


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor,
                   top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """logits [R, V] fp32 -> probabilities [R, V]. Rows with temperature 0 use T=1 (their
    distribution only serves confidence checks; greedy picks the argmax)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits / t.to(logits.device)[:, None]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]):
    """Mask (to -inf) logits outside each row's top-k and top-p nucleus."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if 0 < kk < V else V for kk in top_k], device=logits.device)
    ranks = torch.arange(V, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs   # mass of strictly better tokens
    drop |= mass_before >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
