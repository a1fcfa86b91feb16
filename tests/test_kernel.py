"""Verification kernels: the C++ twin (cpu backend) against the torch reference, its sampling
exactness, and a standalone nvcc compile of the CUDA kernel; the same checks for the CUDA
kernel where a GPU is present (scripts/gpu_check.sh). The first test builds the C++ extension
(cached under $BATCHSPEC_CACHE or ~/.cache/batchspec)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import tests.test_verify as reference_tests
from batchspec.spec import _build
from batchspec.spec.rng import STREAM_DRAFT, uniform
from batchspec.spec.verify import (
    draw_tokens,
    greedy_tokens,
    rejection_sample,
    resolve_backend,
    softmax_probs,
    target_probs,
)
from tests.test_verify import SAMPLING_CASES, assert_distributed_as, call, check_sampling_is_exact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ops():
    err = _build.load_error(cuda=False)
    if err is not None and shutil.which("c++") is None:
        pytest.skip(f"no C++ compiler: {err}")
    return _build.load(cuda=False)   # with a compiler, a failed build is a failure


def test_uniform_bit_identical(ops):
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-2**62, 2**62, (4096,), generator=g)
    offsets = torch.randint(0, 2**47, (4096,), generator=g)
    positions = torch.randint(0, 64, (4096,), generator=g)
    for stream, index in [(0, 0), (1, 0), (1, 7), (2, 3)]:
        assert torch.equal(ops.uniform(seeds, offsets, positions, stream, index),
                           uniform(seeds, offsets, positions, stream, index))


def test_filtered_probs_match_reference(ops):
    # Tolerance of the backends: same kept set, probabilities within 1e-6 absolute and
    # 1e-5 relative (exp and summation order differ in the last bits).
    g = torch.Generator().manual_seed(1)
    R, V = 96, 777
    logits = torch.randn(R, V, generator=g) * 3
    logits[:, :40] = logits[:, 40:80]                 # ties at filter boundaries
    temperature = torch.rand(R, generator=g) + 0.3
    top_k = torch.randint(0, 60, (R,), generator=g, dtype=torch.int32)
    top_p = torch.rand(R, generator=g) * 0.9 + 0.1
    top_p[::3] = 1.0
    p_cpu = ops.row_probs(logits, temperature, top_k, top_p)
    _, p_ref = target_probs(logits, temperature, top_k, top_p)
    assert torch.equal(p_cpu > 0, p_ref > 0)
    torch.testing.assert_close(p_cpu, p_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("host", ["1", "0"])
def test_draft_softmax_matches_reference(ops, host, monkeypatch):
    """A draft's q without filters (softmax_probs: kernels/draft_draw.h's softmax_row,
    vectorised or, with BATCHSPEC_VERIFY_HOST_DRAW=0, its scalar loop) is target_probs'
    within the backends' tolerance: the same tokens at 0 (-inf logits), T = 0 rows at T = 1,
    widths on and off a multiple of 8; a row with a NaN or +inf, or all -inf, gives what torch gives."""
    monkeypatch.setenv("BATCHSPEC_VERIFY_HOST_DRAW", host)
    g = torch.Generator().manual_seed(2)
    for V in (5, 8, 300, 4101):
        logits = torch.randn(12, V, generator=g) * 4
        logits[2, ::3] = float("-inf")
        temperature = torch.tensor([0.0, 0.3, 0.8, 1.0, 1.7, 3.0] * 2)
        q, ref = softmax_probs(logits, temperature), target_probs(logits, temperature)[1]
        assert torch.equal(q > 0, ref > 0)
        torch.testing.assert_close(q, ref, rtol=1e-5, atol=1e-6)
    bad = torch.randn(3, 40, generator=g)
    bad[0, 7], bad[1, 3], bad[2] = float("nan"), float("inf"), float("-inf")
    torch.testing.assert_close(softmax_probs(bad, torch.ones(3)),
                               target_probs(bad, torch.ones(3))[1], equal_nan=True)


def test_draft_draws_follow_q(ops):
    """A draft's sampled tokens (draw_tokens: the twin's inverse-CDF draw over blocks of 8)
    are distributed as q (chi-square, rows that do not sum to 1 included), never a token of
    q = 0, the same token for the same key, and another key draws anew."""
    g = torch.Generator().manual_seed(3)
    trials = 6000
    for V in (3, 37, 300):
        q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
        q[1::4] = 0.0
        q = q * 0.7                                          # mass 0.7: normalised by the draw
        seeds = torch.full((trials,), 11)
        tokens = draw_tokens(q.repeat(trials, 1), seeds, torch.arange(trials),
                             torch.zeros(trials, dtype=torch.int64), STREAM_DRAFT)
        assert (q[tokens] > 0).all()
        p = q.double().numpy()
        assert_distributed_as(tokens.numpy(), p / p.sum())
        again = draw_tokens(q.repeat(4, 1), seeds[:4], torch.arange(4),
                            torch.zeros(4, dtype=torch.int64), STREAM_DRAFT)
        assert torch.equal(again, tokens[:4])
        other = draw_tokens(q.repeat(trials, 1), seeds + 1, torch.arange(trials),
                            torch.zeros(trials, dtype=torch.int64), STREAM_DRAFT)
        assert not torch.equal(other, tokens)


def random_batch(seed, B, V, dtype, with_q, alignment=1.0):
    """Ragged batch with n_b = 0..8, a third greedy rows; drafts sampled from q, where q is
    the target's distribution mixed with noise (alignment 1 = a perfect draft)."""
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, 9, (B,), generator=g)
    N = int(num_draft.sum())
    logits = torch.randn(N + B, V, generator=g) * 4
    is_draft = torch.ones(N + B, dtype=torch.bool)
    is_draft[torch.cumsum(num_draft + 1, 0) - 1] = False
    noise = torch.randn(N, V, generator=g) * 2
    q = torch.softmax(alignment * logits[is_draft] + (1 - alignment) * noise, -1)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0].int() if N else torch.zeros(0).int()
    cu = torch.cat([torch.zeros(1), torch.cumsum(num_draft, 0)]).int()
    temperature = torch.rand(B, generator=g) + 0.5
    temperature[torch.rand(B, generator=g) < 0.33] = 0.0
    seeds = torch.randint(0, 2**40, (B,), generator=g)
    offsets = torch.randint(0, 10**6, (B,), generator=g)
    return (logits.to(dtype), q if with_q else None, drafts, cu, temperature, seeds, offsets)


