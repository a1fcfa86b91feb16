"""Torch reference of the verification op: readable, vectorised, the oracle for the kernels.

Speculative sampling, Leviathan et al. 2023 (arXiv 2211.17192) and Chen et al. 2023
(arXiv 2302.01318). The draws use the counter-based RNG of batchspec.spec.rng with the
same formulas as kernels/verify_core.h, so every backend returns the same tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchspec.spec.rng import STREAM_ACCEPT, gumbel_argmax, race_argmax, uniform


def filter_logits(z: torch.Tensor, top_k=None, top_p=None) -> torch.Tensor:
    """Set to -inf the tokens of scaled logits z [R, V] outside top-k, then outside top-p.

    top-k keeps z_i >= the k-th largest value (ties at the boundary are kept); top-p keeps
    token i when the probability mass of tokens strictly more likely than i is < top_p (the
    smallest head of mass >= top_p, as in HF). top_k 0 and top_p >= 1 turn them off.
    """
    R, V = z.shape
    if top_k is not None:
        k = top_k.to(z.device, torch.int64).clamp(0, V)
        k = torch.where(k == 0, V, k)                                       # [R]
        kth = z.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None:
        top_p = top_p.to(z.device, torch.float32)[:, None]                   # [R, 1]
        zs = z.sort(dim=-1, descending=True).values                         # [R, V]
        e = torch.exp(zs - zs[:, :1])
        ps = e / e.sum(-1, keepdim=True)
        before = F.pad(ps.cumsum(-1)[:, :-1], (1, 0))                        # exclusive cumsum
        first_tie = torch.searchsorted(-zs, -zs)                             # ties count as one
        keep = (before.gather(1, first_tie) < top_p) | (top_p >= 1.0)
        thresh = zs.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)
        z = z.masked_fill(z < thresh, float("-inf"))
    return z


def target_probs(logits, temperature, top_k=None, top_p=None):
    """(z, p): filtered scaled logits and p = softmax(z), fp32 [R, V]; T = 0 rows use T = 1."""
    t = torch.where(temperature > 0, temperature, 1.0).to(logits.device, torch.float32)
    z = filter_logits(logits.float() * (1.0 / t)[:, None], top_k, top_p)   # as the kernels
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return z, e / e.sum(-1, keepdim=True)


def rejection_sample_torch(target_logits, draft_probs, draft_token_ids, cu_num_draft,
                           temperature, seeds, offsets, top_k=None, top_p=None):
    """Reference of batchspec.spec.verify.rejection_sample (same arguments and results)."""
    dev, (R, V) = target_logits.device, target_logits.shape
    B, N = cu_num_draft.numel() - 1, draft_token_ids.numel()
    cu = cu_num_draft.to(dev, torch.int64)
    num_draft = cu[1:] - cu[:-1]                                             # [B]
    max_n = int(num_draft.max()) if B else 0
    first_row = cu[:-1] + torch.arange(B, device=dev)                       # [B]
    req = torch.repeat_interleave(torch.arange(B, device=dev), num_draft + 1)   # [N+B]
    pos = torch.arange(R, device=dev) - first_row[req]                      # [N+B] j in window
    is_draft = pos < num_draft[req]                                          # N rows, in order
    rd, jd, x = req[is_draft], pos[is_draft], draft_token_ids.to(dev, torch.int64)   # [N]
    # A draft id outside [0, V) (a placeholder such as -1) is never accepted, nor is one the
    # draft gave probability 0: docs/verification.md, "Malformed drafts".
    valid = (x >= 0) & (x < V)
    x = torch.where(valid, x, 0)
    pick = lambda t: None if t is None else t.to(dev)[req]                  # noqa: E731
    z, p = target_probs(target_logits, temperature.to(dev)[req], pick(top_k), pick(top_p))
    argmax = target_logits.float().argmax(-1)                               # [N+B] greedy target
    greedy = temperature.to(dev) == 0                                       # [B]

    # Accept draft x with probability min(1, p(x) / q(x)): u * q(x) < p(x), u ~ U(0, 1)
    # keyed by (seed, offset, j). q is one-hot at x when draft_probs is None.
    p_x = p[is_draft].gather(1, x[:, None])[:, 0]
    q_x = torch.ones_like(p_x) if draft_probs is None else \
        draft_probs.gather(1, x[:, None])[:, 0].float()
    u = uniform(seeds.to(dev)[rd], offsets.to(dev)[rd], jd, STREAM_ACCEPT)
    accept = valid & torch.where(greedy[rd], x == argmax[is_draft], (q_x > 0) & (u * q_x < p_x))
    run = torch.zeros(B, max_n, dtype=torch.int64, device=dev)
    run[rd, jd] = accept.long()
    num_accepted = run.cumprod(1).sum(1)                                     # [B] leading accepts

    # Emit from row a = num_accepted: after a rejection from norm(max(0, p - q)) (exponential
    # race; falls back to p if rounding left no mass), else the bonus from p (Gumbel-max).
    a, emit = num_accepted, first_row + num_accepted                        # [B]
    rejected = a < num_draft
    d = (cu[:-1] + a).clamp(max=max(N - 1, 0))                              # draft index of row a
    if N == 0:
        q = torch.zeros(B, V, device=dev)
    else:
        q = draft_probs[d].float() if draft_probs is not None else \
            F.one_hot(x[d], V).float() * valid[d, None]             # an invalid id has no q
    resid = torch.where(rejected[:, None], (p[emit] - q).clamp(min=0), 0.0)   # [B, V]
    s, o = seeds.to(dev), offsets.to(dev)
    token = argmax[emit]                                                     # [B] greedy rows
    is_race = ~greedy & (resid > 0).any(-1)
    is_gumbel = ~greedy & ~is_race
    for rows, draw, w in ((is_race, race_argmax, resid), (is_gumbel, gumbel_argmax, z[emit])):
        if rows.any():                                 # draw only for the rows that need it
            token[rows] = draw(w[rows], s[rows], o[rows], a[rows])

    out = torch.full((B, max_n + 1), -1, dtype=torch.int32, device=dev)
    kept = jd < a[rd]
    out[rd[kept], jd[kept]] = x[kept].int()                                 # valid ids only
    out[torch.arange(B, device=dev), a] = token.int()
    return out, num_accepted.int()
