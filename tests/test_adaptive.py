"""Per-slot adaptive verification (SpecPolicy.choose_lengths): which draft slots a step
admits, from per-depth acceptance estimates and measured step costs."""
import math

import pytest

from batchspec import LLM
from batchspec.engine.sequence import Sequence
from batchspec.sampling import SamplingParams
from batchspec.spec.policy import SpecPolicy, StepCosts


class Cfg:
    num_speculative_tokens = 4


def make_policy(target, draft=None, plain_cold_steps=0):
    """A policy over these start-up costs. Its plain steps right after a speculating one are
    measured (plain_cold_steps=0), so that the tests of the lead and the tries drive both sides
    step by step; test_the_first_plain_steps_after_speculating_are_not_measured keeps the
    policy's own PLAIN_COLD_STEPS."""
    policy = SpecPolicy(Cfg(), 1024)
    policy.costs = StepCosts([1, 4, 32], target=target, draft=draft or {})
    policy.plain_cold_steps = plain_cold_steps
    return policy


def rows_with(policy, n, source, p, domain=None, rounds=200):
    """n sequences served by `source` whose own history (and the pooled one) accepts each
    depth with probability p."""
    seqs = []
    for i in range(n):
        seq = Sequence(i, str(i), [1, 2], SamplingParams(), seed=0, domain=domain)
        seq.spec.draft = source
        seqs.append(seq)
    judged = [1000] * 4
    acc = [int(p * 1000)] * 4
    src, dom = policy._pool_keys(seqs[0], source)
    policy.pooled[src] = (list(acc), list(judged))
    policy.pooled[dom] = (list(acc), list(judged))
    for seq in seqs:
        seq.spec.source_depth[source] = ([int(p * rounds)] * 4, [rounds] * 4)
    return seqs


def set_slowdowns(policy, spec, plain, rows=4):
    """As if speculating steps had measured `spec` times fewer tokens per second than
    predicted, and plain steps `plain` times fewer; their predicted seconds those of a plain
    step of `rows` rows (1 s for a policy without costs), so that what steps measured beyond
    their forwards (_overhead_s, which speculation's plans are judged with) is on the scale
    of the costs."""
    s = policy.costs.target_s(rows, 1) if policy.costs is not None else 1.0
    policy.measured = {True: [1.0, s, 1.0, s * spec], False: [1.0, s, 1.0, s * plain]}


def flat(q_cost):
    """Target cost that does not depend on the tokens per row (verification free)."""
    return {q: [q_cost(1, q), q_cost(4, q), q_cost(32, q)] for q in range(1, 6)}


def test_target_tokens_interpolates_ragged_windows():
    costs = StepCosts([1, 4], target={q: [1.0 * q, 2.0 * q] for q in range(1, 6)})
    assert costs.target_tokens_s(4, 4) == pytest.approx(2.0)     # q = 1
    assert costs.target_tokens_s(4, 6) == pytest.approx(3.0)     # q = 1.5
    assert costs.target_tokens_s(4, 100) == pytest.approx(10.0)  # capped at q = k + 1


def test_free_verification_and_good_drafts_take_every_slot():
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4, 1e-4, 1e-4]})
    seqs = rows_with(policy, 4, "d", 0.9)
    assert policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0) == [4] * 4


def test_poor_drafts_or_dear_verification_take_none():
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.0)
    assert policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0) == [0] * 4
    # each verified token costs as much as a row's whole decode: nothing pays
    policy = make_policy(flat(lambda b, q: 0.01 * b * q), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.7)
    assert policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0) == [0] * 4


def test_slots_go_to_the_rows_most_likely_to_keep_them():
    """Verification costs grow with tokens: the good source's rows get the slots (and more
    of them) before the poor source's, and a dearer step buys fewer slots."""
    def cost(extra):
        return flat(lambda b, q: 0.01 * b + extra * b * (q - 1))
    lengths = {}
    for extra in (0.001, 0.004):
        policy = make_policy(cost(extra), {"good": [1e-4] * 3, "poor": [1e-4] * 3})
        good = rows_with(policy, 2, "good", 0.9, domain="code")
        poor = rows_with(policy, 2, "poor", 0.3, domain="docs")
        lengths[extra] = policy.choose_lengths(
            [(s, "good", 4, True) for s in good] + [(s, "poor", 4, True) for s in poor], 0)
    cheap, dear = lengths[0.001], lengths[0.004]
    assert min(cheap[:2]) > max(cheap[2:]) and cheap[:2] == [4, 4]
    assert sum(dear) < sum(cheap) and dear[2:] == [0, 0]


def test_lookup_rows_are_bounded_by_what_they_found():
    policy = make_policy(flat(lambda b, q: 0.01 * b))
    seqs = rows_with(policy, 3, "ngram", 0.9)
    assert policy.choose_lengths([(seqs[0], "ngram", 2, False), (seqs[1], "ngram", 0, False),
                                  (seqs[2], "ngram", 4, False)], 5) == [2, 0, 4]


def test_drafts_classed_by_their_source_take_their_class_acceptance():
    """Suffix drafts come classed by their own evidence (share of the trie's continuations,
    match length). What verification accepted in each class replaces the depth's estimate:
    a row's well-founded draft keeps its slots, an unsure one (say, after a one-token match)
    loses them, where depth estimates, pooled over both kinds, cannot tell them apart."""
    from batchspec.spec.suffix import evidence_class
    policy = make_policy(flat(lambda b, q: 0.01 * b + 0.004 * b * (q - 1)))
    seqs = rows_with(policy, 2, "suffix", 0.6, rounds=0)
    sure = [evidence_class(0.97, 8 + i) for i in range(4)]
    unsure = [evidence_class(1.0, 1 + i) for i in range(4)]
    for _ in range(50):                   # what verification made of earlier drafts
        policy.record(seqs[0], "suffix", 4, 4, sure)
        policy.record(seqs[0], "suffix", 4, 0, unsure)
    assert min(policy.depth_probs(seqs[0], "suffix", 4, sure)) > 0.9
    assert policy.depth_probs(seqs[0], "suffix", 4, unsure)[0] < 0.2
    rows = [(s, "suffix", 4, False) for s in seqs]
    assert policy.choose_lengths(rows, 0, [sure, unsure]) == [4, 0]
    assert policy.choose_lengths(rows, 0, [unsure, sure]) == [0, 4]
    # classes are kept per temperature, as the depth estimates are
    hot = rows_with(policy, 1, "suffix", 0.6, rounds=0)[0]
    hot.params = SamplingParams(temperature=0.8)
    assert policy.depth_probs(hot, "suffix", 1, unsure) == policy.depth_probs(hot, "suffix", 1)


def test_estimates_shrink_towards_the_pool():
    policy = SpecPolicy(Cfg(), 1024)
    seq = Sequence(0, "0", [1], SamplingParams(), seed=0, domain="code")
    seq.spec.draft = "d"
    # no history at all: the prior at every depth
    assert policy.depth_probs(seq, "d", 3) == pytest.approx([0.6] * 3)
    greedy_pool = policy._pool_keys(seq, "d")[0]
    policy.pooled[greedy_pool] = ([900, 400], [1000, 1000])
    p = policy.depth_probs(seq, "d", 3)
    assert p[0] == pytest.approx((900 + 6) / 1010)
    assert p[1] == pytest.approx((400 + 10 * p[0]) / 1010)  # shrunk towards depth 0's
    assert p[2] == pytest.approx(p[1])  # deeper than any data: the depth above
    # one request that always rejects at depth 0 pulls its own estimate down, not the pool's
    seq.spec.source_depth["d"] = ([0], [40])
    assert policy.depth_probs(seq, "d", 1)[0] < 0.2 < p[0]
    # rows sampled at another temperature do not read greedy rows' estimates
    hot = Sequence(1, "1", [1], SamplingParams(temperature=0.8), seed=0, domain="code")
    assert seq.params.temperature != 0.8
    assert policy.depth_probs(hot, "d", 1) == pytest.approx([0.6])
    policy.record(hot, "d", 2, 0)
    assert ("d", 0.8) in policy.pooled
    assert policy.pooled[greedy_pool] == ([900, 400], [1000, 1000])


def test_estimates_follow_a_requests_recent_rounds_and_its_output_position():
    """Acceptance drifts along a request's output. A request's own counts decay with each
    round (REQUEST_DECAY), so that after a run of rejections a run of acceptances lifts its
    estimate near the pool's (with counts over all rounds it would stay low); and pooled
    estimates are kept per band of output positions, which rows at those positions read
    before the domain's over all positions."""
    from batchspec.spec.policy import REQUEST_DECAY, position_band
    policy = SpecPolicy(Cfg(), 1024)
    seq = Sequence(0, "0", [1], SamplingParams(), seed=0, domain="code")
    seq.spec.draft = "d"
    for _ in range(20):
        policy.record(seq, "d", 1, 0)
    low = policy.depth_probs(seq, "d", 1)[0]
    for _ in range(5):
        policy.record(seq, "d", 1, 1)
    # undecayed: (5 + 4 p) / (25 + 4), p the pool's (5 of 25 accepted): under 0.3
    assert policy.depth_probs(seq, "d", 1)[0] > 0.4 > 0.3 > low
    acc, judged = seq.spec.source_depth["d"]
    assert judged[0] == pytest.approx(sum(REQUEST_DECAY ** i for i in range(25)))
    # pooled per band of output positions: 0-15, 16-31, 32-63, ...
    early, late = (Sequence(i, str(i), [1], SamplingParams(), seed=0, domain="code")
                   for i in (1, 2))
    for s_ in (early, late):
        s_.spec.draft = "d"
    late.token_ids.extend([5] * 40)
    assert [position_band(n) for n in (0, 15, 16, 31, 32, 40, 64, 1 << 20)] == \
        [0, 0, 1, 1, 2, 2, 3, 8]
    assert (position_band(early.num_output_tokens), position_band(late.num_output_tokens)) == \
        (0, 2)
    fresh = SpecPolicy(Cfg(), 1024)
    for _ in range(500):
        fresh.record(early, "d", 1, 0)
        fresh.record(late, "d", 1, 1)
    early.spec.source_depth.clear()
    late.spec.source_depth.clear()
    p_early, p_late = (fresh.depth_probs(s_, "d", 1)[0] for s_ in (early, late))
    assert p_early < 0.1 and p_late > 0.9          # the domain's over both: about 0.5