def check_matches_reference(backend, dtype, with_q, filtered, B=48, V=300):
    """Tokens of `backend` == tokens of the torch reference (run on CPU) on ragged batches."""
    dev = "cuda" if backend == "cuda" else "cpu"
    for seed, alignment in [(0, 0.9), (1, 0.6)]:
        args = random_batch(seed * 10 + int(with_q), B, V, dtype, with_q, alignment)
        kw = {}
        if filtered:
            g = torch.Generator().manual_seed(seed)
            kw = dict(top_k=torch.randint(0, 40, (B,), generator=g, dtype=torch.int32),
                      top_p=torch.where(torch.rand(B, generator=g) < 0.5, 1.0, 0.9))
        out_ref, acc_ref = rejection_sample(*args, backend="torch", **kw)
        out, acc = rejection_sample(*[None if a is None else a.to(dev) for a in args],
                                    backend=backend, **{k: v.to(dev) for k, v in kw.items()})
        assert out.dtype == torch.int32 and out.shape == out_ref.shape
        assert torch.equal(acc.cpu(), acc_ref)
        assert torch.equal(out.cpu(), out_ref)
        num_draft = args[3][1:] - args[3][:-1]
        if alignment > 0.8:     # the comparison covers accepted runs and bonus tokens
            assert ((acc_ref == num_draft) & (num_draft > 0)).any() and acc_ref.sum() >= 10


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("filtered", [False, True])
def test_cpu_matches_reference(ops, dtype, with_q, filtered):
    check_matches_reference("cpu", dtype, with_q, filtered)


