"""Verification op, torch reference: greedy chain, ragged layout, RNG keying, and sampling
exactness (chi-square of the emitted token against the target distribution)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from batchspec.spec.rng import STREAM_ACCEPT, STREAM_DRAFT, STREAM_DRAW, philox, uniform
from batchspec.spec.verify import rejection_sample, resolve_backend

I32 = torch.int32


def call(logits, draft_probs, drafts, num_draft, temperature, seeds, offsets=None,
         backend="torch", **kw):
    """rejection_sample on CPU tensors (moved to the GPU for backend="cuda"); CPU results."""
    dev = "cuda" if backend == "cuda" else "cpu"
    B = len(num_draft)
    cu = torch.tensor([0] + list(np.cumsum(num_draft)), dtype=I32)
    offsets = torch.zeros(B, dtype=torch.int64) if offsets is None else offsets
    args = [logits, draft_probs, torch.as_tensor(drafts, dtype=I32), cu,
            torch.as_tensor(temperature, dtype=torch.float32),
            torch.as_tensor(seeds, dtype=torch.int64), offsets]
    out, acc = rejection_sample(*[None if t is None else t.to(dev) for t in args],
                                backend=backend, **{k: v.to(dev) for k, v in kw.items()})
    return out.cpu(), acc.cpu()


def one_hot_logits(argmaxes, V, peak=5.0):
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = peak
    return logits


@pytest.mark.parametrize("backend", ["torch"])
def test_greedy_chain_ragged(backend):
    # n = [2, 0, 3, 1]; rows: req0 0..2, req1 3, req2 4..7, req3 8..9
    logits = one_hot_logits([1, 2, 3, 4, 0, 1, 5, 2, 3, 3], V=6)
    logits[9, 1] = 5.0                         # tie in the bonus row of req3: lowest index wins
    drafts = [1, 2, 0, 1, 3, 4]                # req0 all accepted; req2 rejects its 3rd; req3 rejects
    out, acc = call(logits, None, drafts, [2, 0, 3, 1], [0.0] * 4, [0, 1, 2, 3],
                    backend=backend)
    assert out.dtype == I32 and acc.dtype == I32
    assert out.tolist() == [[1, 2, 3, -1], [4, -1, -1, -1], [0, 1, 5, -1], [3, -1, -1, -1]]
    assert acc.tolist() == [2, 0, 2, 0]
    drafts[5] = 3                              # now req3 accepts and takes the tied bonus: 1
    out, acc = call(logits, None, drafts, [2, 0, 3, 1], [0.0] * 4, [0, 1, 2, 3],
                    backend=backend)
    assert out[3].tolist() == [3, 1, -1, -1] and acc[3] == 1


def test_all_plain_decoding_has_width_one():
    out, acc = call(one_hot_logits([2, 0], V=4), None, [], [0, 0], [0.0, 1.0], [5, 6])
    assert out.shape == (2, 1) and out[0, 0] == 2 and acc.tolist() == [0, 0]


def test_empty_batch():
    out, acc = call(torch.zeros(0, 5), None, [], [], [], [])
    assert out.shape == (0, 1) and acc.shape == (0,)


def test_q_equal_p_accepts_everything():
    torch.manual_seed(0)
    logits = torch.randn(3 * 5, 16)
    p = torch.softmax(logits, -1)
    keep = torch.ones(15, dtype=torch.bool)
    keep[[4, 9, 14]] = False                   # bonus rows
    drafts = torch.multinomial(p[keep], 1)[:, 0]
    _, acc = call(logits, p[keep], drafts, [4, 4, 4], [1.0] * 3, [1, 2, 3])
    assert acc.tolist() == [4, 4, 4]


def test_philox_known_answers():
    # Random123 known-answer vectors for Philox-4x32-10.
    cases = [([0] * 4, [0] * 2, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
             ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
             ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
              [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1])]
    for ctr, key, want in cases:
        got = philox([torch.tensor(c) for c in ctr], [torch.tensor(k) for k in key])
        assert [int(g) for g in got] == want


def test_uniform_keying():
    seeds = torch.tensor([0, 1, -5, 2**40 + 3])
    u = uniform(seeds, torch.tensor([0, 7, 2**33, 9]), torch.tensor([0, 1, 2, 3]))
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    # a draw depends on its own key only: computing it alone gives the same value
    assert uniform(seeds[2], 2**33, 2) == u[2]
    draws = [uniform(seeds, 0, 0, s) for s in (STREAM_ACCEPT, STREAM_DRAW, STREAM_DRAFT)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    big = uniform(torch.zeros(20000, dtype=torch.int64), torch.arange(20000), 0)
    assert abs(float(big.mean()) - 0.5) < 0.01 and len(set(big.tolist())) > 19900


def test_batch_composition_invariance():
    torch.manual_seed(1)
    num_draft, V = [3, 0, 2, 4], 12
    N, B = sum(num_draft), len(num_draft)
    logits = torch.randn(N + B, V) * 2
    q = torch.softmax(torch.randn(N, V), -1)
    drafts = torch.multinomial(q, 1)[:, 0]
    temps, seeds = [1.0, 0.7, 0.0, 1.3], [11, 12, 13, 14]
    offsets = torch.tensor([3, 4, 5, 6])
    out, acc = call(logits, q, drafts, num_draft, temps, seeds, offsets)
    row = d = 0
    for b, n in enumerate(num_draft):
        o1, a1 = call(logits[row:row + n + 1], q[d:d + n], drafts[d:d + n], [n], [temps[b]],
                      [seeds[b]], offsets[b:b + 1])
        assert a1[0] == acc[b] and o1[0, :n + 1].tolist() == out[b, :n + 1].tolist()
        row, d = row + n + 1, d + n


def test_resolve_backend(monkeypatch):
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError):
        resolve_backend("cuda", "cpu")
    with pytest.raises(ValueError):
        resolve_backend("fast", "cpu")
    monkeypatch.setenv("BATCHSPEC_VERIFY_BACKEND", "torch")
    assert resolve_backend("auto", "cpu") == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where the CUDA build fails")
def test_failed_build_warns_once_and_falls_back(monkeypatch):
    import warnings

    import batchspec.spec.verify as verify
    monkeypatch.setattr(verify, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [verify._kernel_ok(cuda=True) for _ in range(3)] == [False] * 3
    assert len(caught) == 1 and "torch reference" in str(caught[0].message)


# ---- sampling exactness -------------------------------------------------------------------

def filtered_target(logits: np.ndarray, T: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T) after top-k then top-p, by enumeration over the sorted vocabulary."""
    p = np.exp((logits - logits.max()) / T)
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: top_k or len(p)]] = True
    p = np.where(keep, p, 0) / p[keep].sum()
    if top_p < 1:
        head = np.cumsum(p[order]) - p[order] < top_p      # mass before < top_p
        keep = np.zeros_like(keep)
        keep[order[head]] = True
        p = np.where(keep, p, 0) / p[keep].sum()
    return p


