"""Verification op of speculative decoding: rejection sampling over a ragged batch.

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). Request b owns
draft positions cu[b] .. cu[b+1]-1 and target rows cu[b]+b .. cu[b+1]+b (one per draft, then
its bonus row). Greedy rows (T = 0) accept while draft == argmax; random rows accept draft x
with probability min(1, p(x)/q(x)), emit a draw from norm(max(0, p - q)) at the first
rejection, or a bonus draw from p when all drafts are accepted. The emitted tokens are then
distributed exactly as sampling from p = softmax(top_p(top_k(logits / T))).

Backends: "torch" (verify_torch.py, the reference), "cpu" (kernels/verify_core.h compiled for
the host), "cuda" (kernels/verify_kernel.cu). All draw from the counter-based RNG keyed by
(seed, offset, position) (batchspec.spec.rng), so they return the same tokens. "auto" picks
cuda > cpu > torch; env BATCHSPEC_VERIFY_BACKEND replaces "auto".
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from batchspec.spec import _build
from batchspec.spec.rng import uniform_compiled
from batchspec.spec.verify_torch import filter_logits, rejection_sample_torch, target_probs

__all__ = ["rejection_sample", "verify", "VerifyMetadata", "resolve_backend", "filter_logits",
           "target_probs", "rejection_sample_torch", "BACKENDS", "greedy_tokens",
           "filtered_probs", "softmax_probs", "draw_tokens"]

BACKENDS = ("auto", "torch", "cpu", "cuda")
_warned = False


def _kernel_ok(cuda: bool) -> bool:
    """Build/load the kernel library; on failure warn once (the caller falls back)."""
    global _warned
    err = _build.load_error(cuda)
    if err is not None and not _warned:
        _warned = True
        warnings.warn(f"batchspec verification kernel unavailable ({err}); "
                      "using the torch reference", RuntimeWarning, stacklevel=3)
    return err is None


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend that runs for tensors on `device`: explicit names are honoured (and
    raise if unusable), "auto" (or env BATCHSPEC_VERIFY_BACKEND) degrades to what works."""
    if backend == "auto":
        backend = os.environ.get("BATCHSPEC_VERIFY_BACKEND", "auto").strip().lower() or "auto"
        explicit = False
    else:
        explicit = True
    if backend not in BACKENDS:
        where = "" if explicit else "BATCHSPEC_VERIFY_BACKEND: "
        raise ValueError(f"{where}unknown verification backend {backend!r}; expected one of "
                         f"{BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if backend in ("cuda", "cpu") and (backend == "cuda") != on_cuda:
        if explicit:
            raise ValueError(f"backend {backend!r} cannot run on {torch.device(device)} tensors")
        backend = "auto"
    if backend == "auto":
        backend = "cuda" if on_cuda else "cpu"
    if backend == "torch":
        return backend
    if explicit:
        _build.load(cuda=on_cuda)       # raises with the compiler's message
        return backend
    return backend if _kernel_ok(on_cuda) else "torch"


def rejection_sample(target_logits, draft_probs, draft_token_ids, cu_num_draft, temperature,
                     seeds, offsets, *, top_k=None, top_p=None, backend="auto",
                     max_num_draft=None, resolved=False):
    """Verify a ragged batch of drafts against the target and emit the next tokens.

    target_logits [N+B, V] fp32/bf16/fp16   draft_probs [N, V] fp32 or None (one-hot drafts)
    draft_token_ids [N]   cu_num_draft [B+1] int32   temperature [B] fp32 (0: greedy)
    seeds, offsets [B] int64   top_k [B] int32 (0: off) or None   top_p [B] fp32 (1: off) or None
    max_num_draft: max_n, the most drafts of one request, where the caller knows it (else it
    is read from cu_num_draft: a few small ops and, on a GPU, a sync). resolved: `backend`
    is what resolve_backend returned for this device (an engine resolves it once: per step,
    resolving took about 0.1 ms of a 6 ms step at one row, the environment read included).
    Returns (output_token_ids [B, max_n+1] int32 padded with -1, num_accepted [B] int32).
    """
    if not resolved:
        backend = resolve_backend(backend, target_logits.device)
    if backend == "torch":
        return rejection_sample_torch(target_logits, draft_probs, draft_token_ids,
                                      cu_num_draft, temperature, seeds, offsets, top_k, top_p)
    ops = _build.load(cuda=backend == "cuda")
    dev = target_logits.device
    B = cu_num_draft.numel() - 1
    cu = cu_num_draft.to(dev, torch.int32).contiguous()
    max_n = max_num_draft if max_num_draft is not None else \
        int((cu[1:] - cu[:-1]).max()) if B > 0 else 0          # one sync: the output width
    args = [target_logits.contiguous(),
            None if draft_probs is None else draft_probs.to(dev, torch.float32).contiguous(),
            draft_token_ids.to(dev, torch.int32).contiguous(), cu,
            temperature.to(dev, torch.float32).contiguous(),
            seeds.to(dev, torch.int64).contiguous(), offsets.to(dev, torch.int64).contiguous(),
            None if top_k is None else top_k.to(dev, torch.int32).contiguous(),
            None if top_p is None else top_p.to(dev, torch.float32).contiguous()]
    logits = args[0]
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert logits.shape[0] == draft_token_ids.numel() + B, "target rows must be N + B"
    assert draft_probs is None or tuple(draft_probs.shape) == (draft_token_ids.numel(),
                                                               logits.shape[1])
    return ops.rejection_sample(*args, max_n)


_cpu_ops: dict[str, object] = {}


def _cpu_op(name: str):
    """The C++ twin's CPU op `name` (loaded once), or None without the kernel."""
    if name not in _cpu_ops:
        _cpu_ops[name] = getattr(_build.load(False), name) if _kernel_ok(False) else None
    return _cpu_ops[name]


def _cpu_rows(x: torch.Tensor) -> bool:
    """Whether x is what the twin's row ops take: contiguous fp32 [R, V > 0] on the CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and \
        x.is_contiguous() and x.shape[1] > 0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as logits.argmax(-1): a draft's greedy tokens, every draft step.
    Contiguous fp32 logits on the CPU go through the C++ twin's vectorised pass (torch's op
    takes about 2 ns a token on one thread: 0.3 ms a draft step at 32 rows of 4,096 tokens),
    others (and a machine without the kernel) through torch."""
    op = _cpu_op("argmax_rows")
    return op(logits) if op is not None and _cpu_rows(logits) else logits.argmax(-1)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int],
                   top_p: list[float]) -> torch.Tensor | None:
    """softmax(top_p(top_k(logits / T))) [R, V] of contiguous fp32 CPU logits by the C++
    twin's row filter (`row_probs`: the binary searches the verification op uses for p, the
    same tokens kept as target_probs' sorts, sums in another order), T = 0 rows at T = 1;
    top_k at most V (0: off), top_p (1: off). Sorting every row of a vocabulary cost a
    draft step about 4 ms at 8 rows of 4,096 tokens. None without the kernel: the caller
    uses target_probs."""
    op = _cpu_op("row_probs")
    if op is None or not _cpu_rows(logits):
        return None
    t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)
    return op(logits, t, torch.tensor(top_k, dtype=torch.int32),
              torch.tensor(top_p, dtype=torch.float32))