def test_cpu_greedy_chain_and_edge_cases(ops):
    reference_tests.test_greedy_chain_ragged("cpu")
    out, acc = call(torch.zeros(0, 5), None, [], [], [], [], backend="cpu")
    assert out.shape == (0, 1) and acc.shape == (0,)


def test_cpu_batch_composition_invariance(ops):
    logits, q, drafts, cu, temperature, seeds, offsets = random_batch(5, 16, 64, torch.float32,
                                                                      True, 0.8)
    out, acc = rejection_sample(logits, q, drafts, cu, temperature, seeds, offsets,
                                backend="cpu")
    for b in [0, 7, 15]:
        lo, hi = int(cu[b]), int(cu[b + 1])
        o1, a1 = rejection_sample(logits[lo + b:hi + b + 1], q[lo:hi], drafts[lo:hi],
                                  torch.tensor([0, hi - lo], dtype=torch.int32),
                                  temperature[b:b + 1], seeds[b:b + 1], offsets[b:b + 1],
                                  backend="cpu")
        assert a1[0] == acc[b] and o1[0].tolist() == out[b, :hi - lo + 1].tolist()


@pytest.mark.parametrize("V,dtype", [(7, torch.float32), (4096, torch.float32),
                                     (4096, torch.bfloat16), (4100, torch.bfloat16),
                                     (50257, torch.float32)])
def test_cpu_vectorised_draw_picks_the_generic_loops_tokens(ops, V, dtype, monkeypatch):
    """Plain draws (no drafts) at temperatures from peaked to flat, with and without
    top-k/top-p, seeds and offsets past 32 bits among them: the host's vectorised bonus draw
    (kernels/verify_host.h: on AVX-512, 16 Philox calls a vector and the candidates' indices
    compressed) and the generic loop (BATCHSPEC_VERIFY_HOST_DRAW=0) pick the reference's
    tokens, for fp32 and bf16 rows, with a tail past the last 64 tokens."""
    g = torch.Generator().manual_seed(V)
    B = 96
    logits = (torch.randn(B, V, generator=g) * torch.linspace(1, 15, B)[:, None]).to(dtype)
    logits[::5, ::3] = float("-inf")
    T = torch.tensor([0.05, 0.3, 0.8, 1.0, 1.7, 3.0]).repeat(B // 6)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    for seeds, offsets in ((torch.arange(B) * 7919, torch.arange(B)),
                           (torch.arange(B) * 7919 + (3 << 40), torch.arange(B) + (5 << 33))):
        args = (logits, None, torch.zeros(0, dtype=torch.int32), cu, T, seeds, offsets)
        for kw in ({}, dict(top_k=torch.full((B,), 40, dtype=torch.int32),
                            top_p=torch.full((B,), 0.9))):
            ref = rejection_sample(*args, backend="torch", **kw)[0]
            for env in ("1", "0"):
                monkeypatch.setenv("BATCHSPEC_VERIFY_HOST_DRAW", env)
                assert torch.equal(rejection_sample(*args, backend="cpu", **kw)[0], ref), env


