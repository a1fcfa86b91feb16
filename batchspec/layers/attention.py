"""Attention over the paged KV cache.

KV layout per layer: [num_blocks * block_size, num_kv_heads, head_dim] (a flat view of
[num_blocks, block_size, H_kv, D]); a token at position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size.

Backends:
- `torch`: SDPA. Short rows (decodes and verification windows, q_len <= DECODE_MAX_Q) run as
  one padded batch gathered from the cache; longer rows (prefill chunks) run one by one, and a
  prefill with no cached context attends to its own keys directly. On CPU the C++ kernel
  (kernels/paged_attention_cpu.cpp) takes the short rows instead, and every row of up to
  CPU_KERNEL_MAX_Q new tokens with them.
- `flash`: flash-attn `flash_attn_varlen_func` with block tables (CUDA, when installed).
Both see the same AttentionMetadata, built once per forward and shared by all layers."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DECODE_MAX_Q = 16
# On CPU with the C++ kernel, rows of up to this many new tokens run in it too (a new row's
# prompt, admitted to a batch of decodes or windows): it walks each row's keys once through
# the block table, where SDPA one row at a time cost more than the whole batch's windows
# (docs/benchmarks.md). Longer rows (long prompts, prefill chunks) take SDPA.
CPU_KERNEL_MAX_Q = 128
log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                 # [T] long: cache slot of each new token
    # padded batch of short rows
    dec_token_idx: torch.Tensor | None = None  # [Bd * maxq] long: flat token index (pad: 0)
    dec_valid: torch.Tensor | None = None      # [Bd * maxq] bool
    dec_blocks: torch.Tensor | None = None     # [Bd, nblk] long: block ids (pad: 0)
    dec_mask: torch.Tensor | None = None       # [Bd, 1, maxq, nblk * block_size] bool
    dec_shape: tuple[int, int, int] = (0, 0, 0)  # Bd, maxq, nblk * block_size
    dec_is_whole_batch: bool = False           # every row is one decode token, in order
    dec_rows: torch.Tensor | list | None = None  # [Bd, 3] long: first token, q_len, kv_len
                                               # (a list until the CPU kernel needs it)
    # long rows: (token_start, q_len, ctx_len, slots [ctx] or None if no cached context)
    prefill_rows: list = field(default_factory=list)
    prefill_masks: list = field(default_factory=list)
    # flash-attn varlen inputs
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0


def build_metadata(rows, block_tables: list[list[int]], block_size: int, device,
                   sliding_window: int | None = None, backend: str = "torch"):
    """rows: list of (num_computed, q_len) per sequence, in the order their tokens appear in
    the flat batch; block_tables: each sequence's block ids. Index arithmetic is vectorised
    on the host, then moved to `device` once."""
    kernel = backend == "torch" and sliding_window is None and \
        torch.device(device).type == "cpu" and bool(_load_cpu_op())
    short = CPU_KERNEL_MAX_Q if kernel else DECODE_MAX_Q
    if backend == "torch" and sliding_window is None and all(q <= short for _, q in rows):
        return _short_rows_metadata(rows, block_tables, block_size, device, kernel)
    R = len(rows)
    n = torch.tensor([r[0] for r in rows], dtype=torch.long)
    qlen = torch.tensor([r[1] for r in rows], dtype=torch.long)
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
    starts = torch.cumsum(qlen, 0) - qlen
    T = int(qlen.sum())
    row_of = torch.repeat_interleave(torch.arange(R), qlen)                     # [T]
    pos = torch.arange(T) - starts[row_of] + n[row_of]                          # [T]
    slot_mapping = tables[row_of, pos // block_size] * block_size + pos % block_size
    meta = AttentionMetadata(slot_mapping=slot_mapping.to(device))
    if backend == "flash":
        return _flash_metadata(meta, qlen, n + qlen, tables, device)

    def ctx_slots(rows_idx, maxctx):  # [len(rows_idx), maxctx] slots of positions 0..maxctx-1
        p = torch.arange(maxctx)
        blk = (p // block_size).clamp(max=width - 1)
        return tables[rows_idx][:, blk] * block_size + p % block_size

    is_dec = qlen <= short
    dec = torch.nonzero(is_dec).flatten()
    if len(dec):
        dn, dq = n[dec], qlen[dec]
        maxq = int(dq.max())
        nblk = -(-int((dn + dq).max()) // block_size)
        maxctx = nblk * block_size  # whole blocks are gathered; the mask hides the tail
        j = torch.arange(maxq)
        valid = j[None, :] < dq[:, None]                                        # [Bd, maxq]
        tok = torch.where(valid, starts[dec][:, None] + j[None, :], 0)
        if not kernel:   # (the C++ kernel masks by position itself)
            qpos = torch.where(valid, dn[:, None] + j[None, :], -1)[:, None, :, None]
            kpos = torch.arange(maxctx)[None, None, None, :]
            mask = (kpos <= qpos)
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            mask |= (qpos < 0) & (kpos == 0)  # padded query rows attend somewhere (ignored)
            meta.dec_mask = mask.to(device)
        meta.dec_token_idx = tok.flatten().to(device)
        meta.dec_valid = valid.flatten().to(device)
        meta.dec_blocks = tables[dec][:, :nblk].contiguous().to(device)
        if sliding_window is None:  # the C++ kernel attends to every earlier key
            meta.dec_rows = torch.stack([starts[dec], dq, dn + dq], dim=1).to(device)
        meta.dec_is_whole_batch = maxq == 1 and len(dec) == R
        meta.dec_shape = (len(dec), maxq, maxctx)
    for i in torch.nonzero(~is_dec).flatten().tolist():
        ni, qi = int(n[i]), int(qlen[i])
        use_causal = ni == 0 and (sliding_window is None or qi <= sliding_window)
        slots = None if use_causal else ctx_slots(torch.tensor([i]), ni + qi)[0].to(device)
        meta.prefill_rows.append((int(starts[i]), qi, ni + qi, slots))
        mask = None
        if not use_causal:
            qp = torch.arange(ni, ni + qi)[:, None]
            kp = torch.arange(ni + qi)[None, :]
            mask = kp <= qp
            if sliding_window is not None:
                mask &= kp > qp - sliding_window
            mask = mask.to(device)
        meta.prefill_masks.append(mask)
    return meta


def _short_rows_metadata(rows, block_tables, block_size, device, kernel):
    """Fast path when every row is short (decodes, verification windows, draft steps, and
    with the C++ kernel (`kernel`) prompts of up to CPU_KERNEL_MAX_Q tokens): plain list
    arithmetic instead of tensor index ops, whose per-op cost dominates at small batch. The
    kernel reads rows, blocks and slots only: the padded batch SDPA needs is not built."""
    maxq = max(q for _, q in rows)
    nblk = -(-max(n + q for n, q in rows) // block_size)
    slots = [t[p // block_size] * block_size + p % block_size
             for (n, q), t in zip(rows, block_tables) for p in range(n, n + q)]
    blocks = [t[:nblk] + [0] * (nblk - min(len(t), nblk)) for t in block_tables]
    whole = all(q == maxq for _, q in rows)   # no padding: the flat batch is [B, maxq]
    firsts, start = [], 0
    for _, q in rows:
        firsts.append(start)
        start += q
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
        dec_blocks=torch.tensor(blocks, dtype=torch.long).to(device),
        dec_shape=(len(rows), maxq, nblk * block_size), dec_is_whole_batch=whole,
        dec_rows=[[f, q, n + q] for f, (n, q) in zip(firsts, rows)])
    if kernel:   # (the C++ kernel masks by position itself)
        meta.dec_token_idx = torch.empty(0, dtype=torch.long)
        return meta
    if not whole:
        starts, tok, valid = 0, [], []
        for _, q in rows:
            tok += [starts + j for j in range(q)] + [0] * (maxq - q)
            valid += [True] * q + [False] * (maxq - q)
            starts += q
        meta.dec_token_idx = torch.tensor(tok, dtype=torch.long).to(device)
        meta.dec_valid = torch.tensor(valid).to(device)
    else:
        meta.dec_token_idx = torch.empty(0, dtype=torch.long)
    qpos = torch.tensor([[n + j if j < q else -1 for j in range(maxq)] for n, q in rows])
    kpos = torch.arange(nblk * block_size)[None, None, :]
    mask = kpos <= qpos[:, :, None]                                   # [B, maxq, maxctx]
    if not whole:
        mask |= (qpos < 0)[:, :, None] & (kpos == 0)  # padded query rows attend somewhere
    meta.dec_mask = mask[:, None].to(device)
    return meta


def _flash_metadata(meta, qlen, kvlen, tables, device):
    meta.cu_seqlens_q = F.pad(torch.cumsum(qlen, 0), (1, 0)).to(torch.int32).to(device)
    meta.cu_seqlens_k = F.pad(torch.cumsum(kvlen, 0), (1, 0)).to(torch.int32).to(device)
    meta.block_tables = tables.to(torch.int32).to(device)
    meta.max_q = int(qlen.max())
    meta.max_k = int(kvlen.max())
    return meta


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    backend: str = "torch", block_size: int = 16, sliding_window=None):
    """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_slots, Hkv, D]. Writes k/v into the cache
    and returns attention output [T, Hq, D]."""
    if k_cache.device.type == "cpu" and _load_cpu_op():   # the C++ copies (kv_write.h)
        _cpu_write(k_cache, v_cache, k, v, meta.slot_mapping)
    else:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    if backend == "flash":
        return _flash_attention(q, k_cache, v_cache, meta, scale, block_size, sliding_window)
    out = torch.empty_like(q)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if meta.dec_token_idx is not None and (op := _cpu_kernel(q, meta)) is not None:
        op(q.contiguous(), k_cache, v_cache, meta.dec_blocks, meta.dec_rows, scale, block_size,
           out)
    elif meta.dec_token_idx is not None:
        B, maxq, maxctx = meta.dec_shape
        whole = meta.dec_is_whole_batch
        qd = (q if whole else q.index_select(0, meta.dec_token_idx))
        qd = qd.view(B, maxq, Hq, D).transpose(1, 2)
        # gather whole blocks: [num_blocks, block_size * H * D] rows, one copy per block
        flat = meta.dec_blocks.view(-1)
        kd = k_cache.view(-1, block_size * Hkv * D).index_select(0, flat)
        vd = v_cache.view(-1, block_size * Hkv * D).index_select(0, flat)
        kd = kd.view(B, maxctx, Hkv, D).transpose(1, 2)
        vd = vd.view(B, maxctx, Hkv, D).transpose(1, 2)
        if q.device.type == "cpu" and q.dtype != torch.float32 and B > 1:
            od = _grouped_attention(qd, kd, vd, meta.dec_mask, scale)
        else:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.dec_mask,
                                                scale=scale, enable_gqa=Hq != Hkv)
        od = od.transpose(1, 2).reshape(B * maxq, Hq, D)
        if whole:
            return od
        out[meta.dec_token_idx[meta.dec_valid]] = od[meta.dec_valid]
    for (start, qlen, _ctx, slots), mask in zip(meta.prefill_rows, meta.prefill_masks):
        qp = q[start:start + qlen].transpose(0, 1).unsqueeze(0)       # [1, Hq, q, D]
        if slots is None:
            kp = k[start:start + qlen].transpose(0, 1).unsqueeze(0)
            vp = v[start:start + qlen].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                               enable_gqa=Hq != Hkv)
        else:
            kp = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            vp = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                               enable_gqa=Hq != Hkv)
        out[start:start + qlen] = o[0].transpose(0, 1)
    return out


_cpu_op = None
_cpu_write = None


def _cpu_kernel(q, meta):
    """The C++ paged attention (kernels/paged_attention_cpu.cpp) for the short rows on CPU:
    measured as fast as gather + SDPA at batch size 1 and up to 4x faster at larger batches
    and contexts, for decodes and verification windows alike (docs/benchmarks.md). None:
    gather + SDPA (no compiler; BATCHSPEC_CPU_ATTENTION=sdpa)."""
    if q.device.type != "cpu" or meta.dec_rows is None or not _load_cpu_op():
        return None
    if isinstance(meta.dec_rows, list):  # once per forward, for all layers
        meta.dec_rows = torch.tensor(meta.dec_rows, dtype=torch.long)
    return _cpu_op


def cpu_attention_kernel():
    """The C++ paged attention op short rows use on CPU, or None (gather + SDPA)."""
    return _load_cpu_op() or None


def _load_cpu_op():
    """The kernel's op, built on first use; False where it cannot be (gather + SDPA then).
    With it comes the op that writes a forward's keys and values into the cache
    (_cpu_write)."""
    global _cpu_op, _cpu_write
    if _cpu_op is None:
        _cpu_op = False
        if os.environ.get("BATCHSPEC_CPU_ATTENTION", "kernel") != "sdpa":
            try:
                from batchspec.spec._build import load
                ops = load(False)
                _cpu_op, _cpu_write = ops.paged_decode_attention, ops.write_kv_
            except Exception as e:  # noqa: BLE001 - no compiler: gather + SDPA
                log.warning("CPU paged attention kernel unavailable (%s); using SDPA", e)
    return _cpu_op


def _grouped_attention(q, k, v, mask, scale):
    """Attention as two batched matmuls, the query heads of each KV head stacked as rows:
    q [B, Hq, q, D], k/v [B, Hkv, ctx, D], mask [B, 1, q, ctx] -> [B, Hq, q, D]. Used for
    bf16/fp16 batches on CPU, where SDPA's kernel is several times slower than this for short
    queries over many rows (docs/benchmarks.md); scores and softmax are fp32."""
    B, Hq, nq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * nq, D)       # query head h reads kv head h // G
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    scores.masked_fill_(~mask.repeat(1, 1, G, 1), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
    return out.view(B, Hq, nq, D)


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _flash_attention(q, k_cache, v_cache, meta, scale, block_size, sliding_window):
    from flash_attn import flash_attn_varlen_func
    nb = k_cache.shape[0] // block_size
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return flash_attn_varlen_func(
        q, k_cache.view(nb, block_size, *k_cache.shape[1:]),
        v_cache.view(nb, block_size, *v_cache.shape[1:]),
        cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_k=meta.max_k, softmax_scale=scale, causal=True, window_size=window,
        block_table=meta.block_tables)
