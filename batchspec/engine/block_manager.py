"""Paged KV cache bookkeeping: fixed-size blocks, one block table per sequence, and prefix
caching (automatic sharing of the KV of identical prompt prefixes, as in vLLM).

The target and every draft model keep their own KV tensors with the same number of blocks,
indexed by the same block table, so one BlockManager serves all of them. Plain Python.

Prefix caching. A full block of committed tokens is named by a hash chain,
h_i = H(h_{i-1}, tokens of block i), so equal hashes mean equal prefixes up to the end of
the block. Once the target has computed a full block, the block is registered under its hash
(`cache_blocks`); a sequence admitted later whose leading blocks hash the same takes those
blocks (reference count + 1) instead of computing them. A released block whose count drops
to 0 keeps its content and its hash in an LRU of cached blocks: it can still be hit, and is
reused (evicted, oldest first) only when no never-cached free block is left.

Rows of a templated job arrive together; computing their shared prefix once per row of the
first batch would waste most of what caching saves. So the prompt blocks an admitted sequence
is about to compute are announced (`pending`), and the scheduler holds back a sequence whose
next uncached block is announced until it is registered, one step later (as SGLang does
within a batch).

A block's target KV is valid once registered; each draft model's KV in it is valid only if
that draft has computed it, so a block also carries the set of draft caches that hold it.
A sequence that hits blocks its draft has not computed gets the target KV from the cache and
computes the draft's (same tokens, same positions, so any other writer writes the same)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from batchspec.engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """H(parent hash, the block's token ids): 128-bit BLAKE2b, so collisions are not a
    practical concern."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> 0 first
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks     # set while registered
        self.draft_caches: list[set[str]] = [set() for _ in range(num_blocks)]
        self.hash_to_block: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()    # cached, count 0; LRU first
        self.pending: dict[bytes, int] = {}   # hash -> admitted sequences computing that block

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached free blocks plus evictable ones."""
        return len(self.free_block_ids) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of seq's first num_blocks full blocks (extended as needed)."""
        bs, h = self.block_size, seq.block_hashes
        while len(h) < num_blocks:
            i = len(h)
            h.append(block_hash(h[-1] if h else b"", seq.token_ids[i * bs:(i + 1) * bs]))
        return h[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks, taken as long as they match. The
        last token is never among them: its logits are needed, so it must be computed."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self._hashes(seq, (len(seq) - 1) // self.block_size):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def is_pending(self, seq: Sequence, num_cached: int) -> bool:
        """Whether seq's first block past its `num_cached` cached ones is being computed by an
        admitted sequence (match_prefix has hashed it)."""
        h = seq.block_hashes
        return num_cached < min(len(h), (len(seq) - 1) // self.block_size) and \
            h[num_cached] in self.pending

    def _announce(self, seq: Sequence) -> None:
        """Announce the full prompt blocks seq is about to compute."""
        end = (len(seq) - 1) // self.block_size
        for h in self._hashes(seq, end)[seq.num_cached_blocks:]:
            self.pending[h] = self.pending.get(h, 0) + 1
        seq.num_announced_blocks = end

    def _unannounce(self, seq: Sequence, start: int, end: int) -> None:
        for h in seq.block_hashes[start:end]:
            if self.pending[h] == 1:
                del self.pending[h]
            else:
                self.pending[h] -= 1

    def num_draft_hits(self, cached: list[int], draft_cache: str | None) -> int:
        """How many of the leading blocks of `cached` hold valid KV of draft `draft_cache`."""
        n = 0
        while draft_cache is not None and n < len(cached) and \
                draft_cache in self.draft_caches[cached[n]]:
            n += 1
        return n

    def cache_blocks(self, seq: Sequence, num_target_tokens: int, num_draft_tokens: int) -> None:
        """Register seq's full blocks of committed tokens: those within the first
        num_target_tokens (KV in the target cache) under their hash, and mark those within the
        first num_draft_tokens as holding the KV of seq's draft cache. A block whose hash is
        already registered under another block (computed concurrently) stays private."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = min(num_target_tokens, len(seq)) // bs
        if n_full > seq.num_cached_blocks:
            for i, h in enumerate(self._hashes(seq, n_full)[seq.num_cached_blocks:],
                                  seq.num_cached_blocks):
                block_id = seq.block_table[i]
                if h not in self.hash_to_block:
                    self.hash_to_block[h] = block_id
                    self.hashes[block_id] = h
            self._unannounce(seq, seq.num_cached_blocks, min(n_full, seq.num_announced_blocks))
            seq.num_cached_blocks = n_full
        key, spec = seq.spec.draft_cache, seq.spec
        n_draft = min(num_draft_tokens // bs, n_full)
        if key is not None and n_draft > spec.num_draft_cached_blocks:
            for block_id in seq.block_table[spec.num_draft_cached_blocks:n_draft]:
                if self.hashes[block_id] is not None:
                    self.draft_caches[block_id].add(key)
            spec.num_draft_cached_blocks = n_draft

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no sequence holds (they become plain free blocks)."""
        while self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            self._uncache(block_id)
            self.free_block_ids.append(block_id)

    def _uncache(self, block_id: int) -> None:
        del self.hash_to_block[self.hashes[block_id]]
        self.hashes[block_id] = None
        self.draft_caches[block_id].clear()

    # ---- allocation --------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> bool:
        """Whether seq's table (plus the cached blocks it is about to take) can grow to hold
        `num_tokens` tokens."""
        extra = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached)
        taken = sum(1 for b in cached if self.ref_counts[b] == 0)  # leave the evictable pool
        return extra <= self.num_free_blocks - taken

    def take_cached(self, seq: Sequence, cached: list[int]) -> None:
        """Start seq's (empty) block table with cached blocks from match_prefix."""
        assert not seq.block_table
        for block_id in cached:
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_cached_blocks = len(cached)
        seq.spec.num_draft_cached_blocks = self.num_draft_hits(cached, seq.spec.draft_cache)
        if self.enable_prefix_caching:
            self._announce(seq)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold `num_tokens` tokens (never shrinks)."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError("out of KV cache blocks")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        else:  # evict the least recently released cached block
            block_id, _ = self.evictable.popitem(last=False)
            self._uncache(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            if self.hashes[block_id] is not None:
                self.evictable[block_id] = None
            else:
                self.free_block_ids.append(block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of seq beyond those holding its first `num_tokens` tokens
        (never a registered block: those hold committed tokens only)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks; the last ones go first into the LRU, so that a prefix
        outlives its tails."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        self._unannounce(seq, seq.num_cached_blocks, seq.num_announced_blocks)
        seq.num_cached_blocks = seq.num_announced_blocks = 0
        seq.spec.num_draft_cached_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + \
            position % self.block_size
