"""Forward pass of the Llama family (Llama, Mistral, Qwen2, Qwen3) over a flat, ragged batch
of tokens with a paged KV cache. Weights keep their HF names; q/k/v and gate/up projections
are fused at load time so each layer runs three matmuls plus the output projection."""
from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from batchspec.layers.attention import AttentionMetadata, paged_attention
from batchspec.models.loader import ModelConfig

log = logging.getLogger(__name__)
PREPACK_BATCH_HINT = 8  # rows oneDNN tunes the packed layout for: decode/verify batches


def prepack_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights can be reordered for oneDNN on this device (CPU, fp32/bf16).
    BATCHSPEC_CPU_PREPACK=0 turns it off."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and os.environ.get("BATCHSPEC_CPU_PREPACK", "1") != "0"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] in oneDNN's blocked layout: the same products as F.linear, with the
    weight read about twice as fast at small batch (weight traffic bounds CPU decoding)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PREPACK_BATCH_HINT)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def _prepack_works(dtype: torch.dtype) -> bool:
    """One product checked against F.linear before a model relies on packed weights."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=g).to(dtype)
        x = torch.randn(5, 32, generator=g).to(dtype)
        with torch.inference_mode():
            got = linear(x, prepack(w)).float()
        return bool(torch.allclose(got, F.linear(x, w).float(), rtol=2e-2, atol=5e-2))
    except Exception as e:  # noqa: BLE001 - any failure means: use F.linear
        log.warning("oneDNN weight prepacking unavailable (%s); using F.linear", e)
        return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    rope_type = s.get("rope_type", s.get("type"))
    if rope_type == "linear":
        return inv_freq / s["factor"]
    # llama3: keep high frequencies, divide low ones by factor, blend in between
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    mid = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(mid, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos/sin [T, 1, D]; rotate_half convention (HF Llama)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype, device):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.scale = cfg.head_dim ** -0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

        def w(name):
            return weights[name].to(device=device, dtype=dtype)

        packed = prepack_available(dtype, device) and _prepack_works(dtype)
        pack = prepack if packed else (lambda t: t)
        self.weights_prepacked = packed
        self.embed = w("model.embed_tokens.weight")
        self.lm_head = pack(self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in
                            weights else w("lm_head.weight"))
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {
                "in_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "qkv": pack(torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"),
                                       w(a + "v_proj.weight")])),
                "qkv_bias": torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"),
                                       w(a + "v_proj.bias")]) if cfg.attention_bias else None,
                "o": pack(w(a + "o_proj.weight")),
                "gate_up": pack(torch.cat([w(p + "mlp.gate_proj.weight"),
                                           w(p + "mlp.up_proj.weight")])),
                "down": pack(w(p + "mlp.down_proj.weight")),
            }
            if cfg.qk_norm:
                layer["q_norm"] = w(a + "q_norm.weight")
                layer["k_norm"] = w(a + "k_norm.weight")
            self.layers.append(layer)
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)   # [max_pos, D]
        self.sin = emb.sin().to(device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_backend: str = "torch", block_size: int = 16) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (after the final norm)."""
        cfg = self.cfg
        T = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)                       # [T, hidden]
        cos = self.cos[positions].unsqueeze(1)                       # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        eps = cfg.rms_norm_eps
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = rms_norm(h, layer["in_norm"], eps)
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, cfg.num_heads, cfg.head_dim)
            k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, layer["q_norm"], eps)
                k = rms_norm(k, layer["k_norm"], eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, attn_backend,
                                block_size, cfg.sliding_window)
            h = h + linear(o.reshape(T, self.q_size), layer["o"])
            x = rms_norm(h, layer["post_norm"], eps)
            gate, up = linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, layer["down"])
        return rms_norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] in fp32."""
        return linear(hidden, self.lm_head).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device):
        """Per layer (k, v), each [num_blocks * block_size, H_kv, D]."""
        shape = (self.cfg.num_layers, 2, num_blocks * block_size, self.cfg.num_kv_heads,
                 self.cfg.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=device)
        return [(cache[i, 0], cache[i, 1]) for i in range(self.cfg.num_layers)]

    def kv_bytes_per_block(self, block_size: int) -> int:
        return (2 * self.cfg.num_layers * block_size * self.cfg.num_kv_heads * self.cfg.head_dim
                * torch.tensor([], dtype=self.dtype).element_size())