@pytest.mark.parametrize("V", [17, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_vectorised_row_passes_pick_the_generic_loops_tokens(ops, V, dtype, monkeypatch):
    """Speculating rows (greedy, sampled with and without q, with top-k/top-p), rows with
    -inf logits and a tail of the vocabulary past the last 16 tokens: the host's vectorised
    row passes (kernels/verify_host_rows.h: row_filter's max and sums, top-k's counts, the
    argmax, the corrected draw's weights) and the generic loops pick the reference's tokens,
    and a row with a NaN keeps the generic loop's result."""
    for seed in range(3):
        args = list(random_batch(100 + seed, 40, V, dtype, seed != 1, 0.7 + 0.1 * seed))
        args[0][3::7, ::5] = float("-inf")
        g = torch.Generator().manual_seed(seed)
        B = args[3].numel() - 1
        for kw in ({}, dict(top_k=torch.randint(0, 30, (B,), generator=g, dtype=torch.int32),
                            top_p=torch.where(torch.rand(B, generator=g) < 0.5, 1.0, 0.85))):
            ref = rejection_sample(*args, backend="torch", **kw)
            for env in ("1", "0"):
                monkeypatch.setenv("BATCHSPEC_VERIFY_HOST_DRAW", env)
                got = rejection_sample(*args, backend="cpu", **kw)
                assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0]), (env, kw)
    logits = torch.randn(2, V, dtype=torch.float32)
    logits[:, V // 2] = float("nan")
    nan_args = (logits, None, torch.zeros(0, dtype=torch.int32),
                torch.zeros(3, dtype=torch.int32), torch.tensor([0.0, 0.8]),
                torch.tensor([1, 2]), torch.tensor([0, 0]))
    outs = []
    for env in ("1", "0"):
        monkeypatch.setenv("BATCHSPEC_VERIFY_HOST_DRAW", env)
        outs.append(rejection_sample(*nan_args, backend="cpu"))
    assert torch.equal(outs[0][0], outs[1][0])


def test_greedy_tokens_are_torch_argmax(ops, monkeypatch):
    """The drafts' greedy tokens (the C++ twin's argmax_rows) are logits.argmax(-1): the
    first maximum on ties, the first NaN where a row has one, index 0 for a row of -inf, at
    widths on and off a multiple of 16, vectorised and not; other dtypes go to torch."""
    g = torch.Generator().manual_seed(0)
    for V in (1, 15, 16, 33, 4096):
        logits = torch.randint(-3, 4, (12, V), generator=g).float()    # many ties
        logits[3] = float("-inf")
        logits[5, V // 2] = float("nan")
        logits[6, -1] = float("inf")
        logits[7, ::2] = float("nan")
        for env in ("1", "0"):
            monkeypatch.setenv("BATCHSPEC_VERIFY_HOST_DRAW", env)
            assert torch.equal(greedy_tokens(logits), logits.argmax(-1)), (V, env)
    x = torch.randn(4, 50, generator=g).bfloat16()
    assert torch.equal(greedy_tokens(x), x.argmax(-1))


@pytest.mark.parametrize("T,top_k,top_p", SAMPLING_CASES)
def test_cpu_sampling_is_exact(ops, T, top_k, top_p):
    check_sampling_is_exact("cpu", T, top_k, top_p)


def test_auto_picks_cpu_kernel(ops, monkeypatch):
    monkeypatch.delenv("BATCHSPEC_VERIFY_BACKEND", raising=False)
    assert resolve_backend("auto", "cpu") == "cpu"
    monkeypatch.setenv("BATCHSPEC_VERIFY_BACKEND", "torch")
    assert resolve_backend("auto", "cpu") == "torch"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found on PATH")
def test_cuda_kernel_compiles_standalone(tmp_path):
    # Device code to PTX for one architecture, unoptimised to keep it quick: the .cu must
    # build without torch headers. scripts/gpu_check.sh does the optimised build.
    src = _build.kernel_dir() / "verify_kernel.cu"
    cmd = ["nvcc", "--ptx", "-arch=compute_90", "-Xcicc", "-O0", str(src),
           "-o", str(tmp_path / "verify_kernel.ptx")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ptx = (tmp_path / "verify_kernel.ptx").read_text()
    assert ptx.count(".entry") == 6, "expected fp32/bf16/fp16 x 2 block sizes"


# ---- CUDA kernel: run by scripts/gpu_check.sh on a machine with a GPU ----------------------

@pytest.fixture(scope="module")
def cuda_ops():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return _build.load(cuda=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("filtered", [False, True])
def test_cuda_matches_reference(cuda_ops, dtype, with_q, filtered):
    check_matches_reference("cuda", dtype, with_q, filtered)


@pytest.mark.parametrize("V", [32001, 151936])   # rows not 16-byte aligned / a Qwen vocabulary
def test_cuda_matches_reference_large_vocab(cuda_ops, V):
    check_matches_reference("cuda", torch.bfloat16, True, False, B=8, V=V)


@pytest.mark.parametrize("T,top_k,top_p", SAMPLING_CASES)
def test_cuda_sampling_is_exact(cuda_ops, T, top_k, top_p):
    check_sampling_is_exact("cuda", T, top_k, top_p)


def head_int8_reference(x, packed, scale, N):
    """A draft's int8 output layer in plain integer arithmetic (exact in float64 at these
    sizes), then scaled as the op scales: what kernels/head_int8_cpu.cpp must return."""
    NB, K4 = packed.shape[0], packed.shape[1]
    wq = packed.permute(0, 2, 1, 3).reshape(NB * 16, K4 * 4)[:N].double()
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    inv = torch.full_like(amax, 127.0) / amax      # (127.0 / t in torch is 127 * (1 / t))
    q = torch.round(xf * inv).clamp(-127, 127).nan_to_num(0.0)
    qp = torch.zeros(x.shape[0], K4 * 4, dtype=torch.float64)
    qp[:, :x.shape[1]] = q.double()
    return (qp @ wq.T).float() * ((amax / 127.0) * scale[:N])


@pytest.mark.parametrize("portable", [False, True])
def test_int8_head_is_its_integer_reference(ops, portable, monkeypatch):
    """The int8 output layer of drafts: the VNNI path (up to 7 rows), the AMX-INT8 one (8 and
    more), the AVX2 one (CPUs without VNNI) and the portable loop give the integer
    reference's logits bit for bit (1-40 rows, widths on and off multiples of 4, 16 and 64,
    bf16 and fp32 rows, a row of zeros, and the largest products: weights and codes all
    +-127, whose pairs of products the AVX2 path adds in int16), within the rounding of the
    reference's own logits."""
    if portable:
        monkeypatch.setenv("BATCHSPEC_CPU_HEAD_INT8_PORTABLE", "1")
    g = torch.Generator().manual_seed(0)
    for N, K, M, dtype in ((4096, 192, 1, torch.bfloat16), (4096, 192, 4, torch.float32),
                           (37, 30, 3, torch.bfloat16), (100, 256, 6, torch.float32),
                           (4096, 192, 8, torch.bfloat16), (50, 70, 17, torch.float32),
                           (100, 256, 40, torch.bfloat16)):
        w = torch.randn(N, K, generator=g).to(dtype)
        packed, scale, sums = ops.pack_head_int8(w)
        assert torch.equal(sums[:N], packed.permute(0, 2, 1, 3).reshape(-1, packed.shape[1] * 4)
                           [:N].sum(1).int())
        x = torch.randn(M, K, generator=g).to(dtype)
        x[-1] = 0.0 if M > 2 else x[-1]
        y = ops.head_int8(x, packed, scale, sums, N)
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert torch.equal(y, head_int8_reference(x, packed, scale, N)), (N, K, M, dtype)
        exact = x.float() @ w.float().T
        assert (y - exact).abs().max() <= 0.03 * exact.abs().max()
    # every weight +-127 after quantization and every code +-127: each pair of products at
    # 2 * 127 * 127, next to int16's limit
    w = torch.sign(torch.randn(64, 256, generator=g))
    w[w == 0] = 1.0
    x = torch.ones(3, 256)
    x[1] = -1.0
    x[2, ::2] = -1.0
    packed, scale, sums = ops.pack_head_int8(w)
    y = ops.head_int8(x, packed, scale, sums, 64)
    assert torch.equal(y, head_int8_reference(x, packed, scale, 64))


def test_each_place_of_the_sources_has_its_own_build(tmp_path, monkeypatch):
    """The build files name the sources by path: two installs of one revision at different
    places (the same sources' hash) get build directories of their own, where a shared one
    was rebuilt by each in turn; one place keeps one."""
    copy = tmp_path / "kernels"
    shutil.copytree(_build.kernel_dir(), copy)
    here, sources = _build.build_dir("cpu", ["-O3"]), _build.sources_hash()
    assert _build.build_dir("cpu", ["-O3"]) == here
    assert _build.build_dir("cpu", ["-O2"]) != here
    monkeypatch.setattr(_build, "kernel_dir", lambda: copy)
    assert _build.sources_hash() == sources     # the same sources, elsewhere
    there = _build.build_dir("cpu", ["-O3"])
    assert there != here and there.parent == here.parent
