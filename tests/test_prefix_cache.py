"""Prefix caching bookkeeping (plain Python): the hash chain, reference counts, the LRU of
cached blocks, draft validity, preemption and rollback."""
from batchspec.engine.block_manager import BlockManager, block_hash
from batchspec.engine.scheduler import Scheduler
from batchspec.engine.sequence import Sequence
from batchspec.sampling import SamplingParams

BS = 4


def make_seq(i, prompt, draft_cache=None):
    seq = Sequence(i, str(i), list(prompt), SamplingParams(max_tokens=8), seed=i)
    seq.spec.draft_cache = draft_cache
    return seq


def prefill(sch, seq, first_token=99):
    """Schedule until seq's prompt is computed, then commit its first token."""
    while True:
        row = next(r for r in sch.schedule() if r.seq is seq)
        is_sampling = row.is_sampling
        sch.commit(seq, row.num_new_tokens, [first_token] if is_sampling else [])
        if is_sampling:
            return


def test_hash_chain_names_the_whole_prefix():
    bm = BlockManager(16, BS)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_seq(1, [0, 2, 3, 4, 5, 6, 7, 8, 9])   # first block differs
    ha, hb = bm._hashes(a, 2), bm._hashes(b, 2)
    assert ha[0] == block_hash(b"", [1, 2, 3, 4])
    assert ha[1] == block_hash(ha[0], [5, 6, 7, 8])
    assert ha[0] != hb[0] and ha[1] != hb[1]        # same tokens, other parent
    assert a.block_hashes == ha                      # kept on the sequence


def test_shared_prefix_is_taken_from_the_cache_except_the_last_token():
    bm = BlockManager(16, BS)
    sch = Scheduler(bm, 8, 100)
    prompt = list(range(1, 10))                      # 9 tokens: 2 full blocks + 1
    a = make_seq(0, prompt)
    sch.add(a)
    prefill(sch, a)
    assert a.num_cached_prompt_tokens == 0 and a.num_cached_blocks == 2
    b, c = make_seq(1, prompt), make_seq(2, prompt[:8])  # c: exactly 2 blocks
    sch.add(b)
    sch.add(c)
    rows = {r.seq.seq_id: r for r in sch.schedule()}
    assert b.block_table[:2] == a.block_table[:2]
    assert rows[1].num_new_tokens == 1 and b.num_cached_prompt_tokens == 8
    # the last prompt token is always computed: c shares only its first block
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert rows[2].num_new_tokens == 4 and c.num_cached_prompt_tokens == 4
    assert bm.ref_counts[a.block_table[0]] == 3 and bm.ref_counts[a.block_table[1]] == 2


def test_released_blocks_stay_cached_and_lru_evicts_only_when_needed():
    bm = BlockManager(4, BS)
    sch = Scheduler(bm, 8, 100)
    a = make_seq(0, list(range(1, 10)))              # 3 blocks, 2 of them full
    sch.add(a)
    prefill(sch, a)
    shared = a.block_table[:2]
    sch.finish(a, "stop")
    assert bm.num_free_blocks == 4 and list(bm.evictable) == shared[::-1]  # tail first
    b = make_seq(1, [50, 51])                        # takes the never-cached block first
    sch.add(b)
    sch.schedule()
    assert b.block_table[0] not in shared and len(bm.evictable) == 2
    c = make_seq(2, list(range(100, 109)))           # needs 3 blocks: the free one, then
    sch.add(c)                                       # evicts both cached ones, oldest first
    sch.schedule()
    assert c.block_table[1:] == shared[::-1] and not bm.evictable
    assert not bm.hash_to_block and bm.hashes == [None] * 4
    d = make_seq(3, list(range(1, 10)))              # a's prefix is gone
    assert bm.match_prefix(d) == []


def test_eviction_takes_the_oldest_release_and_a_hit_leaves_the_lru():
    bm = BlockManager(6, BS)
    sch = Scheduler(bm, 8, 100)
    a, b = make_seq(0, [1, 2, 3, 4, 5]), make_seq(1, [6, 7, 8, 9, 10])
    for s in (a, b):
        sch.add(s)
        prefill(sch, s)
    sch.finish(a, "stop")
    sch.finish(b, "stop")
    a_block, b_block = list(bm.evictable)            # in the order they were released
    a2 = make_seq(2, [1, 2, 3, 4, 77])               # hits a's block: out of the LRU
    sch.add(a2)
    sch.schedule()
    assert a2.block_table[0] == a_block and list(bm.evictable) == [b_block]
    assert bm.can_allocate(make_seq(3, [1]), 4 * BS)
    assert not bm.can_allocate(make_seq(3, [1]), 5 * BS)


def test_free_blocks_count_the_cached_hits_they_take():
    bm = BlockManager(3, BS)
    sch = Scheduler(bm, 8, 100)
    a = make_seq(0, list(range(1, 10)))
    sch.add(a)
    prefill(sch, a)
    sch.finish(a, "stop")                            # 2 evictable, 1 free
    b = make_seq(1, list(range(1, 13)) + [42])       # 13 tokens: 2 hits + 2 new blocks
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert not bm.can_allocate(b, len(b), hits)      # the hits are not free for b's tail
    assert bm.can_allocate(b, 12, hits)


