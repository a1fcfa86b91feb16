"""The adaptive policy's per-row arithmetic in C++ (kernels/policy_core.cpp) against its
Python reference in batchspec/spec/policy.py: rows' depth estimates, plans and the counting
of rounds give the same floats, on random estimates, costs and rounds."""
import copy
import random

import pytest

from batchspec.engine.sequence import Sequence
from batchspec.sampling import SamplingParams
from batchspec.spec import policy as policy_module
from batchspec.spec.policy import SpecPolicy, StepCosts

native = policy_module.native_core()
pytestmark = pytest.mark.skipif(native is None, reason="the CPU kernels do not build here")


class Cfg:
    num_speculative_tokens = 4


SOURCES = [("code", True), ("docs", True), ("suffix", False)]


def random_policy(rng: random.Random, num_rows: int):
    """A policy with random pooled estimates (some missing, some short, per domain and band)
    and random rows (own counts decayed to floats or not yet, none at all)."""
    policy = SpecPolicy(Cfg(), 1024)
    rows = []
    for i in range(num_rows):
        temperature = rng.choice([0.0, 0.8])
        seq = Sequence(i, str(i), [1, 2], SamplingParams(temperature=temperature), seed=0,
                       domain=rng.choice(["code", "docs", None]))
        # outputs of every band of positions (0-15, 16-31, ... and past the last, 8)
        num_output = rng.choice([rng.randrange(0, 90),
                                 2 ** rng.randrange(4, 14) + rng.randrange(-1, 2)])
        seq.token_ids += [rng.randrange(100) for _ in range(num_output)]
        source, is_model = rng.choice(SOURCES)
        seq.spec.draft = source
        src, dom = policy._pool_keys(seq, source)
        band = dom + (policy_module.position_band(seq.num_output_tokens),)
        for key in (src, dom, band):
            if key not in policy.pooled and rng.random() < 0.8:
                depth = rng.randrange(0, 5)
                judged = [rng.randrange(0, 500) for _ in range(depth)]
                policy.pooled[key] = ([rng.randrange(0, j + 1) for j in judged], judged)
        if rng.random() < 0.8:
            depth = rng.randrange(0, 5)
            judged = [rng.uniform(0, 30) if rng.random() < 0.5 else rng.randrange(0, 30)
                      for _ in range(depth)]
            seq.spec.source_depth[source] = ([j * rng.random() for j in judged], judged)
        rows.append((seq, source, rng.randrange(0, 5), is_model))
    return policy, rows


@pytest.mark.parametrize("seed", range(20))
def test_rows_probs_are_python_s(seed, monkeypatch):
    """Rows' depth estimates, some drafts classed; with estimates per band of output
    positions and (every fourth seed) without."""
    if seed % 4 == 3:
        monkeypatch.setattr(policy_module, "MAX_POSITION_BAND", 0)
    rng = random.Random(seed)
    policy, rows = random_policy(rng, rng.randrange(1, 40))
    classes = [[rng.randrange(3) for _ in range(n)] if src == "suffix" and rng.random() < 0.5
               else None for _, src, n, _ in rows]
    policy.by_class[("suffix", 0.0)] = {0: [3, 10], 1: [40, 41], 2: [0, 7]}
    assert policy.native is native
    got = policy.rows_probs(rows, classes)
    want = [policy.depth_probs(seq, src, n, c) for (seq, src, n, _), c in zip(rows, classes)]
    assert got == want                   # the same floats, not approximately
    assert any(want)


def random_costs(rng: random.Random) -> StepCosts:
    sizes = [1, 4, 16, 64]
    target = {q: sorted(rng.uniform(0.001, 0.02) * q for _ in sizes) for q in range(1, 6)}
    draft = {src: sorted(rng.uniform(1e-4, 3e-3) for _ in sizes)
             for src, is_model in SOURCES if is_model}
    costs = StepCosts(sizes, target=target, draft=draft,
                      verify_token_s=rng.choice([0.0, 2e-5]),
                      draft_sample_s={"code": 1e-5})
    costs.smooth()
    return costs


@pytest.mark.parametrize("seed", range(40))
def test_plans_are_python_s(seed):
    """Plans of one source and of several, greedy and sampled rows, rows skipped, one row."""
    rng = random.Random(seed)
    policy, rows = random_policy(rng, rng.choice([1, 2, rng.randrange(1, 48)]))
    if seed % 3 == 0:      # one model draft, every row greedy: slots by survival alone
        rows = [(seq, "code", n, True) for seq, _, n, _ in rows]
        for seq, _, _, _ in rows:
            seq.params = SamplingParams(temperature=0.0)
    costs = random_costs(rng)
    probs = policy.rows_probs(rows)
    skip = {i for i in range(len(rows)) if rng.random() < 0.2}
    num_rows = len(rows) + rng.randrange(0, 4)
    extra_s = rng.choice([0.0, rng.uniform(0, 0.01)])
    got = policy._plan(rows, probs, skip, num_rows, extra_s, costs)
    policy.native = None
    want = policy._plan(rows, probs, skip, num_rows, extra_s, costs)
    assert tuple(got) == tuple(want)