def test_noisy_timings_are_smoothed_into_lines_in_q_and_monotone_in_b():
    costs = StepCosts([1, 2], target={1: [2.0, 3.0], 2: [1.0, 3.5], 3: [3.0, 4.0]},
                      draft={"d": [0.2, 0.1]})
    costs.smooth()
    assert [costs.target[q][0] for q in (1, 2, 3)] == pytest.approx([1.5, 2.0, 2.5])
    assert [costs.target[q][1] for q in (1, 2, 3)] == pytest.approx([3.0, 3.5, 4.0])
    assert costs.draft["d"] == [0.2, 0.2]
    falling = StepCosts([1], target={1: [3.0], 2: [1.0]})
    falling.smooth()                      # slope clipped at 0: the mean everywhere
    assert falling.target == {1: [2.0], 2: [2.0]}
    # the engine times q = 1, 3 and 5 (k = 4): the line fills q = 2 and 4
    gaps = StepCosts([1], target={1: [1.0], 3: [2.1], 5: [2.6]})
    gaps.smooth()
    assert sorted(gaps.target) == [1, 2, 3, 4, 5]
    assert [gaps.target[q][0] for q in range(1, 6)] == pytest.approx([1.1, 1.5, 1.9, 2.3, 2.7])


def test_a_burst_of_load_moves_a_side_by_a_tenth_at_most():
    policy = SpecPolicy(Cfg(), 1024)
    assert policy._slowdown(True) == policy._slowdown(False) == 1.0
    for speculate in [False] + [True] * 10:
        policy._chosen = (speculate, 10.0, 1.0, False)
        policy.observe(1.0, 10)
    policy._chosen = (True, 10.0, 1.0, False)
    policy.observe(8.0, 10)                     # a step 8x slower than predicted
    assert policy._slowdown(True) == pytest.approx(1.1)   # counted as 2x, weight 0.1
    assert policy._slowdown(False) == 1.0


def test_a_step_that_also_runs_a_prompt_is_measured_with_the_prompt_predicted():
    """At large batches with speculation nearly every step admits a row: such steps are
    measured, their prediction adding what the prompt tokens cost (timed at start-up). A
    step as slow as that prediction measures no slowdown; one with more than twice the
    prompt tokens timed is not measured."""
    from batchspec.spec.policy import PROMPT_TIMED
    policy = make_policy({q: [0.001 * q, 0.004 * q, 0.032 * q] for q in range(1, 6)})
    policy.costs.prompt_token_s = 0.001
    seqs = rows_with(policy, 4, "d", 0.9)
    policy._winner = False
    assert policy.plain_step(seqs, 4)                  # 4 rows of one token: 4 ms
    policy.observe(0.004 + 0.007, 4, prompt_tokens=7)   # and a prompt of 7
    assert policy._slowdown(False) == pytest.approx(1.0)
    assert policy.plain_step(seqs, 4)
    policy.observe(1.0, 4, prompt_tokens=2 * PROMPT_TIMED + 1)
    assert policy.observed[False] == 1 and policy._slowdown(False) == pytest.approx(1.0)


def test_slowdown_is_a_ratio_of_averages_not_an_average_of_ratios():
    """Speculating steps at batch size 1 make 1 to k+1 tokens: steps as predicted on
    average (2 tokens predicted, 1 and 3 made in turn, in the predicted time) measure a
    slowdown of 1, where averaging per-step ratios would say 4/3."""
    policy = SpecPolicy(Cfg(), 1024)
    for i in range(40):
        policy._chosen = (True, 2.0, 1.0, False)
        policy.observe(1.0, 1 if i % 2 else 3)
    assert policy._slowdown(True) == pytest.approx(1.0, abs=0.1)


def test_the_other_side_is_tried_ever_more_rarely_while_it_loses():
    """Speculation leads by a little (its measured excess brings the model's 4x down to
    1.05x): plain is tried for TRY_STEPS measured steps (and one weighed first) after 10,
    20, 40, 80, 80 ... steps. Far behind (the model's 4x,
    both sides measured as predicted), only every FAR_EXPLORE steps."""
    from batchspec.spec.policy import EXPLORE, FAR_EXPLORE, MAX_EXPLORE, TRY_STEPS
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 3.9, 1.0)
    picks = [policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
             for _ in range(32 * EXPLORE)]
    plain = [i for i, p in enumerate(picks, 1) if p == [0] * 4]
    starts = [EXPLORE, 3 * EXPLORE, 7 * EXPLORE, 15 * EXPLORE, 23 * EXPLORE, 31 * EXPLORE]
    assert plain == [t + i for t in starts for i in range(TRY_STEPS + 1)] and \
        picks[0] == [4] * 4
    assert MAX_EXPLORE == 8 * EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    set_slowdowns(policy, 1.0, 1.0)
    picks = [policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
             for _ in range(FAR_EXPLORE)]
    assert [i for i, p in enumerate(picks, 1) if p == [0] * 4] == [FAR_EXPLORE]


def test_measured_goodput_turns_a_losing_side_off():
    """The start-up costs say speculation pays (4x plain's tokens per second); speculating
    steps then measure a sixth of their predicted rate, plain steps what was predicted: the
    policy goes plain (trying speculation again only every FAR_EXPLORE steps, so far behind
    it is), and back when speculation delivers."""
    from batchspec.spec.policy import EXPLORE, FAR_EXPLORE, TRY_STEPS
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)

    def run(steps, spec_speed):
        picks = []
        for _ in range(steps):
            lengths = policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
            picks.append(any(lengths))
            if policy._chosen is not None:    # None: a step that catches the drafts up
                speculate, tokens, seconds, _ = policy._chosen
                policy.observe(seconds, tokens * (spec_speed if speculate else 1.0))
        return picks
    run(4 * EXPLORE, 1 / 6)
    late = run(FAR_EXPLORE, 1 / 6)
    assert late.count(True) == TRY_STEPS + 1    # one try (and its catch-up step)
    run(FAR_EXPLORE, 1.0)
    assert run(EXPLORE, 1.0).count(False) <= 1


def test_tries_are_held_to_their_budget():
    """Speculation close behind plain (tried every MAX_EXPLORE steps by the interval alone),
    but each try step costs 10 plain steps: tries then cost at most EXPLORE_BUDGET (1%) of
    the time measured and one try beyond it, where by the interval alone they cost 30%.
    Cheap tries are not held back."""
    from batchspec.spec.policy import MAX_EXPLORE, TRY_STEPS

    def run(try_cost, steps=100 * MAX_EXPLORE):
        policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
        seqs = rows_with(policy, 4, "d", 0.9)
        set_slowdowns(policy, 4.5, 1.0)       # speculation measured as losing a little
        policy._winner = False
        tries = spent = total = 0.0
        for _ in range(steps):
            if policy.plain_step(seqs, 4):
                seconds = 0.04
            elif any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)):
                seconds, tries, spent = 0.04 * try_cost, tries + 1, spent + 0.04 * (try_cost - 1)
            else:
                seconds = 0.04
            total += seconds
            policy.observe(seconds, 4)        # the same tokens: the try's cost is its time
        return tries / (TRY_STEPS + 1), spent / total
    tries, share = run(10.0)
    assert share <= 0.015     # the budget and one try beyond it
    assert tries >= 2
    cheap_tries, _ = run(1.0)
    assert cheap_tries >= 90      # every MAX_EXPLORE steps


def test_a_speculating_step_after_plain_ones_is_not_measured():
    """It also catches the drafts' caches up (a switching cost): a try of speculation runs
    one step more than TRY_STEPS, and that first one is not measured, nor its draft's call
    timed (observe_draft); the try's later steps are, both."""
    from batchspec.spec.policy import EXPLORE, TRY_STEPS
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 4.5, 1.0)     # speculation measured as losing a little
    chosen = []
    for _ in range(EXPLORE + TRY_STEPS + 1):
        lengths = policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
        chosen.append((any(lengths), policy._chosen, dict(policy._draft_pred)))
    assert [c[0] for c in chosen[EXPLORE - 1:]] == [True] * (TRY_STEPS + 1) + [False]
    assert chosen[EXPLORE - 1][1] is None                 # the first: not measured
    assert chosen[EXPLORE - 1][2] == {}
    assert all(c[1][0] and c[1][2] for c in chosen[EXPLORE:EXPLORE + TRY_STEPS])
    assert all(c[2] == {"d": pytest.approx(4 * 1e-4)}
               for c in chosen[EXPLORE:EXPLORE + TRY_STEPS])


def test_a_try_of_plain_runs_its_steps_as_plain_runs_while_it_leads():
    """While speculation leads, a try of plain is weighed once (that step, scheduled with
    draft slots and weighed, is not measured); its TRY_STEPS measured steps are then run
    before scheduling without weighing (plain_step), as plain's steps are while it leads:
    weighed and scheduled for drafts, they measured plain 12-20% slower than a plain
    engine at 64 rows, and speculation kept a lead it did not have."""
    from batchspec.spec.policy import EXPLORE, TRY_STEPS
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 3.9, 1.0)       # speculation leads by a little (1.05x)
    steps = []
    for _ in range(EXPLORE + TRY_STEPS + 1):
        if policy.plain_step(seqs, 4):
            steps.append(("plain_step", policy._chosen[3]))
        else:
            lengths = policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
            steps.append((any(lengths), policy._chosen is not None and policy._chosen[3]))
    assert steps[:EXPLORE - 1] == [(True, False)] * (EXPLORE - 1)
    assert steps[EXPLORE - 1] == (False, False)              # weighed, not measured
    assert steps[EXPLORE:] == [("plain_step", True)] * TRY_STEPS + [(True, False)]


