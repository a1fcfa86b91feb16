"""Continuous batching scheduler (plain Python).

Each step: running sequences first (decodes get 1 + lookahead slots, where lookahead is the
number of draft tokens the sequence may verify; unfinished prefills get a chunk), then waiting
sequences are admitted while the token budget, the sequence limit and free KV blocks allow.
When the cache is full the most recently admitted sequence is preempted and later recomputed.
A sequence leaves the batch the moment it finishes.

Admission starts a sequence from its longest cached prefix of full blocks (prefix caching,
see block_manager.py), and each commit offers the sequence's newly completed blocks of
committed tokens to the cache."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchspec.engine.block_manager import BlockManager
from batchspec.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from batchspec.spec.proposer import Proposal


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int      # tokens computed this step, from seq.num_computed_tokens on
    max_drafts: int          # draft tokens this row may append for verification (0: none)
    proposal: Proposal | None = None   # the drafts appended this step (set by the engine)
    source: str | None = None          # the proposer that drafted them (set by the engine)
    # a routed row's lookup drafts it did not take (the lookup's name and drafts): judged
    # against the tokens the row commits (Engine.commit)
    unused: tuple[str, Proposal] | None = None

    @property
    def num_drafts(self) -> int:
        return len(self.proposal.token_ids) if self.proposal is not None else 0

    @property
    def input_token_ids(self) -> list[int]:
        """Tokens the target computes this step: the uncomputed chunk, then the drafts."""
        start = self.seq.num_computed_tokens
        chunk = self.seq.token_ids[start:start + self.num_new_tokens]
        return chunk + self.proposal.token_ids if self.proposal is not None else chunk

    @property
    def is_sampling(self) -> bool:
        """True when this step reaches the end of the sequence, so it emits a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int,
                 lookahead: Callable[[Sequence], int] = lambda seq: 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.version = 0   # changes whenever a sequence joins or leaves `running`
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: bool = True) -> list[ScheduledSeq]:
        """This step's rows. drafts=False: no decode row gets draft slots (a step the
        speculation policy runs plain reserves, and costs, what a plain engine's does)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            max_drafts = 0
            if drafts and seq.num_uncomputed_tokens == 1:
                max_drafts = max(0, min(self.lookahead(seq), budget - 1))
            if not self._reserve(seq, seq.num_computed_tokens + num_new + max_drafts):
                break  # seq itself was preempted; everything after it too
            scheduled.append(ScheduledSeq(seq, num_new, max_drafts))
            budget -= num_new + max_drafts
            i += 1
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(scheduled) == len(self.running)):
            seq = self.waiting[0]
            cached = self.block_manager.match_prefix(seq)
            if self.block_manager.is_pending(seq, len(cached)):
                break  # its next blocks are being computed: admit it once they are cached
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(len(seq) - num_cached, budget)
            if not self.block_manager.can_allocate(seq, num_cached + num_new, cached):
                if not self.running:
                    raise RuntimeError(
                        f"request {seq.request_id} needs more KV blocks than the cache has "
                        f"({self.block_manager.num_blocks} blocks)")
                break
            self.waiting.popleft()
            self._admit(seq, cached)
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
            self.running.append(seq)
            self.version += 1
            scheduled.append(ScheduledSeq(seq, num_new, 0))
            budget -= num_new
        return scheduled

    def _admit(self, seq: Sequence, cached: list[int]) -> None:
        """Move seq to the batch, starting from the KV of its cached prefix blocks."""
        bm = self.block_manager
        bm.take_cached(seq, cached)
        seq.num_computed_tokens = len(cached) * bm.block_size
        seq.spec.num_draft_computed = seq.spec.num_draft_cached_blocks * bm.block_size
        seq.status = Status.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()
            seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for seq to hold num_tokens, preempting from the back of the running list.
        Returns False if seq itself had to be preempted."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's KV and put it back at the front of the queue to be recomputed."""
        self.running.remove(seq)
        self.version += 1
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec.num_draft_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def commit(self, seq: Sequence, num_new_computed: int, new_token_ids: list[int]) -> None:
        """Record the step's result for seq: `num_new_computed` tokens now have valid KV and
        `new_token_ids` are appended. KV of rejected drafts is dropped by keeping only the
        valid count (their slots are overwritten later) and trimming surplus blocks."""
        seq.num_computed_tokens += num_new_computed
        seq.token_ids.extend(new_token_ids)
        if new_token_ids:
            self.block_manager.truncate(seq, len(seq))
        spec = seq.spec
        spec.num_draft_computed = min(spec.num_draft_computed, seq.num_computed_tokens)
        self.block_manager.cache_blocks(seq, seq.num_computed_tokens, spec.num_draft_computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.version += 1
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
