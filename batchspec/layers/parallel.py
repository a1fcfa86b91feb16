"""Tensor parallelism of one model over `size` ranks (Megatron-LM, Shoeybi et al. 2019): which
part of each weight a rank holds, and the two collectives the forward needs.

* column-parallel (q/k/v, gate/up): a rank holds rows of the weight, i.e. some heads or some
  MLP channels, and its outputs stay local;
* row-parallel (o, down): a rank holds the matching columns; each rank's product is a partial
  sum of the full output, added up by one all-reduce per projection;
* vocab-parallel embedding and LM head: a rank holds a contiguous range of ceil(V / size)
  token rows (the last range padded with zero rows). The embedding of a token outside a
  rank's range is zero there, so one all-reduce completes it; the head's logits are gathered
  to rank 0, the only rank that samples.

KV heads are split like query heads; where a model has fewer KV heads than ranks, each KV
head is replicated on size / num_kv_heads ranks, each of which holds one of them."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None     # a torch.distributed ProcessGroup (gloo on CPU, NCCL on CUDA)

    def part(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n items split evenly (n % size == 0)."""
        assert n % self.size == 0, (n, self.size)
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step

    def vocab_part(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, stop, padded rows) of this rank's vocabulary range; stop - start may be
        below the padded row count on the last rank."""
        rows = -(-vocab_size // self.size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows

    def head_part(self, num_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        """(first query head, query heads, first KV head, KV heads) held by this rank. Query
        head h reads KV head h // (num_heads // num_kv_heads) on every rank."""
        q0, q1 = self.part(num_heads)
        if num_kv_heads >= self.size:
            kv0, kv1 = self.part(num_kv_heads)
            return q0, q1 - q0, kv0, kv1 - kv0
        return q0, q1 - q0, self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def gather_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's x concatenated along the last dim; other ranks: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.gather([parts], [x]).wait()
            return torch.cat(parts, dim=-1)
        self.group.gather([], [x]).wait()
        return None


SINGLE = TensorParallel()   # one rank: the whole model, no collectives


def check_shardable(num_heads: int, num_kv_heads: int, intermediate_size: int,
                    size: int) -> None:
    """Raise ValueError naming what a model lacks for `size` ranks."""
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's "
                         f"{num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} and the model's {num_kv_heads} KV "
                         f"heads must divide one another")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's MLP width "
                         f"{intermediate_size}")