def test_the_first_plain_steps_after_speculating_are_not_measured():
    """The first PLAIN_COLD_STEPS plain steps after a speculating one run slower than plain
    steps do (the speculating step's working set has pushed theirs out of the caches): a try
    of plain leaves them unmeasured and measures its TRY_STEPS steps after them, and a
    speculating step starts the count again."""
    from batchspec.spec.policy import EXPLORE, PLAIN_COLD_STEPS, TRY_STEPS
    assert PLAIN_COLD_STEPS >= 2
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3},
                         plain_cold_steps=PLAIN_COLD_STEPS)
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 3.9, 1.0)       # speculation leads by a little (1.05x)
    steps = []
    for _ in range(EXPLORE + PLAIN_COLD_STEPS + TRY_STEPS + 1):
        kind = "plain_step" if policy.plain_step(seqs, 4) else \
            any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0))
        chosen = policy._chosen
        steps.append((kind, chosen is not None and chosen[3]))
        if chosen is not None:            # each side measured as set above
            speculate, tokens, seconds, _ = chosen
            policy.observe(seconds * (3.9 if speculate else 1.0), tokens)
    assert steps[:EXPLORE - 1] == [(True, False)] * (EXPLORE - 1)
    assert steps[EXPLORE - 1] == (False, False)               # weighed, not measured
    cold = PLAIN_COLD_STEPS - 1
    assert steps[EXPLORE:EXPLORE + cold] == [("plain_step", False)] * cold
    assert steps[EXPLORE + cold:EXPLORE + cold + TRY_STEPS] == \
        [("plain_step", True)] * TRY_STEPS
    assert steps[-1] == (True, False)      # the try is over; speculation leads again
    assert policy._cold == PLAIN_COLD_STEPS


@pytest.mark.parametrize("step_s,measured", [(0.04, 3), (0.005, 6), (0.001, 12)])
def test_a_try_measures_at_least_try_min_s(step_s, measured):
    """A try measures TRY_STEPS steps, and more until they add up to TRY_MIN_S (at most
    MAX_TRY_STEPS): at 8 rows a step takes 2.5 ms, and three of them on a shared machine
    told sides 5% apart from each other by chance."""
    from batchspec.spec.policy import EXPLORE, MAX_TRY_STEPS, TRY_MIN_S, TRY_STEPS
    assert (TRY_STEPS, MAX_TRY_STEPS) == (3, 12) and TRY_MIN_S == pytest.approx(0.03)
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 4.5, 1.0)         # plain leads, speculation close behind
    policy._winner = False
    sides = []
    for _ in range(EXPLORE + MAX_TRY_STEPS + 4):
        sides.append(any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)))
        if policy._chosen is not None:     # a try's steps take step_s, at 1/4.5 the pace
            _, tokens, seconds, tried = policy._chosen   # predicted; plain's as predicted
            policy.observe(step_s, tokens * step_s / seconds / 4.5) if tried else \
                policy.observe(seconds, tokens)
    assert sides[:EXPLORE - 1] == [False] * (EXPLORE - 1)
    assert sides[EXPLORE - 1:EXPLORE + measured + 1] == [True] * (measured + 1) + [False]


def test_a_drafts_levels_are_priced_by_the_rows_drafting_at_each_depth():
    """A model draft's predicted call (what observe_draft measures against): a forward per
    depth over the rows still drafting that deep, per source; lookup rows and rows that
    draft nothing cost no draft forward."""
    policy = make_policy(flat(lambda b, q: 0.01 * b),
                         {"d": [1e-3, 2e-3, 9e-3], "e": [5e-3, 6e-3, 7e-3]})
    seqs = rows_with(policy, 6, "d", 0.9)
    rows = [(seqs[0], "d", 4, True), (seqs[1], "d", 4, True), (seqs[2], "e", 4, True),
            (seqs[3], "d", 4, True), (seqs[4], "look", 4, False), (seqs[5], "e", 4, True)]
    d, e = (lambda c: policy.costs.draft_s("d", c)), (lambda c: policy.costs.draft_s("e", c))
    # d's rows draft 3, 1 and 0 tokens: 2 rows at depth 0, 1 at depths 1 and 2
    # e's rows draft 2 and 2 tokens: 2 rows at depths 0 and 1
    assert policy._levels_s(rows, [3, 1, 2, 0, 4, 2]) == {
        "d": pytest.approx(d(2) + d(1) + d(1)), "e": pytest.approx(2 * e(2))}
    assert policy._levels_s(rows, [0, 0, 0, 0, 4, 0]) == {}


@pytest.mark.parametrize("step_s,measured", [(0.003, 3), (0.0022, 12)])
def test_a_try_of_plain_far_behind_ends_after_try_steps(step_s, measured):
    """While speculation leads, a try of plain whose first TRY_STEPS measured steps run
    below TRY_MARGIN of speculation's measured pace ends there, however short its steps (at
    one row, three plain steps of 3 ms left no doubt where TRY_MIN_S took twelve); one
    close behind runs on to TRY_MIN_S (at most MAX_TRY_STEPS)."""
    from batchspec.spec.policy import FAR_EXPLORE, MAX_TRY_STEPS
    policy = make_policy(flat(lambda b, q: 0.001 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    # speculation measured 2000 tokens/s (1.5x slower than its predictions), plain as
    # predicted: speculation leads, plain far behind
    policy.measured = {True: [12.0, 0.004, 12.0, 0.006], False: [4.0, 0.004, 4.0, 0.004]}
    policy._winner = True
    tried = []
    for _ in range(FAR_EXPLORE + MAX_TRY_STEPS + 4):
        if policy.plain_step(seqs, 4):
            if policy._chosen[3]:
                tried.append(step_s)
            policy.observe(step_s, 4)     # 4 tokens in step_s: 1333 or 1818 tokens/s
        else:
            policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
    assert len(tried) == measured
    assert policy._winner is True


def test_a_try_of_speculation_drafts_only_for_rows_whose_drafts_are_not_far_behind():
    """While plain leads, a model draft has not seen its rows' latest tokens: after the
    first try of a mix and band, a try drafts for the rows least behind, within
    CATCH_UP_PER_ROW tokens per row in all, not for a row whose draft would first have to
    read a thousand tokens."""
    from batchspec.spec.policy import EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    for seq in seqs[2:]:
        seq.prompt_token_ids = seq.token_ids = [1] * 1000   # 1000 tokens the draft lacks
    set_slowdowns(policy, 3.0, 1.0)     # speculation on two rows: close behind plain
    policy._winner = False              # plain leads
    policy._tried_in_full = True        # (the first try has drafted for every row)
    picks = [policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
             for _ in range(EXPLORE)]
    assert picks[:EXPLORE - 1] == [[0] * 4] * (EXPLORE - 1)
    assert picks[-1][:2] == [4, 4] and picks[-1][2:] == [0, 0]


def test_the_first_try_of_a_mix_drafts_for_every_row():
    """The first try of speculation while plain leads, for a mix of temperatures and band
    of batch sizes, drafts for every row however far behind their drafts are, so that
    speculation is measured once on the plan it would run: a try for the row least behind
    alone carries a speculating step's fixed cost for a token or two. The tries after it
    draft for the rows least behind; another band starts with a try in full again."""
    from batchspec.spec.policy import EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    for seq in seqs[2:]:
        seq.prompt_token_ids = seq.token_ids = [1] * 1000   # 1000 tokens the draft lacks
    set_slowdowns(policy, 3.0, 1.0)     # speculation: close behind plain
    policy._winner = False              # plain leads

    def until_a_try():
        for _ in range(4 * EXPLORE):
            lengths = policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
            if any(lengths):
                return lengths
        raise AssertionError("no try")

    def finish_the_try():
        while policy._trying:
            speculate, tokens, seconds, _ = policy._chosen or (True, 4, 0.04, True)
            policy.observe(4 * seconds if speculate else seconds, tokens)  # a loss
            policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
    assert until_a_try() == [4, 4, 4, 4]
    finish_the_try()
    assert policy._winner is False and policy._tried_in_full
    assert until_a_try() == [4, 4, 0, 0]
    policy._use_mix((0.0,), 16)         # another band of batch sizes: its own first try
    assert not policy._tried_in_full


def test_a_try_at_one_row_drafts_for_it_however_far_behind():
    """At batch size 1 the only row's draft is always further behind than the catch-up
    budget after plain steps; a try still drafts for it (the row least behind always may),
    else speculation, once behind, would never be measured again."""
    from batchspec.spec.policy import EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    (seq,) = rows_with(policy, 1, "d", 0.9)
    seq.prompt_token_ids = seq.token_ids = [1] * 1000
    set_slowdowns(policy, 3.0, 1.0, rows=1)
    policy._winner = False
    picks = [policy.choose_lengths([(seq, "d", 4, True)], 0) for _ in range(EXPLORE)]
    assert picks[:EXPLORE - 1] == [[0]] * (EXPLORE - 1) and picks[-1] == [4]


def test_a_trys_catch_up_is_paid_from_its_budget_not_measured_as_speculations_pace():
    """A try's step whose draft first caught rows up on their history (observe_catch_up):
    what that forward took beyond a level's is left out of the step's measured seconds and
    of the draft's call, and charged to the tries' budget; a lead's step keeps it (a row
    catches up on its prompt once while speculation leads, a cost it pays)."""
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-3] * 3})
    set_slowdowns(policy, 1.0, 1.0)
    policy._winner, policy._trying = False, True
    policy._draft_timed["d"] = [1e-3, 1e-3, 10]
    policy._chosen, policy._draft_pred = (True, 8.0, 0.05, True), {"d": 1e-3}
    policy.observe_catch_up("d", 0.031, 4)          # 0.030 s beyond a level over 4 rows
    policy.observe_draft("d", 0.032)
    assert policy._draft_timed["d"][1] == pytest.approx(1e-3 + 0.1 * (0.002 - 1e-3))
    policy.observe(0.08, 8)
    spec = policy.measured[True]
    assert spec[3] == pytest.approx(0.05)           # the try's mean: its one step, less 0.030
    assert policy._explore_s == pytest.approx(0.08 - 8 * 0.01)   # (plain: 4 tokens a 0.04 s)
    policy._trying, policy._winner = False, True    # a lead's step: measured in full
    policy._chosen = (True, 8.0, 0.05, False)
    policy.observe_catch_up("d", 0.031, 4)
    policy.observe(0.08, 8)
    assert spec[3] > 0.05


