"""ModelRunner: owns one model's weights and paged KV cache on a device, turns ragged rows of
tokens into batch tensors and runs the forward pass. Used for the target and each draft; a
tensor-parallel target runs one per rank (batchspec.engine.distributed)."""
from __future__ import annotations

import copy
import logging

import torch

from batchspec.layers.attention import (
    DECODE_MAX_Q,
    build_metadata,
    cpu_attention_kernel,
    flash_available,
)
from batchspec.layers.parallel import SINGLE, TensorParallel
from batchspec.models.llama import LlamaForCausalLM
from batchspec.models.loader import Checkpoint, read_config
from batchspec.spec.rng import STREAM_DRAFT

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, path: str, device: str, dtype: str, attention_backend: str = "torch",
                 tp: TensorParallel = SINGLE, head_rows: torch.Tensor | None = None):
        self.path = path
        self.device = torch.device(device)
        self.cfg = read_config(path)
        weights = Checkpoint(path)
        # the parameters a step computes with (the cost ratio's, Engine.cost_ratio): the
        # checkpoint's, a tied output layer once, less the output layer's rows that a
        # draft's vocabulary leaves out
        self.num_params = weights.num_params(
            skip=("lm_head.weight",) if self.cfg.tie_word_embeddings else ())
        if head_rows is not None:
            self.num_params -= self._rows_left_out(head_rows)
        self.model = LlamaForCausalLM(self.cfg, weights, DTYPES[dtype], self.device, tp,
                                      head_rows)
        del weights
        if attention_backend == "flash" and not flash_available():
            raise RuntimeError("attention_backend='flash' needs CUDA and the flash-attn package")
        self.attention_backend = attention_backend
        self.kv_caches = None
        self.block_size = 16
        self._steps = False   # (op, weights, dims, caches) of draft_steps, or False: not here

    def _rows_left_out(self, head_rows: torch.Tensor) -> int:
        """Parameters of the output layer's rows that a draft's vocabulary leaves out."""
        return (self.cfg.vocab_size - head_rows.numel()) * self.cfg.hidden_size

    def _head_weight(self) -> torch.Tensor:
        """The whole output layer [vocab, hidden]: the embedding where tied, else read from
        the checkpoint."""
        weights = None if self.cfg.tie_word_embeddings else Checkpoint(self.path)
        w = self.model.embed if weights is None or "lm_head.weight" not in weights else \
            weights.get("lm_head.weight")
        return w[:self.cfg.vocab_size]

    def use_int8_head(self) -> bool:
        """A draft's output layer in int8 (LlamaForCausalLM.use_int8_head); whether it
        took. An untied layer is read from the checkpoint only if it does."""
        def head() -> torch.Tensor:
            w = self._head_weight()
            return w if self.model.head_rows is None else w[self.model.head_rows]
        took = self.model.use_int8_head(head)
        if self.kv_caches is not None:
            self._find_draft_steps()
        return took

    def scoring_only(self, head_rows: torch.Tensor) -> ModelRunner:
        """This draft's runner with an output layer that scores only head_rows (its
        vocabulary; LlamaForCausalLM.scoring_only): the weights and the KV cache are this
        runner's, shared, so a row may draft through either; the layer is in int8 where
        this runner's is. Made once the KV cache exists."""
        assert self.kv_caches is not None, "allocate_kv_cache first"
        runner = copy.copy(self)
        runner.model = self.model.scoring_only(head_rows, self._head_weight())
        runner.num_params = self.num_params - self._rows_left_out(head_rows)
        if self.model.int8_head is not None:
            runner.use_int8_head()          # (finds its draft steps)
        else:
            runner._find_draft_steps()
        return runner

    @property
    def steps_in_one_call(self) -> bool:
        """Whether draft_steps runs for this model here."""
        return bool(self._steps)

    def draft_steps(self, feeds: list[list[int]], positions: list[int],
                    block_tables: list[list[int]], steps: list[int], first_step: int = 0,
                    sampling: tuple[list[float], list[int], list[int], list[int],
                                    list[float]] | None = None,
                    into: tuple[torch.Tensor, list[int]] | None = None
                    ) -> tuple[list[list[int]], list[torch.Tensor] | None] | None:
        """A draft's steps in one C++ call (kernels/draft_steps_cpu.cpp): row i feeds
        feeds[i] (1 to DECODE_MAX_Q tokens) from positions[i], then the token drawn from its
        last logits, for steps[i] >= 1 forwards. sampling: each row's temperature, seed and
        output tokens so far (the draw's key, with first_step + step), top-k (at most V; 0:
        off) and top-p (greedy rows take the argmax; None: all greedy). Returns each row's
        steps[i] tokens and, when sampling, its q [steps[i], V] (a greedy row's unset):
        DraftModelProposer.propose's tokens and q, bit for bit. The rows' q are views of one
        tensor, each row's right after the one before (so that verification reads the q of
        rows taken in order without a copy: Engine._verify_metadata), or, with `into`
        (buffer [N, V] fp32, each row's first row in it), of the buffer from those rows on.
        None where the op does not cover this model (LlamaForCausalLM.draft_steps_weights),
        device or rows: the caller then steps with `forward`."""
        if not self._steps or any(len(f) > DECODE_MAX_Q for f in feeds):
            return None
        op, weights, dims, caches = self._steps
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [-1] * (width - len(t)) for t in block_tables],
                              dtype=torch.long)   # (-1: past a row's table, checked)
        longs = torch.tensor([t for f in feeds for t in f] + [len(f) for f in feeds] +
                             positions + steps, dtype=torch.long)
        T, R = longs.shape[0] - 3 * len(feeds), len(feeds)
        temps = seeds = offsets = top_k = top_p = None
        if sampling is not None:   # as the step-by-step loop makes them (fp32 temperatures)
            temps = torch.tensor(sampling[0])
            seeds, offsets = (torch.tensor(v, dtype=torch.long) for v in sampling[1:3])
            top_k = torch.tensor(sampling[3]) if any(sampling[3]) else None
            top_p = torch.tensor(sampling[4]) if any(p < 1.0 for p in sampling[4]) else None
        q_out, q_rows = (into[0], torch.tensor(into[1], dtype=torch.long)) \
            if into is not None and sampling is not None else (None, None)
        tokens, q = op(weights, dims, self.model.cfg.rms_norm_eps, self.model.scale,
                       self.block_size, caches, longs[:T], longs[T:T + R],
                       longs[T + R:T + 2 * R], tables, longs[T + 2 * R:], temps, seeds,
                       offsets, top_k, top_p, STREAM_DRAFT, first_step, q_out, q_rows)
        rows = [row[:n] for row, n in zip(tokens.tolist(), steps)]
        if sampling is None:
            return rows, None
        if q_out is not None:
            return rows, [q[f:f + n] for f, n in zip(into[1], steps)]
        return rows, list(q.split(steps))

    def _find_draft_steps(self) -> None:
        """Whether draft_steps runs here (read once the KV cache exists, environment
        included)."""
        self._steps = False
        weights = self.model.draft_steps_weights()
        if weights is None or self.attention_backend != "torch" or \
                cpu_attention_kernel() is None:
            return
        try:
            from batchspec.spec._build import load
            op = load(False).draft_steps
        except Exception as e:  # noqa: BLE001 - no compiler: forward
            log.warning("C++ draft steps unavailable (%s); using the forward", e)
            return
        caches = [t for pair in self.kv_caches for t in pair]
        self._steps = (op, weights, self.model.draft_step_dims(), caches)

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          prefault: bool = False) -> None:
        self.block_size = block_size
        self.kv_caches = self.model.allocate_kv_cache(num_blocks, block_size, self.device,
                                                      prefault)
        self._find_draft_steps()

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_bytes_per_block(block_size)

    def forward(self, token_rows: list[list[int]], num_computed: list[int],
                block_tables: list[list[int]], num_logits: list[int],
                float_logits: bool = True) -> torch.Tensor:
        """Run rows of new tokens; row i starts at position num_computed[i]. Returns logits
        [sum(num_logits), V] for the last num_logits[i] tokens of each row: fp32, or with
        float_logits=False in the dtype the output layer makes them (the same values: bf16
        logits are bf16 numbers either way), for a reader that converts as it reads
        (verification)."""
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
        if len(idx) < hidden.shape[0]:
            hidden = hidden[torch.tensor(idx, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden, float_logits)

    closed = False   # a tensor-parallel runner closes for good on a failed call

    def close(self) -> None:
        """Release what outlives the object's references (nothing here; see
        distributed.TensorParallelRunner)."""
