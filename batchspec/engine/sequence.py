"""One request's state inside the engine: its tokens, how many of them have KV in the cache,
its block table (and the hash chain of its full blocks, for prefix caching), and its
speculation bookkeeping. Plain Python, no torch."""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from batchspec.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecState:
    """Speculation bookkeeping of one sequence (feeds its acceptance record)."""
    draft: str | None = None          # name of the draft serving this sequence; None: plain
    source: str | None = None         # the proposer its draft's rounds take (Engine.source_for)
    draft_cache: str | None = None    # key of the draft KV cache it fills (the draft model's
                                      # path); None: no draft model (plain or n-gram)
    num_draft_computed: int = 0       # tokens whose KV is in the draft's cache
    num_draft_cached_blocks: int = 0  # leading blocks whose draft KV is marked in the prefix
                                      # cache (see BlockManager.cache_blocks)
    rounds: int = 0
    drafted_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    round_output_pos: list[int] = field(default_factory=list)
    round_drafted: list[int] = field(default_factory=list)
    round_accepted: list[int] = field(default_factory=list)
    round_source: list[str | None] = field(default_factory=list)  # who drafted each round
    # source -> (accepted, judged) at each depth: a draft at depth d is judged when every
    # draft before it was accepted (the policy's per-request acceptance estimates; counts
    # that decay with each round, policy.REQUEST_DECAY)
    source_depth: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    pool_keys: dict[str, tuple] = field(default_factory=dict)  # source -> the policy's keys
    #                                 of its pooled estimates for this row (_pool_keys)
    skipped_by_confidence: int = 0
    fallback_triggered: bool = False
    window: deque = field(default_factory=deque)  # (drafted, accepted) of recent rounds
    window_drafted: int = 0
    window_accepted: int = 0
    num_accepted: int = 0             # all rounds: accepted drafts ...
    num_rejections: int = 0           # ... and rounds that ended in a rejection


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, domain: str | None = None):
        assert prompt_token_ids, "empty prompt"
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)   # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.domain = domain
        self.status = Status.WAITING
        self.num_computed_tokens = 0              # tokens with KV in the target cache
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []       # hash chain of the full blocks hashed so far
        self.num_cached_blocks = 0                # leading blocks offered to the prefix cache
        self.num_announced_blocks = 0             # ... and those up to here, being computed
        self.num_cached_prompt_tokens = 0         # prompt tokens whose KV came from the cache
        self.finish_reason: str | None = None
        self.stop_text_len: int | None = None     # text cut here when a stop string matched
        self.spec = SpecState()
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None  # admitted to the batch (first time)
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def record_round(self, num_drafted: int, num_accepted: int,
                     source: str | None = None) -> None:
        s = self.spec
        s.rounds += 1
        s.round_source.append(source if num_drafted else None)
        s.round_output_pos.append(self.num_output_tokens)
        s.round_drafted.append(num_drafted)
        s.round_accepted.append(num_accepted)
        while len(s.drafted_per_depth) < num_drafted:
            s.drafted_per_depth.append(0)
            s.accepted_per_depth.append(0)
        for d in range(num_drafted):
            s.drafted_per_depth[d] += 1
            s.accepted_per_depth[d] += d < num_accepted
        s.num_accepted += num_accepted
        s.num_rejections += num_accepted < num_drafted
        if num_drafted:
            s.window.append((num_drafted, num_accepted))
            s.window_drafted += num_drafted
            s.window_accepted += num_accepted

    def rolling_acceptance(self, window: int) -> tuple[int, int]:
        """(drafted, accepted) over the most recent rounds covering >= `window` drafts."""
        s = self.spec
        while s.window and s.window_drafted - s.window[0][0] >= window:
            d, a = s.window.popleft()
            s.window_drafted -= d
            s.window_accepted -= a
        return s.window_drafted, s.window_accepted