def test_speculations_measured_excess_is_added_to_a_plan_not_scaled_with_it():
    """A speculating step costs a fixed amount beyond its forwards (the drafts' calls,
    verification, the plan itself) whatever its slots: measured on a try of one slot, it is
    added to the seconds of the plan over every row, not multiplied with them. Scaled, the
    excess a try of one slot measured at 32 rows (1.6-2.3x its forwards) kept plain ahead
    of plans whose steps measured 1.16x theirs."""
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    policy.measured = {True: [33.0, 0.33, 33.0, 0.55], False: [32.0, 0.32, 32.0, 0.34]}
    plan = (100, 0.0, 120.0, 0.8)       # (slots, rate, tokens, seconds): a plan of 100 slots
    assert policy._corrected_rate(plan) == pytest.approx(120.0 / (0.8 + 0.22))
    assert policy._corrected_rate(plan) > 32 / 0.34 * 1.05 > 120.0 / 0.8 / (0.55 / 0.33)
    policy.measured[True][2] = 16.5      # half the tokens predicted: half the rate
    assert policy._corrected_rate(plan) == pytest.approx(60.0 / (0.8 + 0.22))


def test_the_lead_is_weighed_on_every_row_though_a_try_drafts_for_few():
    """While plain leads, a try drafts only for the rows least behind; whether speculation
    takes the lead is still weighed on the plan over every row (what it makes once it leads
    and the drafts keep up): weighed on the few rows a try drafts for, speculation at a
    batch of far-behind rows would never look better than plain, and never lead again."""
    from batchspec.spec.policy import EXPLORE, TRY_STEPS
    # a draft forward costs a quarter of a plain step however many rows it runs: drafting
    # for one row loses, drafting for eight wins
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [0.02] * 3})
    seqs = rows_with(policy, 8, "d", 0.9)
    for seq in seqs[1:]:                 # seven rows' drafts are far behind
        seq.prompt_token_ids = seq.token_ids = [1] * 1000
    set_slowdowns(policy, 1.0, 1.0)
    policy._winner = False
    policy._tried_in_full = True        # (a later try than the mix's first)
    rows = [(s, "d", 4, True) for s in seqs]
    picks = []
    for _ in range(EXPLORE + TRY_STEPS):    # plain, then a try: its steps as predicted
        picks.append(policy.choose_lengths(rows, 0))
        if policy._chosen is not None:
            policy.observe(policy._chosen[2], policy._chosen[1])
    assert picks[:EXPLORE - 1] == [[0] * 8] * (EXPLORE - 1)
    assert all(p[0] > 0 and p[1:] == [0] * 7 for p in picks[EXPLORE - 1:])  # drafts for
    # the least behind ...
    assert policy.choose_lengths(rows, 0) == [4] * 8      # ... and speculation leads
    assert policy._winner is True


def test_each_mix_of_temperatures_keeps_its_own_measurements_and_lead():
    """Speculation measured as losing at T = 0.8 does not make rows at T = 0 run plain, nor
    the other way round: each mix of temperatures keeps its measurements and its lead, and
    finds them again when it comes back (an engine serving one job after another)."""
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    greedy = rows_with(policy, 4, "d", 0.9)
    sampled = rows_with(policy, 4, "d", 0.9)
    for seq in sampled:
        seq.params = SamplingParams(temperature=0.8)
        src, dom = policy._pool_keys(seq, "d")
        policy.pooled[src] = policy.pooled[dom] = ([900] * 4, [1000] * 4)

    def run(seqs, steps, spec_speed):
        picks = []
        for _ in range(steps):
            picks.append(any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)))
            if policy._chosen is not None:
                speculate, tokens, seconds, _ = policy._chosen
                policy.observe(seconds, tokens * (spec_speed if speculate else 1.0))
        return picks
    run(sampled, 60, 1 / 6)                  # at T = 0.8 speculation loses: plain leads
    assert policy._winner is False
    assert sum(run(greedy, 20, 1.0)) >= 16   # T = 0 starts afresh and speculates (but for
    #                                          a try of plain)
    assert run(sampled, 5, 1 / 6) == [False] * 5 and policy._winner is False
    assert sum(run(greedy, 5, 1.0)) >= 4 and policy._winner is True
    from batchspec.spec.policy import MAX_MIXES
    for i in range(MAX_MIXES + 10):           # many jobs' temperatures: a bounded state
        sampled[0].params = SamplingParams(temperature=0.1 * (i % 20), top_k=i)
        sampled[1].params = SamplingParams(temperature=0.1 * (i // 20))
        run(sampled[:2], 1, 1.0)
    assert len(policy._mixes) <= MAX_MIXES


def test_a_try_that_shows_the_other_side_ahead_hands_it_the_lead():
    from batchspec.spec.policy import EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 4.5, 1.0)     # plain leads, speculation close behind
    picks = []
    for _ in range(EXPLORE + 6):
        lengths = policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
        picks.append(any(lengths))
        if policy._chosen is not None and policy._chosen[0]:   # speculation delivers
            _, tokens, seconds, _ = policy._chosen
            policy.observe(seconds, tokens)
    assert picks[:EXPLORE - 1] == [False] * (EXPLORE - 1)
    assert all(picks[EXPLORE - 1:]) and policy._winner is True


@pytest.mark.parametrize("spec_slowdown,leads", [(3.7, False), (3.5, True)])
def test_the_side_behind_takes_the_lead_only_when_clearly_ahead(spec_slowdown, leads):
    """Plain leads; a try measures speculation's corrected rate 10% above plain's (3.7) or
    16% (3.5): within SWITCH_MARGIN it stays behind (sides within noise of each other would
    trade the lead, each switch costing the drafts' catch-up), beyond it takes the lead."""
    from batchspec.spec.policy import EXPLORE, SWITCH_MARGIN, TRY_STEPS
    assert 1.10 <= SWITCH_MARGIN < 1.16
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 4.5, 1.0)            # close behind in its last try
    policy._winner = False
    for _ in range(EXPLORE + TRY_STEPS + 1):   # plain steps, then a try of speculation
        policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
        if policy._chosen is not None:     # the try measures spec_slowdown
            speculate, tokens, seconds, _ = policy._chosen
            policy.observe(seconds * (spec_slowdown if speculate else 1.0), tokens)
    assert policy._winner is leads


@pytest.mark.parametrize("spec_slowdown,keeps,falls_to",
                         [(4.2, False, None), (3.9, True, None), (3.9, True, 0.3)])
def test_speculation_keeps_the_lead_only_while_ahead(spec_slowdown, keeps, falls_to):
    """Speculation leads, its steps measuring 3% below plain's rate (4.2) or 5% above
    (3.9); a try of plain then measures plain. Within SWITCH_MARGIN of plain, speculation
    lost the lead only when the try showed plain ahead by the margin, so a lead up to 5%
    slower than plain held to the end of a job; now plain takes it back once ahead at all,
    and speculation ahead keeps it. That holds on the lead's measured steps, not on the one
    plan weighed as the try ends: with the rows' estimates fallen there (0.9 to 0.3,
    falls_to), a plan that prices speculation far below plain, speculation measured ahead
    keeps the lead (weighed on that plan alone, plain took it: at 8 rows and T = 0.8, where
    speculation makes 1.2-1.3x plain, plain then led for 85 steps of a job)."""
    from batchspec.spec.policy import EXPLORE, TRY_STEPS
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, spec_slowdown, 1.0)
    policy._winner = True
    picks = []
    for i in range(EXPLORE + TRY_STEPS + 3):   # speculating steps, a try of plain, and on
        if falls_to is not None and i == EXPLORE + TRY_STEPS:   # the step the try ends on
            seqs = rows_with(policy, 4, "d", falls_to)
        picks.append(any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)))
        if policy._chosen is not None:
            speculate, tokens, seconds, _ = policy._chosen
            policy.observe(seconds * (spec_slowdown if speculate else 1.0), tokens)
    assert picks[EXPLORE - 1:EXPLORE + TRY_STEPS] == [False] * (TRY_STEPS + 1)  # the try
    assert policy._winner is keeps
    assert picks[-1] is keeps


def test_the_side_behind_takes_the_lead_only_after_a_try_shows_it_ahead():
    """Speculation lost a little in its last try (4.5x slower than predicted: 0.91 of
    plain's rate); since then the machine slowed by a third, which plain's steps measured
    and speculation's did not. Weighed on those, speculation looks ahead (1.18x); it is
    tried instead of handed the lead, and a try at the new speed keeps plain in the lead.
    A try that does show it ahead hands it the lead."""
    from batchspec.spec.policy import EXPLORE, TRY_STEPS

    def run(spec_slowdown):
        policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
        seqs = rows_with(policy, 4, "d", 0.9)
        set_slowdowns(policy, 4.5, 1.3)
        policy._winner = False
        picks = []
        for _ in range(EXPLORE + TRY_STEPS + 1):
            picks.append(any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)))
            if policy._chosen is not None:
                speculate, tokens, seconds, _ = policy._chosen
                policy.observe(seconds * (spec_slowdown if speculate else 1.3), tokens)
        return picks, policy._winner
    plain_first = [False] * (EXPLORE - 1)
    assert run(4.5 * 1.3) == (plain_first + [True] * (TRY_STEPS + 1) + [False], False)
    assert run(2.0) == (plain_first + [True] * (TRY_STEPS + 2), True)


def test_a_step_whose_lookups_found_nothing_leaves_the_lead_where_it_was():
    """Speculation from a lookup source leads at one row; in a step where the lookup finds
    nothing the row runs plain. That says nothing of which side is faster: speculation keeps
    the lead (and drafts again in the next step that finds drafts), no try starts, and the
    step is measured as a plain one."""
    policy = make_policy(flat(lambda b, q: 0.01 * b))
    seq = rows_with(policy, 1, "suffix", 0.9)[0]
    set_slowdowns(policy, 1.0, 1.0)
    policy._winner, policy._speculated = True, True   # speculating for a while
    for found in (3, 0, 0, 2, 0, 4):
        lengths = policy.choose_lengths([(seq, "suffix", found, False)], 0)
        assert lengths == [found]
        assert policy._winner is True and not policy._try_left and not policy._trying
        speculate, tokens, seconds, tried = policy._chosen
        assert speculate is bool(found) and not tried
        policy.observe(seconds, tokens)
    assert policy.observed[False] == 3 and policy.observed[True] == 3
    assert policy._since == 6