def sample_tokens(backend, target0, target1, q, trials, T=1.0, top_k=0, top_p=1.0,
                  one_hot_draft=None):
    """One request per trial with one draft: returns (first tokens, num_accepted, second)."""
    gen = torch.Generator().manual_seed(1234)
    V = target0.numel()
    if one_hot_draft is None:
        drafts = torch.multinomial(q.expand(trials, V), 1, generator=gen)[:, 0]
        draft_probs = q.expand(trials, V).contiguous()
    else:
        drafts, draft_probs = torch.full((trials,), one_hot_draft), None
    logits = torch.stack([target0, target1]).repeat(trials, 1)     # rows: t0, t1, t0, t1 ...
    extra = {}
    if top_k or top_p < 1:
        extra = dict(top_k=torch.full((trials,), top_k, dtype=I32),
                     top_p=torch.full((trials,), top_p))
    out, acc = call(logits, draft_probs, drafts, [1] * trials, [T] * trials,
                    torch.arange(trials) * 7919 + 17, torch.arange(trials) % 5,
                    backend=backend, **extra)
    return out[:, 0].numpy(), acc.numpy(), out[:, 1].numpy()


def assert_distributed_as(tokens: np.ndarray, p: np.ndarray):
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, "emitted a token the target can never emit"
    expected = p[p > 0] * len(tokens)
    pvalue = chisquare(counts[p > 0], expected).pvalue
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e}: counts {counts}, p {p}"


