"""Paged KV cache bookkeeping: fixed-size blocks, one block table per sequence.

The target and every draft model keep their own KV tensors with the same number of blocks,
indexed by the same block table, so one BlockManager serves all of them. Plain Python."""
from __future__ import annotations

from batchspec.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> 0 first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq's table can grow to hold `num_tokens` tokens."""
        extra = self.blocks_needed(num_tokens) - len(seq.block_table)
        return extra <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold `num_tokens` tokens (never shrinks)."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > len(self.free_block_ids):
            raise RuntimeError("out of KV cache blocks")
        for _ in range(need):
            seq.block_table.append(self.free_block_ids.pop())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks of seq beyond those holding its first `num_tokens` tokens."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self.free_block_ids.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(reversed(seq.block_table))
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + \
            position % self.block_size