def test_a_try_that_ends_as_the_mix_changes_hands_no_lead_over():
    """A try of speculation at T = 0.8 measures its steps and ends just as the batch's mix
    of temperatures changes: the next weighing is the new mix's, on that mix's own (older)
    measurements, and must not take them as a try's fresh ones and switch on them."""
    from batchspec.spec.policy import EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    greedy = rows_with(policy, 4, "d", 0.9)
    sampled = rows_with(policy, 4, "d", 0.9)
    for seq in sampled:
        seq.params = SamplingParams(temperature=0.8)
    policy._use_mix(policy.mix_of(greedy), len(greedy))   # (the band the steps below run in)
    set_slowdowns(policy, 3.5, 1.0)        # T = 0: speculation leads, plain 1.17x behind
    policy._winner = True
    policy._use_mix(policy.mix_of(sampled), len(sampled))
    policy._fresh = True                   # a try at T = 0.8 has just measured its steps
    policy._use_mix(policy.mix_of(greedy), len(greedy))
    set_slowdowns(policy, 4.5, 1.0)        # older measurements: plain now looks ahead
    for _ in range(EXPLORE - 1):
        policy.choose_lengths([(s, "d", 4, True) for s in greedy], 0)
        assert policy._winner is True      # a try of plain first, not a switch


def lead_after_a_try(lead_factor, num_steps):
    """Plain leads and has held off speculation's tries to every MAX_EXPLORE steps; a try of
    speculation is due (the budget holds it not back) and measures 3.5x its predicted seconds
    (1.17x plain's rate: it takes the lead); the lead's steps, over every row, measure
    lead_factor x theirs, plain's steps as predicted. Returns the policy and the side of each
    of num_steps steps (True: speculated)."""
    from batchspec.spec.policy import MAX_EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 3.5, 1.0)
    policy._winner, policy._interval = False, MAX_EXPLORE
    policy._since = MAX_EXPLORE - 1         # its try is due
    policy._busy_s = 100.0                  # (the budget holds no try back)
    sides = []
    for _ in range(num_steps):
        if policy.plain_step(seqs, 4):
            speculate = False
        else:
            speculate = any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0))
        sides.append(speculate)
        if policy._chosen is not None:
            _, tokens, seconds, tried = policy._chosen
            policy.observe(seconds * (1.0 if not speculate else 3.5 if tried else lead_factor),
                           tokens)
        else:                     # a step that catches up (not measured): as predicted
            policy._count_try(0.04, 4)
    return policy, sides


def test_a_lead_reversed_by_the_first_try_counts_as_exploration():
    """A try of speculation (which drafts for the rows whose drafts are not behind) shows it
    1.17x ahead, so it takes the lead; over every row it makes 0.91x plain's rate, and the
    first try of plain hands the lead back. The lead's steps beyond plain's pace count
    against the tries' budget, and speculation is next tried after MAX_EXPLORE steps, not
    EXPLORE: otherwise such a lead is taken and lost every few tens of steps."""
    from batchspec.spec.policy import EXPLORE, MAX_EXPLORE, TRY_STEPS
    policy, sides = lead_after_a_try(4.5, 2 * MAX_EXPLORE + EXPLORE)
    took = sides.index(True) + TRY_STEPS + 1       # the try, then speculation leads ...
    assert sides[took:took + 2] == [True, True]
    back = sides.index(False, took)                # ... until the first try of plain
    later = sides[back:]
    assert (later.index(True) if True in later else len(later)) >= MAX_EXPLORE  # next
    # tried MAX_EXPLORE steps on
    assert policy._winner is False
    assert policy._explore_s > 0.0                 # its lead's excess was counted


@pytest.mark.parametrize("lead_factor, early", [(4.5, True), (3.5, False)])
def test_a_new_lead_its_own_steps_measure_behind_plain_is_tried_against_plain_at_once(
        lead_factor, early):
    """A try of speculation (drafting for the rows least behind) hands it the lead, and over
    every row its steps measure lead_factor x their predicted seconds. Measured behind plain
    (4.5x: 0.91x plain's rate), plain is tried as soon as the lead's own steps have measured
    TRY_STEPS, not EXPLORE steps after the switch: at 32 rows and T = 0.8 such leads ran
    at 0.7 of plain's pace until then. Measured ahead (as fast as the try: 1.17x), the lead
    holds, and plain is tried at the interval as before."""
    from batchspec.spec.policy import EXPLORE, TRY_STEPS
    _, sides = lead_after_a_try(lead_factor, 3 * EXPLORE)
    took = sides.index(True) + TRY_STEPS + 1       # the try, then speculation leads
    back = sides.index(False, took) if False in sides[took:] else len(sides)
    # the lead's first step (its catch-up, not measured), TRY_STEPS measured, then plain
    assert (back - took <= TRY_STEPS + 2) is early
    assert back - took >= TRY_STEPS + 1


def test_a_first_lead_reversed_by_a_try_is_not_charged_to_the_budget():
    """No side has led yet at this mix and band: the start-up costs hand speculation the
    lead, it measures 4.5x slower than predicted (a job's first steps, where rows have no
    text yet for lookups to draft from), and the first try of plain shows plain ahead. That
    lead was the start-up's choice, not a try: nothing is charged to the tries' budget (at
    a job's start, the charge of such a lead held every try back for the next 400 steps of
    the job), and speculation, now as fast as predicted, is tried and leads again soon."""
    from batchspec.spec.policy import EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    sides, lost = [], None
    for step in range(6 * EXPLORE):
        if policy.plain_step(seqs, 4):
            speculate = False
        else:
            speculate = any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0))
        sides.append(speculate)
        if lost is None and policy._winner is False:
            lost = step
            assert policy._explore_s == 0.0
        if policy._chosen is not None:
            _, tokens, seconds, _ = policy._chosen
            policy.observe(seconds * (4.5 if speculate and lost is None else 1.0), tokens)
    assert sides[0] is True and lost is not None  # the start-up's choice, reversed ...
    assert policy._winner is True                  # ... and speculation leads again
    assert True in sides[lost:lost + 3 * EXPLORE]


def test_each_band_of_batch_sizes_keeps_its_own_measurements_and_lead():
    """What a step costs besides the forwards weighs far more at a few rows than at 32: the
    steps at a job's end, its last rows finishing a few at a time, measure speculation
    slower than predicted, and must not carry that to the next job's full batches."""
    from batchspec.spec.policy import batch_band
    assert batch_band(32) == batch_band(31) == batch_band(24) != batch_band(16)
    assert batch_band(1) != batch_band(2) != batch_band(4) != batch_band(8)
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 32, "d", 0.9)

    def run(rows, steps, spec_speed):
        for _ in range(steps):
            if not policy.plain_step(rows, len(rows)):
                policy.choose_lengths([(s, "d", 4, True) for s in rows], 0)
            if policy._chosen is not None:
                speculate, tokens, seconds, _ = policy._chosen
                policy.observe(seconds, tokens * (spec_speed if speculate else 1.0))
    run(seqs, 30, 1.0)                        # full batches: speculation leads
    assert policy._winner is True
    full = {side: list(v) for side, v in policy.measured.items()}
    policy._busy_s = 1000.0                   # (the budget holds no try back)
    run(seqs[:2], 30, 1 / 8)                  # the job's last two rows: it loses there
    assert policy._winner is False
    run(seqs, 1, 1.0)                         # the next job's first step
    assert policy._winner is True and policy.measured == full


def test_prompt_work_beside_a_try_is_not_charged_to_the_tries_budget():
    """Prompts that new rows run beside a step are work either side does: a try's step
    beside the prompts of many new rows (0.4 s at 32 rows, which spent the budget of 40 s
    of steps and held every later try off) is charged nothing, and a step beside a few
    prompt tokens is charged only what it took beyond them."""
    from batchspec.spec.policy import PROMPT_TIMED
    policy = make_policy(flat(lambda b, q: 0.01 * b))
    policy.costs.prompt_token_s = 1e-4
    set_slowdowns(policy, 1.0, 1.0)
    pace = policy.costs.target_s(4, 1)         # the leader's measured seconds per token
    policy._winner, policy._trying = False, True
    many = 30 * PROMPT_TIMED
    policy._count_try(4 * pace + many * 1e-4, 4, many)
    assert policy._explore_s == 0.0
    assert policy._busy_s == pytest.approx(4 * pace)
    policy._count_try(4 * pace + PROMPT_TIMED * 1e-4, 4, PROMPT_TIMED)
    assert policy._explore_s == pytest.approx(0.0, abs=1e-12)
    policy._count_try(5 * pace, 4)             # a try's step 1.25x the leader's pace
    assert policy._explore_s == pytest.approx(pace)
    policy._trying, policy._unconfirmed = False, [0.0, 0]   # a lead not yet confirmed
    policy._count_try(4 * pace + many * 1e-4, 4, many)
    assert policy._unconfirmed == [0.0, 0]
    policy._count_try(4 * pace + PROMPT_TIMED * 1e-4, 4, PROMPT_TIMED)
    assert policy._unconfirmed == [pytest.approx(4 * pace), 4]


def test_only_a_side_far_behind_is_held_off_as_far():
    """A side is tried only every FAR_EXPLORE steps when it is far *behind* the leader.
    Speculation far ahead of a leading plain (its plan 4x plain's, while the tries' budget
    holds its try back) is not far: plain leading is what is in doubt."""
    from batchspec.spec.policy import MAX_EXPLORE
    for winner in (False, True):
        policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
        seqs = rows_with(policy, 4, "d", 0.9)
        set_slowdowns(policy, 1.0, 1.0)
        policy._winner, policy._since = winner, MAX_EXPLORE - 1
        policy._explore_s = 1.0                # no budget left for a try
        policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
        assert policy._winner is winner
        assert policy._far is winner           # plain far behind speculation's lead only


def test_a_try_of_plain_close_behind_a_lead_of_speculation_is_not_held_to_the_budget():
    """While speculation leads, a try of plain that is close behind (within TRY_MARGIN) runs
    at the try interval even with the tries' budget spent: tries of speculation at 32 rows
    and T = 0.8 spent it, and a lead that speculation took there (0.94-0.96x plain) held for
    whole jobs with no try of plain to end it. A plain far behind is still held back."""
    from batchspec.spec.policy import MAX_EXPLORE

    def tried(spec, plain):
        policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
        seqs = rows_with(policy, 4, "d", 0.9)
        set_slowdowns(policy, spec, plain)
        policy._winner, policy._speculated = True, True
        policy._interval = policy._since = MAX_EXPLORE
        policy._explore_s = 1.0                # no budget left for a try
        policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
        assert policy._winner is True
        return policy._trying
    assert tried(4.0, 1.0)          # speculation's corrected rate 1.02x plain's: close
    assert not tried(3.5, 1.0)      # 1.17x: plain far behind (below TRY_MARGIN)
    assert not tried(1.0, 1.0)      # 4x


