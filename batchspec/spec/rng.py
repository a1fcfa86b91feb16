"""Counter-based random numbers for sampling: Philox-4x32-10 in vectorised torch.

Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3". A draw is a pure function
of its key, so a request's tokens do not depend on which other requests share its batch, and
the torch reference, the C++ twin and the CUDA kernel (kernels/verify_core.h, bit-identical
integer arithmetic) see the same numbers.

Keying of one Philox call (four 32-bit outputs, "words"):
    key     = (seed & 0xffffffff, seed >> 32)
    counter = (index, position, offset & 0xffffffff, (offset >> 32 & 0xffff) | stream << 16)
`seed`/`offset` are a request's, `position` is the token's place in this step's window
(0 = first draft), `index` tells apart the calls of one draw (vocabulary token i uses call
i // 4, word i % 4), and `stream` separates independent uses: offsets must be < 2**48,
streams < 2**16.
"""
from __future__ import annotations

import torch

STREAM_ACCEPT = 0   # verification: one uniform per draft position (accept test)
STREAM_DRAW = 1     # verification: per-token uniforms of the corrected / bonus draw
STREAM_DRAFT = 2    # free for the engine: draft-model sampling

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57          # Philox multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85          # Weyl key increments


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * m for a in [0, 2**32), without overflowing int64."""
    p_lo = (a & 0xFFFF) * m                      # < 2**48
    p_hi = (a >> 16) * m                         # < 2**48
    t = p_lo + ((p_hi & 0xFFFF) << 16)           # a*m = (p_hi >> 16) * 2**32 + t
    return (p_hi >> 16) + (t >> 32), t & _MASK


def philox(counter: list[torch.Tensor], key: list[torch.Tensor]) -> list[torch.Tensor]:
    """Philox-4x32-10 of int64 tensors holding uint32 values (broadcast together)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """uint32 -> fp32 in (0, 1): (2 * (bits >> 9) + 1) / 2**24, exact in fp32."""
    return ((bits >> 9) * 2 + 1).to(torch.float32) * (2.0 ** -24)


def random_bits(seeds, offsets, positions, stream: int, index) -> list[torch.Tensor]:
    """The four uint32 words (int64 tensors) of the Philox call keyed as in the docstring."""
    ts = (seeds, offsets, positions, index)
    dev = next((t.device for t in ts if isinstance(t, torch.Tensor)), torch.device("cpu"))
    seeds, offsets, positions, index = (torch.as_tensor(t, dtype=torch.int64, device=dev)
                                        for t in ts)
    key = [seeds & _MASK, (seeds >> 32) & _MASK]
    counter = [index & _MASK, positions & _MASK, offsets & _MASK,
               ((offsets >> 32) & 0xFFFF) | (stream << 16)]
    shape = torch.broadcast_shapes(*(t.shape for t in counter + key))
    return philox([t.expand(shape) for t in counter], [t.expand(shape) for t in key])


def uniform(seeds, offsets, positions, stream: int = STREAM_ACCEPT, index=0) -> torch.Tensor:
    """One fp32 uniform in (0, 1) per broadcast element: word 0 of the keyed call."""
    return to_uniform(random_bits(seeds, offsets, positions, stream, index)[0])


def uniform_compiled(seeds: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor,
                     stream: int = STREAM_ACCEPT) -> torch.Tensor:
    """`uniform` (the same bits) computed by the compiled CPU op when it is available: the
    torch version costs ~1-2 ms per call in small int64 ops, which would dominate a small
    draft's step."""
    if seeds.device.type == "cpu":
        from batchspec.spec import _build
        if _build.load_error(cuda=False) is None:
            return _build.load(cuda=False).uniform(seeds, offsets, positions, stream, 0)
    return uniform(seeds, offsets, positions, stream)


def token_uniforms(seeds, offsets, positions, vocab_size: int, stream: int = STREAM_DRAW):
    """Per-token uniforms [R, V] for rows keyed by seeds/offsets/positions [R]."""
    col = lambda t: torch.as_tensor(t, dtype=torch.int64).reshape(-1, 1)  # noqa: E731
    calls = torch.arange((vocab_size + 3) // 4, dtype=torch.int64, device=col(seeds).device)
    words = random_bits(col(seeds), col(offsets), col(positions), stream, calls)
    bits = torch.stack(words, dim=-1).flatten(-2)[:, :vocab_size]          # [R, V]
    return to_uniform(bits)


def gumbel_argmax(scaled_logits: torch.Tensor, seeds, offsets, positions,
                  stream: int = STREAM_DRAW) -> torch.Tensor:
    """Sample from softmax(scaled_logits) [R, V] (-inf = excluded) by Gumbel-max.

    argmax_i z_i - log(-log u_i) is distributed as softmax(z); no normalisation needed.
    """
    u = token_uniforms(seeds, offsets, positions, scaled_logits.shape[-1], stream)
    return (scaled_logits.float() - torch.log(-torch.log(u))).argmax(dim=-1)


def race_argmax(weights: torch.Tensor, seeds, offsets, positions,
                stream: int = STREAM_DRAW) -> torch.Tensor:
    """Sample i with probability w_i / sum(w) from weights [R, V] >= 0 (exponential race).

    With E_i = -log u_i ~ Exp(1), argmax_i w_i / E_i picks i with probability w_i / sum(w).
    """
    u = token_uniforms(seeds, offsets, positions, weights.shape[-1], stream)
    score = torch.where(weights > 0, weights / -torch.log(u), -1.0)
    return score.argmax(dim=-1)