SAMPLING_CASES = [  # (T, top_k, top_p)
    (1.0, 0, 1.0), (0.7, 0, 0.8), (1.0, 5, 1.0), (1.3, 6, 0.9)]


def check_sampling_is_exact(backend, T, top_k, top_p, trials=4000):
    """First emitted token ~ p (accept + residual paths), bonus token ~ p given all accepted,
    and the same for deterministic (n-gram) drafts whose q is one-hot."""
    gen = torch.Generator().manual_seed(7)
    V = 10
    target0, target1 = torch.randn(V, generator=gen) * 1.5, torch.randn(V, generator=gen)
    q = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    first, acc, second = sample_tokens(backend, target0, target1, q, trials, T, top_k, top_p)
    p0 = filtered_target(target0.double().numpy(), T, top_k, top_p)
    p1 = filtered_target(target1.double().numpy(), T, top_k, top_p)
    assert (p0 > 0).sum() > 1 and (p1 > 0).sum() > 1
    assert_distributed_as(first, p0)
    assert 0.1 < acc.mean() < 0.95            # both the accept and the residual path ran
    assert_distributed_as(second[acc == 1], p1)
    first, acc, _ = sample_tokens(backend, target0, target1, None, trials, T, top_k, top_p,
                                  one_hot_draft=int(np.argsort(-p0)[1]))
    assert_distributed_as(first, p0)


@pytest.mark.parametrize("T,top_k,top_p", SAMPLING_CASES)
def test_reference_sampling_is_exact(T, top_k, top_p):
    check_sampling_is_exact("torch", T, top_k, top_p)


def test_reference_plain_decoding_is_exact():
    gen = torch.Generator().manual_seed(3)
    trials, V = 4000, 9
    logits = torch.randn(V, generator=gen).repeat(trials, 1)
    out, acc = call(logits, None, [], [0] * trials, [0.8] * trials, torch.arange(trials))
    assert acc.sum() == 0
    assert_distributed_as(out[:, 0].numpy(), filtered_target(logits[0].double().numpy(),
                                                             0.8, 0, 1.0))


def test_a_caller_may_give_the_width_and_the_resolved_backend():
    """What an engine passes to spare per-step work (the most drafts of one request, the
    backend it resolved once) gives the same tokens as the op finding both itself."""
    gen = torch.Generator().manual_seed(3)
    num_draft, V = [2, 0, 3, 1], 7
    N, B = sum(num_draft), len(num_draft)
    logits = torch.randn(N + B, V, generator=gen)
    q = torch.softmax(torch.randn(N, V, generator=gen), -1)
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).to(I32)
    cu = torch.tensor([0] + list(np.cumsum(num_draft)), dtype=I32)
    args = [logits, q, drafts, cu, torch.tensor([0.0, 0.7, 1.0, 0.0]),
            torch.arange(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)]
    for backend in ("torch", resolve_backend("auto", "cpu")):
        want = rejection_sample(*args, backend=backend)
        got = rejection_sample(*args, backend=backend, max_num_draft=3, resolved=True)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), backend
        assert got[0].shape == (B, 4)


def test_a_bad_backend_in_the_environment_says_where_it_came_from(monkeypatch):
    monkeypatch.setenv("BATCHSPEC_VERIFY_BACKEND", "bogus")
    with pytest.raises(ValueError, match="BATCHSPEC_VERIFY_BACKEND: unknown verification"):
        resolve_backend("auto", "cpu")
    with pytest.raises(ValueError, match="^unknown verification backend 'nope'"):
        resolve_backend("nope", "cpu")