def test_a_try_of_a_side_judged_ahead_is_not_held_to_the_budget():
    """Plain leads and a weighing finds speculation ahead of it: speculation is tried at once,
    whatever the tries' budget. A templated job's first tries of suffix drafts, over rows
    that found little to draft, spent the budget, and the try that would have handed
    speculation the lead once the job-wide trie had filled waited: `suffix-adaptive` made
    1.10x plain where it makes 1.6-1.7x."""
    from batchspec.spec.policy import MAX_EXPLORE
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.9)
    set_slowdowns(policy, 1.0, 1.0)          # speculation's plan 4x plain's
    policy._winner, policy._since = False, MAX_EXPLORE - 1     # (a weighing is due)
    policy._explore_s = 1.0                  # no budget left for a try
    lengths = policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)
    assert policy._winner is False and policy._trying and any(lengths)


def test_a_band_first_seen_starts_from_what_the_band_it_comes_from_measured():
    """The last rows of a job enter a smaller band of batch sizes: under the same mix its
    measurements start as copies of the band left (its own steps replace them), so its
    first lead is weighed on them, not on the start-up costs alone, and its first try needs
    not draft for every row where the band left had such a try; under another mix, or in a
    band seen before, its own state."""
    policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 32, "d", 0.9)
    mix = policy.mix_of(seqs)
    policy._use_mix(mix, 32)
    set_slowdowns(policy, 4.5, 1.0, rows=32)     # speculation measured behind plain
    policy._winner, policy._tried_in_full = False, True
    full_batches = {side: list(m) for side, m in policy.measured.items()}
    policy._use_mix(mix, 4)
    assert policy._winner is None and policy.observed == {} and policy._tried_in_full
    assert policy.measured == {True: policy._mixes[(mix, 5)][0][True],
                               False: policy._mixes[(mix, 5)][0][False]}
    assert policy.measured[True] is not policy._mixes[(mix, 5)][0][True]   # (a copy)
    assert not any(policy.choose_lengths([(s, "d", 4, True) for s in seqs[:4]], 0))
    assert policy._winner is False        # the start-up costs alone gave it to speculation
    seconds = 10 * policy._chosen[2]      # its first plain step, 10x the seed's pace: as is
    policy.observe(seconds, 4)
    assert policy.measured[False][3] == pytest.approx(seconds)
    policy._use_mix((0.8,), 2)
    assert policy.measured == {} and not policy._tried_in_full   # another mix: nothing
    policy._use_mix(mix, 32)              # a band seen before: its own state again
    assert policy.measured == full_batches and policy._winner is False


def routed_row(policy, p_model, p_lookup):
    """A row served by model draft "d" (each depth accepted with p_model) and routed to
    lookup source "look" (p_lookup)."""
    seq = rows_with(policy, 1, "d", p_model)[0]
    seq.spec.source_depth["look"] = \
        rows_with(policy, 1, "look", p_lookup)[0].spec.source_depth["look"]
    return seq


def test_routing_weighs_a_rows_sources_at_the_steps_batch_size():
    """A routed row's model promises more tokens a round than the lookup's two drafts, and
    each model draft costs a tenth of a decode step. At one row, where a window of 5 costs
    1.05 decode steps, the model's drafts pay more; at 32 rows, where it costs 3 and each
    verified token half a decoded one, the lookup's fewer, free drafts do. Without measured
    costs (no adaptive_k), drafts are weighed on draft passes alone."""
    policy = make_policy({})
    policy.costs = StepCosts([1, 32], target={
        q: [0.01 * (1 + 0.0125 * (q - 1)), 0.04 * (1 + 0.5 * (q - 1))] for q in range(1, 6)},
        draft={"d": [0.001, 0.0064]})
    assert policy.costs.verified_token_s(32) == pytest.approx(0.5 * 0.04 / 32)
    seq = routed_row(policy, 0.8, 0.7)
    assert not policy.prefer_lookup(seq, "d", "look", 2, 0.1, num_rows=1)
    assert policy.prefer_lookup(seq, "d", "look", 2, 0.1, num_rows=32)
    assert not policy.prefer_lookup(seq, "d", "look", 0, 0.1, num_rows=32)  # found none
    policy.costs = None
    assert not policy.prefer_lookup(seq, "d", "look", 2, 0.1, num_rows=32)


def test_plans_admit_slots_by_survival_per_cost():
    """Rows drafting from a model (survival 0.9 a depth) beside rows drafting from a lookup
    (0.8), at 8 rows where a model draft's row of forward costs half what a verified token
    does: a lookup's free draft is worth more per second, so the lookup's first two depths
    come before the model's first. With one source, survival decides."""
    policy = make_policy({q: [0.01 * q, 0.04 * q, 0.3 * q] for q in range(1, 6)},
                         {"d": [0.005, 0.02, 0.15]})
    model = rows_with(policy, 4, "d", 0.9)
    lookup = rows_with(policy, 4, "look", 0.8)
    rows = [(s, "d", 4, True) for s in model] + [(s, "look", 4, False) for s in lookup]
    probs = [policy.depth_probs(s, src, n) for s, src, n, _ in rows]
    order, row, depth = policy._plan(rows, probs, set(), 8)[4:7]
    slots = [(rows[row[j]][1], depth[j]) for j in order]
    assert slots[:4] == [("look", 0)] * 4       # by survival alone: ("d", 0) first
    assert slots.index(("d", 0)) > slots.index(("look", 1))
    model_only = rows[:4]
    order, row, depth = policy._plan(model_only, probs[:4], set(), 4)[4:7]
    assert [depth[j] for j in order] == sorted(depth[j] for j in order)


def test_a_drafts_measured_calls_scale_its_cost_in_routing_not_in_plans():
    """A model draft's calls measured at three times what the start-up costs predict for
    the levels they ran: once DRAFT_TIMED_MIN are timed, a routed row that took the model's
    drafts at one row takes the lookup's; plans still price a slot at the draft's forward
    (what a call takes beyond it is the call's own, not a slot's); a step not predicted
    (no lengths chosen) is not timed."""
    from batchspec.spec.policy import DRAFT_TIMED_MIN
    policy = make_policy({})
    policy.costs = StepCosts([1, 32], target={
        q: [0.01 * (1 + 0.0125 * (q - 1)), 0.04 * (1 + 0.5 * (q - 1))] for q in range(1, 6)},
        draft={"d": [0.001, 0.0064]})
    seq = routed_row(policy, 0.8, 0.7)
    assert not policy.prefer_lookup(seq, "d", "look", 2, 0.1, num_rows=1)
    rows = [(seq, "d", 4, True)]
    probs = [policy.depth_probs(seq, "d", 4)]
    target_s = policy.costs.target_tokens_s(1, 5)    # 4 drafts and the row's token
    before = policy._plan(rows, probs, set(), 1)
    policy.observe_draft("d", 1.0)                  # nothing predicted: not timed
    assert policy.draft_scale("d") == 1.0
    for _ in range(DRAFT_TIMED_MIN):
        policy._draft_pred = policy._levels_s(rows, [4])
        assert policy._draft_pred == {"d": pytest.approx(4 * 0.001)}
        policy.observe_draft("d", 3 * 4 * 0.001)
    assert policy.draft_scale("d") == pytest.approx(3.0)
    after = policy._plan(rows, probs, set(), 1)
    assert before[0] == after[0] == 4
    assert before[3] == after[3] and before[3] - target_s == pytest.approx(4 * 0.001)
    assert policy.prefer_lookup(seq, "d", "look", 2, 0.1, num_rows=1)


def test_a_row_sampled_pays_what_sampling_adds_to_each_of_its_slots():
    """At T > 0 a slot also costs verification's sampling and a model draft's draw
    (StepCosts.verify_token_s, draft_sample_s, timed at start-up): a plan's seconds carry
    them for the sampled rows' slots only, and dear enough, they buy fewer slots."""
    costs = StepCosts([1, 32], target={
        q: [0.01 * (1 + 0.0125 * (q - 1)), 0.04 * (1 + 0.5 * (q - 1))] for q in range(1, 6)},
        draft={"d": [0.001, 0.0064]})
    policy = make_policy({})
    policy.costs = costs
    cold, hot = rows_with(policy, 2, "d", 0.8)
    cold.params = SamplingParams(temperature=0.0)
    hot.params = SamplingParams(temperature=0.8)
    rows = [(cold, "d", 4, True), (hot, "d", 4, True)]
    probs = [policy.depth_probs(seq, "d", 4) for seq, *_ in rows]
    free = policy._plan(rows, probs, set(), 2)
    costs.verify_token_s, costs.draft_sample_s["d"] = 1e-4, 2e-4
    priced = policy._plan(rows, probs, set(), 2)
    assert free[0] == priced[0] == 8
    assert priced[3] - free[3] == pytest.approx(4 * 3e-4)    # the hot row's four slots
    costs.draft_sample_s["d"] = 0.01
    dear = policy._plan(rows, probs, set(), 2)
    order, row = dear[4:6]
    assert dear[0] == 4 and {row[j] for j in order[:dear[0]]} == {0}


