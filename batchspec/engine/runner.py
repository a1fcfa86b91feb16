"""ModelRunner: owns one model's weights and paged KV cache on a device, turns ragged rows of
tokens into batch tensors and runs the forward pass. Used for the target and each draft; a
tensor-parallel target runs one per rank (batchspec.engine.distributed)."""
from __future__ import annotations

import torch

from batchspec.layers.attention import build_metadata, flash_available
from batchspec.layers.parallel import SINGLE, TensorParallel
from batchspec.models.llama import LlamaForCausalLM
from batchspec.models.loader import Checkpoint, read_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, path: str, device: str, dtype: str, attention_backend: str = "torch",
                 tp: TensorParallel = SINGLE):
        self.path = path
        self.device = torch.device(device)
        self.cfg = read_config(path)
        weights = Checkpoint(path)
        self.num_params = weights.num_params(
            skip=("lm_head.weight",) if self.cfg.tie_word_embeddings else ())
        self.model = LlamaForCausalLM(self.cfg, weights, DTYPES[dtype], self.device, tp)
        del weights
        if attention_backend == "flash" and not flash_available():
            raise RuntimeError("attention_backend='flash' needs CUDA and the flash-attn package")
        self.attention_backend = attention_backend
        self.kv_caches = None
        self.block_size = 16

    def use_int8_head(self) -> bool:
        """A draft's output layer in int8 (LlamaForCausalLM.use_int8_head); whether it
        took. An untied layer is read from the checkpoint only if it does."""
        def head() -> torch.Tensor:
            weights = None if self.cfg.tie_word_embeddings else Checkpoint(self.path)
            w = self.model.embed if weights is None or "lm_head.weight" not in weights else \
                weights.get("lm_head.weight")
            return w[:self.cfg.vocab_size]
        return self.model.use_int8_head(head)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_caches = self.model.allocate_kv_cache(num_blocks, block_size, self.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_bytes_per_block(block_size)

    def forward(self, token_rows: list[list[int]], num_computed: list[int],
                block_tables: list[list[int]], num_logits: list[int]) -> torch.Tensor:
        """Run rows of new tokens; row i starts at position num_computed[i]. Returns fp32
        logits [sum(num_logits), V] for the last num_logits[i] tokens of each row."""
        assert self.kv_caches is not None, "allocate_kv_cache first"
        qlens = [len(t) for t in token_rows]
        flat = [t for row in token_rows for t in row]
        input_ids = torch.tensor(flat, dtype=torch.long)
        positions = torch.tensor([p for n, q in zip(num_computed, qlens) for p in range(n, n + q)],
                                 dtype=torch.long)
        meta = build_metadata(list(zip(num_computed, qlens)), block_tables, self.block_size,
                              self.device, self.model.cfg.sliding_window,
                              self.attention_backend)
        idx, end = [], 0
        for q, k in zip(qlens, num_logits):
            end += q
            idx.extend(range(end - k, end))
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), meta,
                            self.kv_caches, self.attention_backend, self.block_size)
        if len(idx) == hidden.shape[0]:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(idx, dtype=torch.long,
                                                             device=self.device)])

    closed = False   # a tensor-parallel runner closes for good on a failed call

    def close(self) -> None:
        """Release what outlives the object's references (nothing here; see
        distributed.TensorParallelRunner)."""
