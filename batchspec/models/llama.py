"""Forward pass of the Llama family (Llama, Mistral, Qwen2, Qwen3) over a flat, ragged batch
of tokens with a paged KV cache. Weights keep their HF names; q/k/v and gate/up projections
are fused at load time so each layer runs three matmuls plus the output projection. Under
tensor parallelism each rank holds its shard of every weight and of the KV cache
(batchspec.layers.parallel) and adds one all-reduce after o and after down."""
from __future__ import annotations

import copy
import logging
import math
import mmap
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchspec.layers.attention import AttentionMetadata, paged_attention
from batchspec.layers.parallel import SINGLE, TensorParallel
from batchspec.models.loader import Checkpoint, ModelConfig, weight_shapes

log = logging.getLogger(__name__)
PREPACK_BATCH_HINT = 8  # rows oneDNN tunes the packed layout for: decode/verify batches


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device,
           prefault: bool = False) -> torch.Tensor:
    """torch.zeros(shape), on a CPU in pages of an anonymous mapping, which the OS zero-fills
    as they are first written: a KV cache costs nothing at start-up and counts in the process's
    memory as far as rows have used it (torch.zeros wrote all of it: the demo's 0.6 GB, 0.3-0.5 s
    of a job's start-up on a 2-core CPU, resident in every worker from the start).

    The price is a page fault the first time each page is written, in the step that writes
    it: at 64 rows on the demo target, 48 a step (a 4 KiB block a row every 16 tokens, in 12
    K/V tensors) while rows still take blocks never used, 1 ms of a 5 ms decode step. An engine
    walks its whole cache once before it reuses evicted blocks (never-cached blocks go first),
    so a long-lived worker pays it once; a benchmark would charge it to whichever method first
    writes new pages (prefault: write every page now, as torch.zeros did)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if not count:
        return torch.zeros(shape, dtype=dtype)
    size = count * torch.tensor([], dtype=dtype).element_size()
    # private, as malloc's memory is (a forked process copies on write; Python's default,
    # MAP_SHARED, would let a forked worker write into its parent's cache)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = torch.frombuffer(pages, dtype=dtype, count=count).view(shape)
    return cache.zero_() if prefault else cache


class PackedWeight(NamedTuple):
    """A linear weight packed for kernels/linear_cpu.cpp: bf16 for AMX tiles (or AVX512-BF16's
    pair products, in the same layout), or fp32 for AVX2 (stored in bf16 where its values are
    bf16 numbers)."""
    packed: torch.Tensor
    in_features: int
    out_features: int
    op: Callable


def prepack_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights can be reordered for oneDNN on this device (CPU, fp32/bf16).
    BATCHSPEC_CPU_PREPACK=0 turns it off (and the C++ op's layouts with it)."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and os.environ.get("BATCHSPEC_CPU_PREPACK", "1") != "0"
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] in oneDNN's blocked layout: the same products as F.linear, with the
    weight read about twice as fast at small batch (weight traffic bounds CPU decoding)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PREPACK_BATCH_HINT)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None,
           float_out: bool = False) -> torch.Tensor:
    """x . w^T (+ b) in x's dtype. float_out: the caller wants fp32 (logits); the C++ bf16 op
    then writes its bf16-rounded values as fp32 directly, the others leave the conversion to
    it."""
    if isinstance(w, PackedWeight):
        return w.op(x, w.packed, w.in_features, w.out_features, b, float_out)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def _prepack_works(dtype: torch.dtype, pack: Callable) -> bool:
    """Products checked against F.linear before a model relies on packed weights: of a
    weight in dtype and of one whose values are bf16 numbers (which the AVX2 op stores in
    bf16)."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=g).to(dtype)
        x = torch.randn(21, 40, generator=g).to(dtype)
        with torch.inference_mode():
            return all(bool(torch.allclose(linear(x, pack(v)).float(), F.linear(x, v).float(),
                                           rtol=2e-2, atol=5e-2))
                       for v in (w, w.bfloat16().to(dtype)))
    except Exception as e:  # noqa: BLE001 - any failure means: use F.linear
        log.warning("packed linear weights unavailable (%s); using F.linear", e)
        return False