def softmax_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """q = softmax(logits / T) [R, V] fp32, T = 0 rows at T = 1: a draft's distribution
    without filters. Contiguous fp32 CPU logits go through the C++ twin's one pass a row
    (`softmax_rows`, exp to ~2e-7 relative as the verification op's), others through
    target_probs."""
    op = _cpu_op("softmax_rows")
    if op is not None and _cpu_rows(logits):
        return op(logits, temperature.to(torch.float32).contiguous())
    return target_probs(logits, temperature)[1]


def draw_tokens(q: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One token per row of q [R, V] (>= 0), by the inverse CDF at the keyed uniform of
    (seed, offset, position, stream), as verification keys its draws: a draft's sampled
    tokens. On the CPU the C++ twin's `draw_rows` (a token of q = 0 is never drawn); on
    other devices torch's cumsum and searchsorted."""
    op = _cpu_op("draw_rows")
    if op is not None and _cpu_rows(q):
        return op(q, seeds, offsets, positions, stream)
    u = uniform_compiled(seeds, offsets, positions, stream).to(q.device)
    cdf = torch.cumsum(q, dim=-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return drawn.clamp(max=q.shape[-1] - 1)


@dataclass
class VerifyMetadata:
    """What the verification op needs besides the target logits, for B requests with N
    drafts in all (shapes as in rejection_sample)."""
    draft_token_ids: torch.Tensor          # [N] int32 (what the kernels take) or int64
    cu_num_draft: torch.Tensor             # [B+1] int32
    temperature: torch.Tensor              # [B] fp32, 0: greedy
    seeds: torch.Tensor                    # [B] int64
    offsets: torch.Tensor                  # [B] int64: tokens the request has emitted so far
    draft_probs: torch.Tensor | None = None    # [N, V] fp32; None: one-hot drafts
    top_k: torch.Tensor | None = None      # [B] int32 (0: off); None: off for every row
    top_p: torch.Tensor | None = None      # [B] fp32 (1: off); None: off for every row
    max_num_draft: int | None = None       # the most drafts of one request, where the caller
    #                                        knows it; None: read from cu_num_draft

    @classmethod
    def dummy(cls, device: torch.device | str = "cpu") -> VerifyMetadata:
        """One greedy request without drafts: for warming the op up (a first call builds
        or loads the kernel)."""
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(0, **i64), torch.zeros(2, dtype=torch.int32, device=device),
                   torch.zeros(1, device=device), torch.zeros(1, **i64), torch.zeros(1, **i64))


def verify(target_logits: torch.Tensor, meta: VerifyMetadata, backend: str = "auto",
           resolved: bool = False):
    """rejection_sample over the inputs in `meta`: (output_token_ids, num_accepted)."""
    return rejection_sample(target_logits, meta.draft_probs, meta.draft_token_ids,
                            meta.cu_num_draft, meta.temperature, meta.seeds, meta.offsets,
                            top_k=meta.top_k, top_p=meta.top_p, backend=backend,
                            max_num_draft=meta.max_num_draft, resolved=resolved)