def test_a_routed_rows_unused_lookup_drafts_are_judged_against_what_it_commits(
        tiny_llama):
    """Lookup drafts a routed row did not take count in the lookup's estimates as if
    verified: judged up to the first that differs from the committed token, and none past
    the committed tokens. In a run whose model draft is the target itself (every draft
    accepted), routed rows take the model's drafts in most rounds, and the lookup's
    estimates are still judged on more rounds than it drafted."""
    from batchspec.spec.proposer import Proposal
    llm = LLM(tiny_llama, drafts={"default": f"{tiny_llama}+suffix"}, device="cpu",
              min_acceptance=0.0, max_num_seqs=4, adaptive_k=True)
    engine, lookup = llm.engine, "default+suffix"
    # timings pinned: verification free, drafts nearly so (the routing is under test)
    engine.policy.costs = StepCosts([1, 4], target={q: [0.01, 0.04] for q in range(1, 6)},
                                    draft={"default": [1e-4, 1e-4]})
    seq = Sequence(0, "0", [1, 2], SamplingParams(temperature=0.0), seed=0)
    key, _ = engine.policy._pool_keys(seq, lookup)
    record = engine.policy.record_rounds
    record([engine._judge_unused(seq, lookup, Proposal([5, 6, 7], None), [5, 6, 9])])
    assert engine.policy.pooled[key] == ([1, 1, 0], [1, 1, 1])
    record([engine._judge_unused(seq, lookup, Proposal([5, 6, 7], None), [5])])
    assert engine.policy.pooled[key] == ([2, 1, 0], [2, 1, 1])
    engine.policy.pooled.clear()
    outs = llm.generate(["def f(x): return x + x + x + x"] * 4,
                        SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    lookup_rounds = sum(src == "suffix" for o in outs for src in o.stats["round_source"])
    judged = engine.policy.pooled[key][1][0]
    assert judged > lookup_rounds


def test_while_plain_leads_no_source_drafts_between_weighings(tiny_llama):
    """A step that runs plain because plain leads (plans are weighed only every EXPLORE
    steps) costs what a plain engine's step does: no source drafts for it, lookups neither
    (they used to draft every row, and their drafts were then dropped), and the scheduler
    reserves no draft slots for it (they used to cost a block now and then, allocated and
    freed in the same step)."""
    from batchspec.spec.policy import EXPLORE
    llm = LLM(tiny_llama, drafts={"default": "suffix"}, device="cpu", min_acceptance=0.0,
              adaptive_k=True)
    engine = llm.engine
    proposer = engine.proposers["default"]
    calls, slots = [], []
    real = proposer.propose
    proposer.propose = lambda rows, *into: calls.append(len(rows)) or real(rows, *into)
    schedule = engine.scheduler.schedule

    def counted(*args, **kwargs):
        scheduled = schedule(*args, **kwargs)
        slots.append(sum(s.max_drafts for s in scheduled))
        return scheduled

    engine.scheduler.schedule = counted
    engine.policy._winner = False       # plain leads (the first mix seen keeps this state)
    for i, prompt in enumerate(([1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4, 5])):
        engine.add_request(llm.make_request(prompt, SamplingParams(max_tokens=40,
                                                                   ignore_eos=True), str(i)))
    engine.step()                        # prefill
    for _ in range(EXPLORE - 1):
        engine.step()
        assert not calls and slots[-1] == 0
    engine.step()                        # the plans are weighed: the lookup drafts
    assert calls == [2] and slots[-1] == 2 * engine.config.num_speculative_tokens


def test_speculating_steps_whose_drafts_catch_up_are_measured(tiny_llama):
    """A new row's first speculating step also runs its draft over the row's prompt: a cost
    speculation pays and plain does not, so the step is measured like any other (left out,
    speculation's measured steps were its cheap ones at 32 rows, where a row joins nearly
    every step)."""
    llm = LLM(tiny_llama, drafts={"default": tiny_llama}, device="cpu", min_acceptance=0.0,
              adaptive_k=True, max_num_seqs=2, num_speculative_tokens=4)
    engine, policy = llm.engine, llm.engine.policy
    # verification free, drafts nearly so: every step speculates (no plain step is ever
    # measured, so the two sides' corrections stay alike)
    policy.costs = StepCosts([1, 2], target={q: [0.01, 0.02] for q in range(1, 6)},
                             draft={"default": [1e-4, 1e-4]})
    proposer = engine.proposers["default"]
    step_lag, seen = [0], []
    real_propose, real_observe = proposer.propose, policy.observe

    def propose(rows, *args):
        step_lag[0] = max(step_lag[0], *(len(seq) - seq.spec.num_draft_computed
                                         for seq, _ in rows))
        return real_propose(rows, *args)

    def observe(seconds, tokens, *args, **kwargs):
        if policy._chosen is not None and policy._chosen[0]:
            seen.append(step_lag[0])
        return real_observe(seconds, tokens, *args, **kwargs)

    proposer.propose, policy.observe = propose, observe
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10] for i in range(4)]
    for i, prompt in enumerate(prompts):
        engine.add_request(llm.make_request(prompt, SamplingParams(max_tokens=6,
                                                                   ignore_eos=True), str(i)))
    while engine.has_unfinished():
        step_lag[0] = 0
        engine.step()
    k = llm.engine.config.num_speculative_tokens
    assert any(lag > k + 1 for lag in seen)    # a step that caught a prompt up, measured


def test_while_plain_leads_plans_are_weighed_only_when_a_try_may_be_due():
    """The engine asks plain_step first and weighs plans (choose_lengths) only when it says
    no. A model draft far behind: plans are weighed every MAX_EXPLORE steps and a try starts
    at FAR_EXPLORE; close behind: at the try interval. Steps in between cost nothing extra.
    Lookup rows: every EXPLORE steps; while far behind, after gaps that double from EXPLORE
    to MAX_EXPLORE steps."""
    from batchspec.spec.policy import EXPLORE, FAR_EXPLORE, MAX_EXPLORE, TRY_STEPS
    for spec_slowdown in (8.0, 4.5):   # the model's 4x lead measured away: far, close behind
        policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
        seqs = rows_with(policy, 4, "d", 0.9)
        set_slowdowns(policy, spec_slowdown, 1.0)
        policy._winner, policy._far = False, spec_slowdown > 5
        weighed, tried = [], []
        for step in range(1, FAR_EXPLORE + TRY_STEPS + 2):
            if policy.plain_step(seqs, 4):
                continue
            weighed.append(step)
            if any(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0)):
                tried.append(step)
        if policy._far:
            try_steps = list(range(FAR_EXPLORE, FAR_EXPLORE + TRY_STEPS + 1))
            assert tried == try_steps
            assert weighed == [*range(MAX_EXPLORE, FAR_EXPLORE, MAX_EXPLORE), *try_steps]
        else:
            assert tried[:TRY_STEPS + 1] == list(range(EXPLORE, EXPLORE + TRY_STEPS + 1))
            assert len(weighed) < FAR_EXPLORE // EXPLORE
    # rows drafting from lookups: what they find changes with the text (a job-wide trie
    # fills as rows finish), so plans are weighed every EXPLORE steps while speculation is
    # close behind; far behind (its rate below TRY_MARGIN of plain's at the last weighing),
    # after EXPLORE steps, then twice as many each time it is still far behind, up to
    # MAX_EXPLORE steps (a weighing over a job's first steps, where lookups have little text
    # to draft from, may find speculation far behind a few steps before it is ahead)
    assert 4 * EXPLORE < MAX_EXPLORE
    far = [EXPLORE, 2 * EXPLORE, 4 * EXPLORE, MAX_EXPLORE, 2 * MAX_EXPLORE]
    for spec_slowdown, expected in ((8.0, far), (4.5, list(range(EXPLORE, MAX_EXPLORE + 1,
                                                                   EXPLORE)))):
        policy = make_policy(flat(lambda b, q: 0.01 * b), {"d": [1e-4] * 3})
        seqs = rows_with(policy, 4, "d", 0.9)
        set_slowdowns(policy, spec_slowdown, 1.0)
        policy._winner, policy._far, policy._interval = False, spec_slowdown > 5, MAX_EXPLORE
        weighed = []
        for step in range(1, 2 * MAX_EXPLORE + 1):
            if not policy.plain_step(seqs, 4, lookups=True):
                weighed.append(step)
                policy.choose_lengths([(s, "d", 4, False) for s in seqs], 0, lookups=True)
                if policy._try_left:    # a try of speculation (close behind, at the interval)
                    break
        assert weighed == expected


@pytest.mark.parametrize("most_rows", [4, 40])
def test_plans_are_the_best_prefix_of_the_slot_order(most_rows):
    """A plan is the best prefix of its slots' order by expected tokens over the forwards'
    seconds plus extra_s, each prefix priced from the costs' public functions (the target
    over the prefix's tokens, each model draft's forward at each depth over the rows it
    drafts there, unscaled by the draft's measured ratio, and for each slot of a sampled
    row what sampling adds): over random rows, sources, temperatures, costs, survival ties
    and skipped rows, of up to 4 rows and up to 40."""
    import random
    rng = random.Random(0)
    for trial in range(200):
        b_costs = [rng.uniform(0.5, 2.0) for _ in range(3)]
        extra = rng.choice([0.0, 1e-4, 1e-3, 5e-3])
        target = {q: [0.01 * c * (1 + extra * (q - 1)) for c in b_costs] for q in range(1, 6)}
        policy = make_policy(target, {"a": [1e-3, 2e-3, 9e-3], "b": [2e-4, 5e-4, 4e-3]})
        if trial % 3 == 0:      # a draft whose calls measured slower than predicted
            policy._draft_timed["a"] = [1.0, 1.5, 10]
        if trial % 4 == 1:      # what sampling adds to a slot at T > 0
            policy.costs.verify_token_s = rng.choice([1e-4, 1e-3])
            policy.costs.draft_sample_s.update(a=rng.choice([0.0, 2e-3]), b=1e-4)
        num = rng.randint(1, most_rows)
        rows = []
        for _ in range(num):
            src = rng.choice(["a", "b", "look"])
            seq = rows_with(policy, 1, src, rng.choice([0.3, 0.6, 0.9, 0.9]))[0]
            seq.params = SamplingParams(temperature=rng.choice([0.0, 0.8]))
            rows.append((seq, src, rng.randint(1, 4), src != "look"))
        if trial % 2:          # survival ties within and across depths (0.5 * 0.5 = 0.25)
            probs = [[rng.choice([0.25, 0.5, 0.75]) for _ in range(n)] for _, _, n, _ in rows]
        else:
            probs = [[rng.random() for _ in range(n)] for _, _, n, _ in rows]
        skip = {i for i in range(num) if rng.random() < 0.2}
        num_rows = num + rng.randint(0, 3)
        extra_s = rng.choice([0.0, 1e-3])
        n, rate, tokens, seconds, order, row, depth, _ = policy._plan(
            rows, probs, skip, num_rows, extra_s)
        survive = {}
        for i, row_probs in enumerate(probs):
            if i not in skip:
                for d in range(len(row_probs)):
                    survive[i, d] = math.prod(row_probs[:d + 1])
        assert sorted(zip(row, depth)) == sorted(survive)
        slots = [(row[j], depth[j]) for j in order]
        if not slots:       # every row skipped: no plan
            assert (n, tokens, seconds) == (0, 0.0, 0.0)
            continue
        # each slot's key (survival, per second of cost where slots' prices differ), most
        # first
        token_s = policy.costs.verified_token_s(num_rows) + 1e-12
        sampled = [(policy.costs.verify_token_s + (policy.costs.draft_sample_s.get(r[1], 0.0)
                                                    if r[3] else 0.0))
                   if r[0].params.temperature > 0 else 0.0 for r in rows]
        differ = len({(r[1], r[3]) for r in rows}) > 1 or len(set(sampled)) > 1
        key = {}
        for i, d in slots:
            src, is_model = rows[i][1], rows[i][3]
            unit = token_s + sampled[i] + (policy.costs.draft_row_s(src, num)
                                           if is_model else 0.0)
            key[i, d] = survive[i, d] / unit if differ else survive[i, d]
        for (i, d), (i2, d2) in zip(slots, slots[1:]):
            assert (-key[i, d], d, i) <= (-key[i2, d2], d2, i2)
        best = None
        for m in range(1, len(slots) + 1):
            counts = {}
            for i, d in slots[:m]:
                if rows[i][3]:
                    counts[rows[i][1], d] = counts.get((rows[i][1], d), 0) + 1
            sec = policy.costs.target_tokens_s(num_rows, num_rows + m) + sum(
                policy.costs.draft_s(src, c) for (src, _), c in counts.items()) + \
                sum(sampled[i] for i, _ in slots[:m])
            tok = num_rows + sum(survive[s] for s in slots[:m])
            if best is None or tok / (sec + extra_s) > best[0] * (1 + 1e-9):
                best = (tok / (sec + extra_s), m, tok, sec)
        assert n == best[1], (trial, n, best)
        assert (tokens, seconds) == pytest.approx(best[2:], rel=1e-9)
        assert rate == pytest.approx(tokens / seconds, rel=1e-12)