def weight_packer(dtype: torch.dtype, device: torch.device) -> tuple[str, Callable]:
    """How a model on CPU stores its linear weights, and the function that packs one:
    - "amx": bf16 on CPUs with AMX tiles, the C++ op of kernels/linear_cpu.cpp, several times
      faster than oneDNN at decoding's row counts and the same for a row whatever its batch;
    - "avx512_bf16": bf16 on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later), the
      same op's pair-product path on the tiles' layout: the demo target's forwards 1.8x
      faster than with oneDNN at one row and 1.1x at 32 (benchmarks/bench_attention.py
      --compare linear), with no primitive made per row count (oneDNN's cost on ragged
      steps: see the op), and the same for a row in any batch; on CPUs whose VDPBF16PS is
      the slower (measured at the op's first call: ops.linear_bf16_path), fp32
      multiply-adds on the same layout;
    - "avx2": fp32 on CPUs with AVX2 and FMA, the same op's fp32 path, about 2x faster
      than oneDNN at 1-5 rows and 1.2-1.3x at 32-64, also the same for a row in any batch; a
      weight whose values are all bf16 numbers (a bf16 checkpoint) is stored in bf16 and read
      back exactly, half the bytes (BATCHSPEC_CPU_LINEAR=avx2-fp32 stores fp32);
    - "onednn": oneDNN's blocked layout (bf16 without AMX or AVX512-BF16, or
      BATCHSPEC_CPU_LINEAR=onednn);
    - "none": F.linear (other devices, BATCHSPEC_CPU_PREPACK=0, or neither works).
    BATCHSPEC_CPU_LINEAR=onednn skips the C++ op (benchmarks and tests compare the two)."""
    if not prepack_available(dtype, device):
        return "none", lambda t: t
    choice = os.environ.get("BATCHSPEC_CPU_LINEAR")
    if choice != "onednn":
        compact = choice != "avx2-fp32"
        try:
            from batchspec.spec._build import load
            ops = load(False)
            if dtype != torch.bfloat16:
                layout = "avx2" if ops.linear_f32_available() else None
            else:
                layout = "amx" if ops.linear_amx_available() else \
                    "avx512_bf16" if ops.linear_bf16_available() else None
            if layout is not None:
                def pack_op(t: torch.Tensor) -> PackedWeight:
                    out_features, in_features = t.shape
                    return PackedWeight(ops.pack_linear_weight(t.contiguous(), compact),
                                        in_features, out_features, ops.linear_packed)
                if _prepack_works(dtype, pack_op):
                    return layout, pack_op
        except Exception as e:  # noqa: BLE001 - no compiler: oneDNN
            log.warning("C++ linear layers unavailable (%s); using oneDNN", e)
    if _prepack_works(dtype, prepack):
        return "onednn", prepack
    return "none", lambda t: t