def test_a_plans_lengths_are_its_admitted_slots():
    rng = random.Random(7)
    policy, rows = random_policy(rng, 24)
    costs = random_costs(rng)
    best, _, _, _, order, row, depth, lengths = policy._plan(
        rows, policy.rows_probs(rows), set(), 24, 0.0, costs)
    want = [0] * len(rows)
    for j in order[:best]:
        want[row[j]] = max(want[row[j]], depth[j] + 1)
    assert lengths == want


@pytest.mark.parametrize("seed", range(10))
def test_counting_rounds_is_python_s(seed, monkeypatch):
    """A step's rounds counted in C++ (record_rounds) leave every estimate as record() does,
    its types too (counts stay ints until a request's own decay makes them floats); with
    estimates per band of output positions and (every fourth seed) without."""
    if seed % 4 == 3:
        monkeypatch.setattr(policy_module, "MAX_POSITION_BAND", 0)
    rng = random.Random(seed)
    policy, rows = random_policy(rng, rng.randrange(1, 40))
    policy.native = None          # (a module does not copy)
    reference = copy.deepcopy((policy, rows))
    policy.native = native
    for _ in range(6):
        rounds = []
        for seq, source, _, _ in rows:
            if rng.random() < 0.8:
                drafted = rng.randrange(0, 6)
                classes = [rng.randrange(3) for _ in range(drafted)] \
                    if source == "suffix" else None
                rounds.append((seq, source, drafted, rng.randrange(0, drafted + 1), classes))
        # the same rounds on the copy, through the Python reference
        by_id = {id(seq): i for i, (seq, _, _, _) in enumerate(rows)}
        ref_policy, ref_rows = reference
        ref_policy.native = None
        ref_policy.record_rounds([(ref_rows[by_id[id(seq)]][0], *rest)
                                  for seq, *rest in rounds])
        policy.record_rounds(rounds)
        assert repr(policy.pooled) == repr(ref_policy.pooled)
        assert policy.by_class == ref_policy.by_class
        for (seq, _, _, _), (ref, _, _, _) in zip(rows, ref_rows):
            assert repr(seq.spec.source_depth) == repr(ref.spec.source_depth)
    assert policy.pooled


def test_bands_of_output_positions_are_python_s():
    """The C++ band of a row's output positions (in the keys of its estimates) is
    position_band's, at every band's edges and past the last: a row whose estimates differ
    only in the band at its position gets that band's estimate."""
    policy = SpecPolicy(Cfg(), 1 << 16)
    seq = Sequence(0, "0", [1, 2], SamplingParams(), seed=0, domain="code")
    _, dom = policy._pool_keys(seq, "code")
    for band in range(policy_module.MAX_POSITION_BAND + 1):
        policy.pooled[dom + (band,)] = ([band], [policy_module.MAX_POSITION_BAND + 1])
    for n in sorted({0, 1, 40_000} | {2 ** b + e for b in range(1, 16) for e in (-1, 0, 1)}):
        seq.token_ids = [1, 2] + [0] * n
        assert policy.rows_probs([(seq, "code", 1, True)]) == \
            [policy.depth_probs(seq, "code", 1)], n


def test_the_python_serves_where_the_kernels_do_not_build(monkeypatch, caplog):
    """No compiler (the CPU kernels fail to build): the policy runs the Python arithmetic,
    with a warning, and gives the same estimates."""
    from batchspec.spec import _build

    def no_build():
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(_build, "cpu_module", no_build)
    policy_module._native_core.cache_clear()
    try:
        policy, rows = random_policy(random.Random(2), 6)
        assert policy.native is None
        assert "C++ policy arithmetic unavailable (no C++ compiler)" in caplog.text
        assert policy.rows_probs(rows) == [policy.depth_probs(s, src, n)
                                           for s, src, n, _ in rows]
    finally:
        policy_module._native_core.cache_clear()


def test_python_reference_when_asked(monkeypatch):
    monkeypatch.setenv("BATCHSPEC_POLICY_NATIVE", "0")
    assert SpecPolicy(Cfg(), 1024).native is None
    monkeypatch.setenv("BATCHSPEC_POLICY_NATIVE", "1")
    assert SpecPolicy(Cfg(), 1024).native is native


def test_the_arithmetic_is_looked_up_at_first_use():
    """A policy that never weighs plans nor counts rounds (plain decoding, a fixed k) does not
    load the C++ arithmetic; the first weighing does."""
    policy, rows = random_policy(random.Random(3), 4)
    assert policy._native is policy_module._UNSET
    policy.rows_probs(rows)
    assert policy._native is native


def test_malformed_estimates_raise_rather_than_read_past_a_list():
    """Counts the C++ cannot read as the Python does (fewer accepted counts than judged,
    tuples for lists) raise: never a read past the end of a list."""
    policy, rows = random_policy(random.Random(5), 1)
    seq, source, _, _ = rows[0]
    seq.spec.source_depth[source] = ([1], [2, 2])
    with pytest.raises(ValueError):
        policy.rows_probs([(seq, source, 2, True)])
    seq.spec.source_depth[source] = ((1, 1), (2, 2))
    with pytest.raises(TypeError):
        policy.rows_probs([(seq, source, 2, True)])
