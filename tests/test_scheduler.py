"""Scheduler, block manager and sequence: plain Python, no torch."""
import subprocess
import sys

import pytest

from batchspec.engine.block_manager import BlockManager
from batchspec.engine.scheduler import Scheduler
from batchspec.engine.sequence import Sequence, Status
from batchspec.sampling import SamplingParams


def make_seq(i, n_prompt=5, max_tokens=8):
    return Sequence(i, str(i), list(range(100 * i + 1, 100 * i + n_prompt + 1)),
                    SamplingParams(max_tokens=max_tokens),
                    seed=i)


def test_no_torch_import():
    code = ("import sys; import batchspec.engine.scheduler, batchspec.engine.block_manager, "
            "batchspec.engine.sequence; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_manager_allocate_truncate_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = make_seq(0)
    assert bm.can_allocate(s, 16) and not bm.can_allocate(s, 17)
    bm.allocate(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 2
    bm.allocate(s, 3)  # never shrinks
    assert len(s.block_table) == 2
    assert bm.slot(s, 5) == s.block_table[1] * 4 + 1
    bm.allocate(s, 12)
    assert len(s.block_table) == 3
    bm.truncate(s, 4)
    assert len(s.block_table) == 1 and bm.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        bm.allocate(s, 100)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 4
    assert len(set(bm.free_block_ids)) == 4


def test_admission_respects_token_budget_and_chunks_prefill():
    bm = BlockManager(num_blocks=64, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=12)
    a, b = make_seq(0, n_prompt=8), make_seq(1, n_prompt=8)
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out] == [(0, 8), (1, 4)]
    assert out[0].is_sampling and not out[1].is_sampling
    sch.commit(a, 8, [42])
    sch.commit(b, 4, [])
    out = sch.schedule()  # a decodes one token, b finishes its prefill
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out] == [(0, 1), (1, 4)]
    assert all(s.is_sampling for s in out)


def test_max_num_seqs():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sch.add(make_seq(i))
    assert len(sch.schedule()) == 2 and len(sch.waiting) == 1


def test_lookahead_reserves_blocks_and_budget():
    sch = Scheduler(BlockManager(64, 4), 8, 100, lookahead=lambda seq: 3)
    s = make_seq(0, n_prompt=4)
    sch.add(s)
    sch.schedule()
    sch.commit(s, 4, [7])                 # prompt done, first token sampled
    (row,) = sch.schedule()
    assert row.num_new_tokens == 1 and row.max_drafts == 3
    assert len(s.block_table) * 4 >= 4 + 1 + 3
    # 2 of 3 drafts accepted + 1 emitted token: KV valid for 4 + 1 + 2 positions
    sch.commit(s, 1 + 2, [7, 8, 9])
    assert s.num_computed_tokens == 7 and len(s) == 8


def test_preempt_when_cache_full_then_recompute():
    # (with prefix caching: tests/test_prefix_cache.py)
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)   # 16 slots
    sch = Scheduler(bm, 8, 100)
    a, b = make_seq(0, n_prompt=7), make_seq(1, n_prompt=7)
    sch.add(a)
    sch.add(b)
    sch.schedule()
    sch.commit(a, 7, [1])
    sch.commit(b, 7, [1])
    sch.schedule()                        # both decode into their second block
    sch.commit(a, 1, [2])
    sch.commit(b, 1, [2])
    out = sch.schedule()                  # a needs a 3rd block: b is preempted
    assert [s.seq.seq_id for s in out] == [0]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert sch.num_preemptions == 1 and sch.waiting[0] is b
    sch.finish(a, "length")
    out = sch.schedule()                  # b is recomputed: prompt + its 2 outputs
    assert out[0].seq is b and out[0].num_new_tokens == 9 and out[0].is_sampling


def test_request_larger_than_cache_raises():
    sch = Scheduler(BlockManager(2, 4), 8, 100)
    sch.add(make_seq(0, n_prompt=20))
    with pytest.raises(RuntimeError, match="KV blocks"):
        sch.schedule()


def test_rolling_acceptance_window():
    s = make_seq(0)
    for _ in range(30):
        s.record_round(4, 4)
    for _ in range(20):
        s.record_round(4, 0)
    drafted, accepted = s.rolling_acceptance(100)
    assert drafted == 100 and accepted == 4 * 5  # last 25 rounds: 5 good then 20 bad
    assert s.spec.drafted_per_depth == [50] * 4 and s.spec.accepted_per_depth == [30] * 4