def test_a_prefix_being_computed_holds_back_the_rows_that_share_it():
    bm = BlockManager(16, BS)
    sch = Scheduler(bm, 8, 100)
    a, b, c = make_seq(0, range(1, 10)), make_seq(1, range(1, 10)), make_seq(2, [5, 6])
    for s in (a, b, c):
        sch.add(s)
    assert [r.seq for r in sch.schedule()] == [a]    # b waits for a's 2 announced blocks
    assert len(bm.pending) == 2
    sch.commit(a, 9, [1])
    assert not bm.pending
    rows = sch.schedule()
    assert [(r.seq.seq_id, r.num_new_tokens) for r in rows] == [(0, 1), (1, 1), (2, 2)]
    assert b.num_cached_prompt_tokens == 8


def test_preempted_sequence_recomputes_only_what_left_the_cache():
    bm = BlockManager(num_blocks=4, block_size=BS)
    sch = Scheduler(bm, 8, 100)
    a, b = make_seq(0, range(1, 8)), make_seq(1, range(1, 8))
    sch.add(a)
    sch.add(b)
    assert [r.seq for r in sch.schedule()] == [a]
    sch.commit(a, 7, [1])
    rows = sch.schedule()                            # a decodes; b starts on a's block 0
    assert [(r.seq.seq_id, r.num_new_tokens) for r in rows] == [(0, 1), (1, 3)]
    assert b.block_table[0] == a.block_table[0] and b.num_cached_prompt_tokens == 4
    sch.commit(a, 1, [2])
    sch.commit(b, 3, [1])
    sch.schedule()
    sch.commit(a, 1, [3])
    sch.commit(b, 1, [2])                            # b's 2nd block: a private copy of a's
    assert b.block_table[1] != a.block_table[1] and bm.ref_counts[a.block_table[1]] == 1
    # a needs a 3rd block: b is preempted (its private blocks freed), then re-admitted at
    # once on a's 2 cached blocks, computing only its last token
    rows = sch.schedule()
    assert sch.num_preemptions == 1
    assert [(r.seq.seq_id, r.num_new_tokens) for r in rows] == [(0, 1), (1, 1)]
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert b.num_cached_prompt_tokens == 4           # counted at its first admission only


def test_preemption_frees_private_blocks_and_keeps_shared_ones():
    bm = BlockManager(num_blocks=8, block_size=BS)
    sch = Scheduler(bm, 8, 100)
    a = make_seq(0, range(1, 10))
    sch.add(a)
    prefill(sch, a)
    b = make_seq(1, range(1, 10))
    sch.add(b)
    sch.schedule()
    shared, own = b.block_table[:2], b.block_table[2]
    sch.preempt(b)
    assert not b.block_table and b.num_computed_tokens == 0
    assert [bm.ref_counts[x] for x in shared] == [1, 1] and bm.ref_counts[own] == 0
    assert own in bm.free_block_ids


def test_rejected_drafts_are_never_hashed():
    bm = BlockManager(16, BS)
    sch = Scheduler(bm, 8, 100, lookahead=lambda seq: 3)
    a = make_seq(0, [1, 2, 3])
    sch.add(a)
    prefill(sch, a, first_token=4)                   # tokens 1 2 3 4, KV for 3
    (row,) = sch.schedule()
    assert row.max_drafts == 3                       # the target computes 4 + 3 drafts
    sch.commit(a, 1, [9])                            # all drafts rejected, 9 emitted
    assert a.num_computed_tokens == 4 and a.num_cached_blocks == 1
    assert bm.hashes[a.block_table[0]] == block_hash(b"", [1, 2, 3, 4])
    assert len(bm.hash_to_block) == 1                # positions 4..7 held drafts: not hashed


def test_draft_kv_is_shared_only_where_that_draft_computed_it():
    bm = BlockManager(16, BS)
    sch = Scheduler(bm, 8, 100, lookahead=lambda seq: 0)
    prompt = list(range(1, 14))                      # 3 full blocks + 1
    a = make_seq(0, prompt, draft_cache="draft-a")
    sch.add(a)
    prefill(sch, a)
    assert a.num_cached_blocks == 3 and a.spec.num_draft_cached_blocks == 0
    a.spec.num_draft_computed = 8                    # the draft has caught up on 2 blocks
    sch.schedule()
    sch.commit(a, 1, [5])
    assert [("draft-a" in bm.draft_caches[b]) for b in a.block_table[:3]] == [True, True, False]
    same, other, plain = (make_seq(1, prompt, "draft-a"), make_seq(2, prompt, "draft-b"),
                          make_seq(3, prompt))
    for s in (same, other, plain):
        sch.add(s)
    sch.schedule()
    assert [s.num_computed_tokens for s in (same, other, plain)] == [12, 12, 12]
    assert [s.spec.num_draft_computed for s in (same, other, plain)] == [8, 0, 0]


def test_caching_off_shares_nothing():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    sch = Scheduler(bm, 8, 100)
    a = make_seq(0, range(1, 10))
    sch.add(a)
    prefill(sch, a)
    sch.finish(a, "stop")
    assert not bm.hash_to_block and bm.match_prefix(make_seq(1, range(1, 10))) == []
    assert len(bm.free_block_ids) == 16


def test_reset_forgets_released_blocks_only():
    bm = BlockManager(8, BS)
    sch = Scheduler(bm, 8, 100)
    a, b = make_seq(0, range(1, 10)), make_seq(1, range(20, 30))
    for s in (a, b):
        sch.add(s)
        prefill(sch, s)
    sch.finish(a, "stop")
    bm.reset_prefix_cache()
    assert bm.match_prefix(make_seq(2, range(1, 10))) == []
    assert len(bm.match_prefix(make_seq(3, range(20, 30)))) == 2   # b still holds its blocks
    assert not bm.evictable and bm.num_free_blocks == 8 - len(b.block_table)