def fused_ops(dtype: torch.dtype, device: torch.device):
    """The C++ elementwise ops of a layer on CPU (kernels/fused_cpu.cpp): RMSNorm with the
    residual add before it, SwiGLU's silu(gate) * up, and RoPE of q and k; or None: other
    devices and dtypes, no compiler, or BATCHSPEC_CPU_FUSED=0. Each does in one pass what is
    5-9 torch ops below, with the same roundings (q/k norms, over heads, and the rotation
    after them stay torch ops)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or \
            os.environ.get("BATCHSPEC_CPU_FUSED", "1") == "0":
        return None
    try:
        from batchspec.spec._build import load
        return load(False)
    except Exception as e:  # noqa: BLE001 - no compiler: the torch ops
        log.warning("fused CPU layer ops unavailable (%s); using torch ops", e)
        return None


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
    def __init__(self, cfg: ModelConfig, weights: Checkpoint, dtype, device,
                 tp: TensorParallel = SINGLE, head_rows: torch.Tensor | None = None):
        """The model's weights on `device`; with tp.size > 1, this rank's shard of them
        (batchspec.layers.parallel says which part each rank holds). head_rows: a draft's
        vocabulary (batchspec.spec.draft_vocab), the only tokens its output layer scores;
        the other logits are -inf (one rank only)."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.tp = tp
        self.scale = cfg.head_dim ** -0.5
        D = cfg.head_dim
        q0, self.num_heads, kv0, self.num_kv_heads = tp.head_part(cfg.num_heads,
                                                                 cfg.num_kv_heads)
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        q_rows, kv_rows = (q0 * D, (q0 + self.num_heads) * D), (kv0 * D, kv0 * D + self.kv_size)
        mlp_rows = tp.part(cfg.intermediate_size)

        weights.check(weight_shapes(cfg, weights))

        def w(name, dim=None, rows=(0, None)):
            return weights.get(name, dim, *rows).to(device=device, dtype=dtype)

        self.weight_layout, pack = weight_packer(dtype, device)
        v0, v1, v_rows = tp.vocab_part(cfg.vocab_size)
        self.vocab_start = v0

        def vocab_rows(name):  # this rank's token rows, padded to v_rows
            t = w(name, 0, (v0, v1))
            return F.pad(t, (0, 0, 0, v_rows - t.shape[0])) if t.shape[0] < v_rows else t

        self.embed = vocab_rows("model.embed_tokens.weight")
        head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in weights \
            else vocab_rows("lm_head.weight")
        self.head_rows = None   # [N] int64 ids the output layer scores, or None: all
        if head_rows is not None:
            assert tp.size == 1, "a draft's vocabulary is for one rank"
            self.head_rows = head_rows.to(device=device, dtype=torch.long)
            head = head[self.head_rows]
        self.lm_head = pack(head)
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = [(a + "q_proj", q_rows), (a + "k_proj", kv_rows), (a + "v_proj", kv_rows)]
            layer = {
                "in_norm": w(p + "input_layernorm.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "qkv": pack(torch.cat([w(n + ".weight", 0, r) for n, r in qkv])),
                "qkv_bias": torch.cat([w(n + ".bias", 0, r) for n, r in qkv])
                if cfg.attention_bias else None,
                "o": pack(w(a + "o_proj.weight", 1, q_rows)),
                # added once, after the all-reduce (Llama with attention_bias has one)
                "o_bias": w(a + "o_proj.bias") if a + "o_proj.bias" in weights else None,
                "gate_up": pack(torch.cat([w(p + "mlp.gate_proj.weight", 0, mlp_rows),
                                           w(p + "mlp.up_proj.weight", 0, mlp_rows)])),
                "down": pack(w(p + "mlp.down_proj.weight", 1, mlp_rows)),
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
        self.fused = fused_ops(dtype, device)
        self.fuse_swiglu_rope = True   # with self.fused: off leaves only RMSNorm fused (benchmarks)
        self.int8_head = None          # (op, packed weight, scales, sums): use_int8_head

    def scoring_only(self, head_rows: torch.Tensor, head: torch.Tensor) -> LlamaForCausalLM:
        """This model with an output layer of head's [vocab, hidden] rows head_rows only (a
        draft's vocabulary); every other weight is this model's own tensor, shared. The
        engine runs a draft's rows that score its list through it and the others through
        this model (per row: EngineConfig.draft_vocab None)."""
        assert self.tp.size == 1 and self.head_rows is None, "one rank, from the whole layer"
        device = self.embed.device
        model = copy.copy(self)
        model.head_rows = head_rows.to(device=device, dtype=torch.long)
        model.lm_head = weight_packer(self.dtype, device)[1](
            head.to(device=device, dtype=self.dtype)[model.head_rows])
        model.int8_head = None
        return model

    def use_int8_head(self, head: Callable[[], torch.Tensor]) -> bool:
        """Compute logits with an int8 copy of the output layer, head() [vocab, hidden]
        (kernels/head_int8_cpu.cpp), instead of the bf16 or fp32 one, which is dropped; for a
        draft model on a CPU with AVX512-VNNI or AVX2: the logits move by the rounding (about
        1% of their range), which a draft may do, since verification judges its drafts by
        the probabilities it used. Every forward uses it, whatever its rows: a row's logits
        are then the same in any batch (its quantization and integer sums are its own), so a
        request's draft, and its sampled tokens, do not depend on the rows it runs with. At
        one row it reads half the bytes of the bf16 layer (12.5 against 34 us for the demo
        drafts, VNNI) or a quarter of the fp32 one (28 against 57 us warm, AVX2); from 8 rows
        on it runs on AMX-INT8 tiles where the CPU has them (the same integer sums), 79
        against 147 us at 32 rows (benchmarks/bench_cpu_ops.py). False (and nothing changes)
        on other devices and CPUs, under tensor parallelism, or with
        BATCHSPEC_CPU_DRAFT_HEAD=bf16 (the layer in the model's dtype)."""
        if self.embed.device.type != "cpu" or self.tp.size > 1 or \
                os.environ.get("BATCHSPEC_CPU_DRAFT_HEAD", "int8") != "int8":
            return False
        try:
            from batchspec.spec._build import load
            ops = load(False)
            if not ops.head_int8_fast():
                return False
            self.int8_head = (ops.head_int8, *ops.pack_head_int8(head()))
        except Exception as e:  # noqa: BLE001 - no compiler: the bf16 layer
            log.warning("int8 output layer unavailable (%s); using bf16", e)
            return False
        self.lm_head = None   # every forward takes the int8 copy
        return True

    def draft_steps_weights(self) -> list[torch.Tensor] | None:
        """The weights of kernels/draft_steps_cpu.cpp's draft_steps, in its order, or
        None where that op does not compute this forward: it covers a model on CPU with
        packed linear weights (AMX, AVX512-BF16, AVX2 or oneDNN), the fused C++ layer ops, no
        q/k norm, no bias, no sliding window and one rank (BATCHSPEC_CPU_DRAFT_STEPS=python
        turns it off)."""
        cfg = self.cfg
        if self.fused is None or not self.fuse_swiglu_rope or \
                self.weight_layout not in ("amx", "avx512_bf16", "avx2", "onednn") or \
                cfg.qk_norm or cfg.attention_bias or cfg.sliding_window is not None or \
                self.tp.size > 1 or any(layer["o_bias"] is not None for layer in self.layers) \
                or os.environ.get("BATCHSPEC_CPU_DRAFT_STEPS", "cpp") == "python":
            return None

        def packed(w):   # what the op multiplies by: the C++ op's buffer, or the mkldnn tensor
            return w.packed if isinstance(w, PackedWeight) else w
        op_head = isinstance(self.lm_head, PackedWeight)
        if self.int8_head is not None:
            head = list(self.int8_head[1:])
        elif self.lm_head is not None and self.head_size == (
                self.lm_head.out_features if op_head else self.lm_head.shape[0]):
            head = [packed(self.lm_head)]
        else:
            return None
        if self.head_rows is not None:
            head.append(self.head_rows)
        weights = [self.embed, self.cos, self.sin, self.final_norm] + head
        for layer in self.layers:
            weights += [layer["in_norm"], layer["post_norm"]] + \
                [packed(layer[name]) for name in ("qkv", "o", "gate_up", "down")]
        return weights

    def draft_step_dims(self) -> list[int]:
        cfg = self.cfg
        return [cfg.num_layers, self.num_heads, self.num_kv_heads, cfg.head_dim,
                cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
                0 if self.int8_head is not None else 1, int(self.head_rows is not None)]

    @property
    def head_size(self) -> int:
        """Logits the output layer computes: the vocabulary, or a draft's part of it."""
        return self.cfg.vocab_size if self.head_rows is None else self.head_rows.numel()

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """A draft vocabulary's logits [n, N] at their ids of the vocabulary, -inf elsewhere:
        every reader (argmax, softmax, filters, draws) then sees tokens it cannot propose as
        probability 0."""
        if self.head_rows is None:
            return logits
        full = logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(1, self.head_rows, logits)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        h = F.embedding(torch.where(mine, local, 0), self.embed)
        return self.tp.all_reduce(h * mine[:, None].to(h.dtype))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_backend: str = "torch", block_size: int = 16) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (after the final norm)."""
        cfg = self.cfg
        T = input_ids.shape[0]
        h = self.embed_tokens(input_ids)                             # [T, hidden]
        fused_act = self.fused is not None and self.fuse_swiglu_rope
        fused_rope = fused_act and not cfg.qk_norm
        if not fused_rope:
            cos = self.cos[positions].unsqueeze(1)                   # [T, 1, D]
            sin = self.sin[positions].unsqueeze(1)
        eps = cfg.rms_norm_eps
        mlp_out = None                                   # the last MLP output, not yet in h
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, x = self._add_norm(h, mlp_out, layer["in_norm"])
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])
            v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, cfg.head_dim)
            if fused_rope:  # one C++ pass; q and k come back contiguous
                q, k = self.fused.rope_qk(qkv, self.cos, self.sin, positions, self.num_heads,
                                          self.num_kv_heads)
            elif cfg.qk_norm:   # this rank's heads
                q = qkv[:, :self.q_size].view(T, self.num_heads, cfg.head_dim)
                k = qkv[:, self.q_size:self.q_size + self.kv_size].view(
                    T, self.num_kv_heads, cfg.head_dim)
                q = apply_rope(rms_norm(q, layer["q_norm"], eps), cos, sin)
                k = apply_rope(rms_norm(k, layer["k_norm"], eps), cos, sin)
            else:  # q and k side by side in qkv: one rotation for both heads' sets
                qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(
                    T, self.num_heads + self.num_kv_heads, cfg.head_dim), cos, sin)
                q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, attn_backend,
                                block_size, cfg.sliding_window)
            o = self.tp.all_reduce(linear(o.reshape(T, self.q_size), layer["o"]))
            h, x = self._add_norm(h, o if layer["o_bias"] is None else o + layer["o_bias"],
                                  layer["post_norm"])
            gate_up = linear(x, layer["gate_up"])
            if fused_act:
                act = self.fused.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            mlp_out = self.tp.all_reduce(linear(act, layer["down"]))
        return self._add_norm(h, mlp_out, self.final_norm)[1]

    def _add_norm(self, h: torch.Tensor, residual: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + residual, its RMSNorm): on CPU one C++ pass that adds in place (self.fused),
        else the torch ops, with the same roundings."""
        eps = self.cfg.rms_norm_eps
        if self.fused is None:
            h = h if residual is None else h + residual
            return h, rms_norm(h, weight, eps)
        if residual is None:
            return h, self.fused.rms_norm(h.contiguous(), weight, eps)
        h = h.contiguous()                 # h is this forward's own tensor: added to in place
        return h, self.fused.add_rms_norm_(h, residual.contiguous(), weight, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, float_logits: bool = True
                       ) -> torch.Tensor | None:
        """hidden [n, hidden] -> logits [n, vocab] (on rank 0; None on the others): fp32, or
        with float_logits=False as the output layer makes them (bf16 where it rounds its
        products to bf16: the same numbers), without an fp32 copy of them (in a verification
        step at 32 rows of the demo, 130 rows of 4,096 logits: 2 MB written, 0.3 ms a step
        in the profile of a job)."""
        if self.int8_head is not None:
            op, packed, scales, sums = self.int8_head
            return self._full_vocab(op(hidden, packed, scales, sums, self.head_size))
        logits = self.tp.gather_first(linear(hidden, self.lm_head, float_out=float_logits))
        if logits is None:
            return None
        logits = logits[:, :self.head_size]
        return self._full_vocab((logits.float() if float_logits else logits).contiguous())

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device,
                          prefault: bool = False):
        """Per layer (k, v), each [num_blocks * block_size, H_kv, D] (this rank's KV heads);
        prefault: see zeroed."""
        shape = (self.cfg.num_layers, 2, num_blocks * block_size, self.num_kv_heads,
                 self.cfg.head_dim)
        cache = zeroed(shape, self.dtype, device, prefault)
        return [(cache[i, 0], cache[i, 1]) for i in range(self.cfg.num_layers)]

    def kv_bytes_per_block(self, block_size: int) -> int:
        return (2 * self.cfg.num_layers * block_size * self.num_kv_heads * self.cfg.head_dim
                * torch.tensor([], dtype=self.dtype).element_size())