def test_only_adaptive_or_routed_engines_keep_acceptance_estimates(tiny_llama):
    """The policy's per-depth estimates serve adaptive lengths and routing only: a fixed-k
    engine does not pay for them on every row of every step (about 3 us a row, 1% of a
    32-row step of suffix drafts)."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4, 5]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for adaptive in (False, True):
        llm = LLM(tiny_llama, drafts={"default": tiny_llama}, device="cpu",
                  min_acceptance=0.0, adaptive_k=adaptive)
        llm.engine.policy._winner = adaptive or None   # adaptive: speculation leads ...
        set_slowdowns(llm.engine.policy, 1.0, 100.0)   # ... far ahead
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert sum(o.stats["total_drafted"] for o in outs) > 0
        assert bool(llm.engine.policy.pooled) is adaptive



def test_the_batch_mix_follows_rows_that_join_and_leave(tiny_llama):
    """The engine keeps the rows that may draft, and their mix of temperatures, until the
    batch's rows change (scheduler.version): a row that finishes leaves the mix."""
    llm = LLM(tiny_llama, drafts={"default": "suffix"}, device="cpu", min_acceptance=0.0,
              adaptive_k=True, max_num_seqs=2)
    engine = llm.engine
    engine.policy._winner = False           # plain leads (the first mix seen keeps this)
    for i, (n, t) in enumerate(((3, 0.0), (30, 0.8))):
        engine.add_request(llm.make_request([1 + i, 2, 3, 4], SamplingParams(
            max_tokens=n, temperature=t, ignore_eos=True), str(i)))
    mixes, gone = [], False
    while engine.has_unfinished():
        finished, _ = engine.step()
        mixes.append((gone, engine.policy._mix))
        gone = gone or any(seq.request_id == "0" for seq in finished)
    assert (False, (0.0, 0.8)) in mixes
    assert {mix for after, mix in mixes if after} == {(0.8,)}


def test_what_a_step_costs_besides_the_forwards_buys_more_slots():
    """Scheduling, sampling and bookkeeping cost a step alike whatever slots it admits:
    plans weighed with the overhead speculating steps measured beyond their forwards admit
    slots that the forwards' costs alone would not (at 32-64 rows and T = 0, plans on the
    forwards alone made 3.27 tokens a pass where a fixed k = 4 made 3.73-3.82)."""
    policy = make_policy(flat(lambda b, q: 0.01 * b + 0.004 * b * (q - 1)), {"d": [1e-4] * 3})
    seqs = rows_with(policy, 4, "d", 0.7)
    rows = [(s, "d", 4, True) for s in seqs]
    set_slowdowns(policy, 1.0, 1.0)                  # steps measured as predicted
    bare = policy.choose_lengths(rows, 0)
    for side in (True, False):                       # each step 0.2 s beyond its forwards
        policy.measured[side][3] += 0.2
    loaded = policy.choose_lengths(rows, 0)
    assert 0 < sum(bare) < sum(loaded)
    assert policy._chosen[0] and policy._chosen[2] < 0.2    # predicted: the forwards alone


def test_a_step_weighs_its_plans_under_one_mix_of_temperatures(tiny_llama):
    """The policy keeps its measurements and lead per mix of temperatures of the rows that
    may draft. A step asks which mix it runs under once (before scheduling) and weighs its
    plans under the same: the plans' own rows used to give another mix whenever a row of
    another temperature was still running its prompt, and the switch to that mix and back
    dropped a try under way at every such step."""
    llm = LLM(tiny_llama, drafts={"default": "suffix"}, device="cpu", min_acceptance=0.0,
              adaptive_k=True, max_num_seqs=4)
    engine, policy = llm.engine, llm.engine.policy
    seen, real = [], policy._use_mix

    def use_mix(mix, num_rows=1):
        seen[-1].add(mix)
        return real(mix, num_rows)
    policy._use_mix = use_mix
    prompts = ["def f(x): return x + x + x + x"] * 12
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=4 + i % 5, seed=i)
              for i in range(len(prompts))]
    llm.add_requests(prompts, params)
    while engine.has_unfinished():
        seen.append(set())
        llm.step()
    assert any(len(s) == 1 and len(next(iter(s))) == 2 for s in seen)   # mixed batches ran
    assert all(len(s) <= 1 for s in seen), [s for s in seen if len(s) > 1]


def test_costs_at_a_context_add_what_each_rows_context_tokens_cost():
    """StepCosts timed at a context of 128 with what a row's context token adds below it and
    above it (per q for the target, per draft): at(ctx) shifts each shape by rows * (ctx -
    128) * the side's slope, to CONTEXT_STEP tokens, and never below half the time timed;
    costs without the slopes are their own at any context; smooth() puts the target's slopes
    on lines in q."""
    from batchspec.spec.policy import CONTEXT_STEP
    base = StepCosts([1, 4], target={1: [1.0, 2.0], 3: [1.5, 4.0], 5: [2.0, 6.0]},
                     draft={"d": [0.1, 0.2]})
    assert base.at(1000) is base
    costs = StepCosts([1, 4], target={1: [1.0, 2.0], 3: [1.5, 4.0], 5: [2.0, 6.0]},
                      draft={"d": [0.1, 0.2]}, context=128,
                      target_ctx={1: (1e-4, 2e-4), 3: (2.5e-4, 4e-4), 5: (3e-4, 6e-4)},
                      draft_ctx={"d": (1e-5, 1e-4)})
    costs.smooth()
    assert {q: s[0] for q, s in costs.target_ctx.items()} == pytest.approx(
        {q: 6.5e-4 / 3 + 5e-5 * (q - 3) for q in range(1, 6)})
    assert {q: s[1] for q, s in costs.target_ctx.items()} == pytest.approx(
        {q: 4e-4 + 1e-4 * (q - 3) for q in range(1, 6)})
    assert costs.at(128).target_s(4, 5) == pytest.approx(costs.target_s(4, 5))
    longer = costs.at(128 + 10 * CONTEXT_STEP + 3)        # (to CONTEXT_STEP tokens)
    assert longer is costs.at(128 + 10 * CONTEXT_STEP - 3)
    assert longer.target_s(4, 5) == pytest.approx(
        costs.target_s(4, 5) + 4 * 10 * CONTEXT_STEP * costs.target_ctx[5][1])
    assert longer.draft_s("d", 4) == pytest.approx(0.2 + 4 * 10 * CONTEXT_STEP * 1e-4)
    shorter = costs.at(128 - 4 * CONTEXT_STEP)
    assert shorter.target_s(4, 5) == pytest.approx(
        costs.target_s(4, 5) - 4 * 4 * CONTEXT_STEP * costs.target_ctx[5][0])
    assert shorter.draft_s("d", 4) == pytest.approx(0.2 - 4 * 4 * CONTEXT_STEP * 1e-5)
    # a verified token costs more at a longer context, where its window's attention reads more
    assert longer.verified_token_s(4) > costs.verified_token_s(4) > shorter.verified_token_s(4)
    assert costs.at(0).target_s(1, 1) == pytest.approx(max(
        costs.target_s(1, 1) - 128 * costs.target_ctx[1][0], 0.5 * costs.target_s(1, 1)))


def test_plans_and_predictions_price_a_step_at_its_rows_context():
    """Where a window's tokens read their row's context, rows with long contexts buy fewer
    slots than the same rows with short ones; a plain step is predicted at its rows'
    context too (what plain's measured slowdown is measured against)."""
    target = {q: [c * (1 + 0.1 * (q - 1)) for c in (0.002, 0.004, 0.03)] for q in range(1, 6)}
    slopes = {q: (2e-7 * q, 2e-7 * q) for q in range(1, 6)}
    counts = {}
    for ctx in (32, 2000):
        policy = make_policy(target, {"d": [1e-4, 1e-4, 1e-4]})
        policy.costs.context, policy.costs.target_ctx = 128, dict(slopes)
        seqs = rows_with(policy, 4, "d", 0.7)
        for seq in seqs:
            seq.token_ids = [1] * ctx
        counts[ctx] = sum(policy.choose_lengths([(s, "d", 4, True) for s in seqs], 0))
        policy._winner, policy._since, policy._try_left, policy._fresh = False, 0, 0, False
        assert policy.plain_step(seqs, 4)
        assert policy._chosen[2] == pytest.approx(policy.costs.at(ctx).target_tokens_s(4, 4))
    assert counts[2000] < counts[32]
