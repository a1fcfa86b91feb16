"""Suffix drafts: the depth-bounded suffix trie (counts, removal, matching), the proposer's
per-request and job-wide parts, and exactness in the engine (greedy equals plain; sampled
outputs follow the target's distribution)."""
import random

import pytest

from batchspec import LLM, SamplingParams
from batchspec.engine.sequence import Sequence
from batchspec.spec.policy import StepCosts
from batchspec.spec.suffix import SuffixProposer, SuffixTrie
from tests.test_spec import GREEDY, PROMPTS, assert_follows, check_record, exact_joint


def native_trie(depth):
    from batchspec.spec._build import cpu_module
    return cpu_module().SuffixTrie(depth)


# the Python trie and the C++ one (kernels/suffix_trie.cpp) behave the same
TRIES = pytest.mark.parametrize("make_trie", [SuffixTrie, native_trie], ids=["python", "cpp"])


def substring_counts(texts, depth):
    counts = {}
    for text in texts:
        for i in range(len(text)):
            for j in range(i + 1, min(i + depth, len(text)) + 1):
                counts[tuple(text[i:j])] = counts.get(tuple(text[i:j]), 0) + 1
    return counts


def trie_counts(trie):
    """{substring: count} with each node's children in the trie's order."""
    out, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        kids = trie.edges(node)
        for t, child in zip(kids[::2], kids[1::2]):
            out[path + (t,)] = trie.node_count(child)
            stack.append((child, path + (t,)))
    return out


@TRIES
def test_trie_counts_every_bounded_substring_and_removal_undoes_insertion(make_trie):
    rng = random.Random(0)
    texts = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    trie = make_trie(5)
    for t in texts:
        trie.insert(t)
    assert trie_counts(trie) == substring_counts(texts, 5)
    assert trie.num_nodes() == 1 + len(substring_counts(texts, 5))
    for t in texts[:3]:
        trie.remove(t)
    assert trie_counts(trie) == substring_counts(texts[3:], 5)
    trie.insert(texts[0])
    assert trie.num_nodes() == 1 + len(substring_counts(texts[3:] + texts[:1], 5))
    for t in texts[3:] + texts[:1]:
        trie.remove(t)
    assert trie.num_nodes() == 1 and trie.edges(0) == []


def test_freed_nodes_are_reused():
    trie = SuffixTrie(depth=5)
    trie.insert([1, 2, 3, 4])
    nodes = len(trie.count)
    trie.remove([1, 2, 3, 4])
    trie.insert([5, 6, 7, 8])   # no growth beyond what is held
    assert len(trie.count) == nodes


@TRIES
def test_longest_match_and_most_frequent_continuation(make_trie):
    trie = make_trie(8)
    for text in ([1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 3, 4, 5, 1], [2, 3, 4, 5, 8]):
        trie.insert(text)
    # the longest match is "2 3 4" (three times): 5 follows it twice, 6 once; "2 3 4 5"
    # continues only with 8 (once it ends a text)
    tokens, shares, length = trie.draft([0, 0, 2, 3, 4], 6, 1, 4, 2.0, 0.1)
    assert tokens == [5, 8] and shares == pytest.approx([2 / 3, 1.0]) and length == 3
    assert trie.draft([0, 0, 2, 3, 4], 6, 1, 4, 2.0, 0.7)[0] == []   # the frequency cut
    assert trie.draft([0, 0, 2, 3, 4], 6, 1, 4, 1 / 3, 0.1)[0] == [5]  # 1/3 of the match
    assert trie.draft([0, 0, 2, 3, 4], 6, 5, 4, 2.0, 0.1) == ([], [], 0)  # none 5 times
    assert trie.draft([0, 0], 6, 1, 4, 1.0, 0.1) == ([], [], 0)


def test_cpp_trie_drafts_what_the_python_trie_drafts():
    """Random texts over a small vocabulary (many ties and shared substrings), inserted,
    extended and removed in the same order in both: every node's count and children, in
    order, and every draft agree."""
    rng = random.Random(1)
    py, cpp = SuffixTrie(6), native_trie(6)
    held = []
    for step in range(300):
        action = rng.random()
        if action < 0.3 or not held:
            text = [rng.randrange(5) for _ in range(rng.randrange(1, 25))]
            py.insert(text)
            cpp.insert(text)
            held.append(text)
        elif action < 0.5:
            text = held.pop(rng.randrange(len(held)))
            py.remove(text)
            cpp.remove(text)
        elif action < 0.6:
            more = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
            py.extend(more)
            cpp.extend(more)
        else:
            context = [rng.randrange(5) for _ in range(rng.randrange(0, 8))]
            args = (context, rng.randrange(0, 7), rng.randrange(1, 3), rng.randrange(0, 6),
                    rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3]))
            assert py.draft(*args) == cpp.draft(*args), (step, args)
    assert trie_counts(py) == trie_counts(cpp) and py.num_nodes() == cpp.num_nodes()


def test_cpp_request_text_drafts_what_a_trie_over_the_text_drafts():
    """A request's own part: the C++ RequestText scans its text where the Python proposer
    keeps a trie over it. Random growing texts over a small vocabulary (many ties, long
    repeats), with a job-wide trie beside them: every draft, share and match length agree,
    at every match, window and frequency cut."""
    from batchspec.spec._build import cpu_module
    rng = random.Random(2)
    for trial in range(40):
        depth = rng.choice([4, 6, 16])
        py, cpp = SuffixTrie(depth), cpu_module().RequestText(depth)
        domain = native_trie(depth)
        for _ in range(rng.randrange(0, 4)):
            domain.insert([rng.randrange(4) for _ in range(rng.randrange(1, 20))])
        text = []
        for step in range(60):
            more = [rng.randrange(rng.choice([2, 4, 6])) for _ in range(rng.randrange(0, 4))]
            text += more
            room = rng.randrange(0, depth + 1)
            context = text[-room:] if room else []
            args = (context, room, rng.randrange(0, 6), rng.choice([0.5, 1.0, 2.0]),
                    rng.choice([0.0, 0.1, 0.3]), rng.choice([None, domain]))
            got = cpp.propose(more, *args)
            want = py.propose(more, *args[:-1], None if args[-1] is None else
                              _python_copy(args[-1]))
            assert got == want, (trial, step, text, args[:-1])


def _python_copy(native):
    """A Python SuffixTrie with the same counts and children, in order, as a C++ one (to
    draft from: its depth bounds only what is inserted later)."""
    copy, stack = SuffixTrie(), [(0, 0)]
    while stack:
        node, mine = stack.pop()
        kids = native.edges(node)
        for t, child in zip(kids[::2], kids[1::2]):
            new = len(copy.count)
            copy.children.append({})
            copy.count.append(native.node_count(child))
            copy.children[mine][t] = new
            stack.append((child, new))
    return copy


def seq_of(tokens, seq_id=0, domain=None):
    return Sequence(seq_id, str(seq_id), tokens, SamplingParams(), seed=0, domain=domain)


NATIVE = pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "python"])


@NATIVE
def test_request_part_needs_an_earlier_occurrence_and_scales_with_the_match(native, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_SUFFIX_NATIVE", native)
    prop = SuffixProposer()
    s = seq_of([5, 6, 7, 8, 1, 5, 6, 7])
    assert prop.draft(s, 4) == [8, 1, 5]    # match of 3 tokens: at most 3 drafted
    s.token_ids += [8]
    assert prop.draft(s, 4) == [1, 5, 6, 7]
    assert prop.draft(seq_of([1, 2, 3], seq_id=1), 4) == []  # nothing earlier


@NATIVE
def test_job_wide_part_drafts_from_finished_outputs_of_the_domain_and_is_bounded(native,
                                                                                 monkeypatch):
    monkeypatch.setenv("BATCHSPEC_SUFFIX_NATIVE", native)
    prop = SuffixProposer(max_tokens=10)
    done = seq_of([1, 2], domain="a")
    done.token_ids += [10, 11, 12, 13, 14, 15]
    prop.finish(done, completed=True)
    assert prop.draft(seq_of([3, 10, 11, 12], seq_id=1, domain="a"), 4) == [13, 14, 15]
    assert prop.draft(seq_of([3, 10, 11, 12], seq_id=2, domain="b"), 4) == []
    aborted = seq_of([1], seq_id=3, domain="a")
    aborted.token_ids += [20, 21, 22]
    prop.finish(aborted, completed=False)   # an aborted output teaches nothing
    assert prop.domains["a"].tokens == 6
    newer = seq_of([1], seq_id=4, domain="a")
    newer.token_ids += [30, 31, 32, 33, 34]
    prop.finish(newer, completed=True)      # 6 + 5 > 10: the oldest output goes
    assert prop.domains["a"].tokens == 5 and list(prop.domains["a"].texts) == [[30, 31, 32, 33, 34]]
    assert prop.draft(seq_of([10, 11], seq_id=5, domain="a"), 4) == []
    assert set(prop.requests) == {1, 2, 5}  # finished requests' own tries are dropped


@NATIVE
def test_the_longer_match_is_proposed_of_the_request_and_job_wide_drafts(native, monkeypatch):
    """A request's own draft and its domain's job-wide one: the one continuing the longer
    match is proposed, however sure the shorter match's continuation looks (one occurrence
    of a one-token match gives a share of 1); on equal matches, the one with more expected
    accepted tokens; a draft over none."""
    monkeypatch.setenv("BATCHSPEC_SUFFIX_NATIVE", native)
    prop = SuffixProposer()
    done = seq_of([1], domain="a")
    done.token_ids += [40, 41, 42, 43, 50, 51, 40, 41, 42, 43, 52, 53]
    prop.finish(done, completed=True)
    # own text: 43 seen once before, followed by 7 (a one-token match, share 1); job-wide:
    # 41 42 43 (a three-token match) continued by 50 or 52, half each
    own_short = seq_of([43, 7, 8, 9, 41, 42, 43], seq_id=1, domain="a")
    assert prop.draft(own_short, 2) == [50, 51]
    # the own text's match is the longer one now: 9 41 42 43 occurred before
    own_long = seq_of([9, 41, 42, 43, 60, 61, 9, 41, 42, 43], seq_id=2, domain="a")
    assert prop.draft(own_long, 2) == [60, 61]
    # equal matches (one token): the job-wide draft, sure of its continuation, expects more
    done2 = seq_of([1], seq_id=3, domain="b")
    done2.token_ids += [70, 71, 72]
    prop.finish(done2, completed=True)
    tie = seq_of([70, 5, 70, 6, 70], seq_id=4, domain="b")   # own: 5 or 6 after 70, half each
    assert prop.draft(tie, 1) == [71]
    # the own text's longer match drafts nothing past its share cut: the job-wide one drafts
    cut = SuffixProposer(min_prob=0.6)
    cut.finish(done2, completed=True)
    torn = seq_of([8, 70, 1, 8, 70, 2, 8, 70], seq_id=5, domain="b")  # own: 1 or 2, half each
    assert cut.draft(torn, 2) == [71]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(tiny_llama, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_suffix_equals_plain(tiny_llama, plain, adaptive):
    llm = LLM(tiny_llama, drafts={"default": "suffix"}, device="cpu", min_acceptance=0.0,
              adaptive_k=adaptive, max_num_seqs=2)
    if adaptive:   # verification priced as free: a step speculates whenever drafts were
        # found, whatever this machine's timings (what it drafts is then what it finds)
        llm.engine.policy.costs = StepCosts([1, 2], target={q: [0.01, 0.02] for q in
                                                            range(1, 6)})
    # twice: the second pass drafts from the first pass's outputs (job-wide part)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, a, b in zip(plain, first, second):
        assert a.token_ids == p.token_ids == b.token_ids
        assert b.draft == "suffix"
        check_record(b)
    drafted = [sum(o.stats["total_drafted"] for o in outs) for outs in (first, second)]
    accepted = sum(o.stats["total_accepted"] for o in second)
    assert drafted[1] > drafted[0] and accepted > 0


@pytest.mark.slow
def test_suffix_sampling_is_exact(model_factory):
    """Sampled outputs through suffix drafts follow the target's distribution: the first
    three outputs of many requests, against the exact joint by enumeration. The job-wide
    trie fills with earlier requests' outputs, so most rounds draft, and drafts both pass
    and fail."""
    V = 6
    target = model_factory("llama", vocab_size=V, tokenizer=False, init_std=0.25, seed=11)
    llm = LLM(target, drafts={"default": "suffix"}, num_speculative_tokens=4, device="cpu",
              min_acceptance=0.0, suffix_min_prob=0.0)
    prompt, n = [1, 2, 3], 6000
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    drafted = sum(o.stats["total_drafted"] for o in outs)
    accepted = sum(o.stats["total_accepted"] for o in outs)
    assert drafted > 0.3 * n and 0 < accepted < drafted
    assert_follows([tuple(o.token_ids) for o in outs], exact_joint(llm, prompt, 3, 1.0, 1.0))


def test_templated_workload_is_held_out_and_shares_one_template():
    from batchspec.tools.bench import templated_prompts
    rows = templated_prompts(12)
    assert len(rows) == 12 and {r["domain"] for r in rows} == {"code"}
    assert all("\n\n# Summary of " in r["prompt"] and r["prompt"].endswith("# The function")
               for r in rows)


def test_routed_rows_choose_per_round_and_stay_exact(tiny_llama, tiny_draft, plain):
    """DIR+suffix: each round a row keeps the suffix drafts when its estimates favour them,
    else the model drafts; greedy outputs stay the plain ones, and the record names the
    source of every round that drafted."""
    for adaptive in (False, True):
        llm = LLM(tiny_llama, drafts={"default": f"{tiny_draft}+suffix"}, device="cpu",
                  min_acceptance=0.0, adaptive_k=adaptive, max_num_seqs=2)
        if adaptive:   # timings pinned (routing is under test, not a busy machine's timings):
            # verification free, drafts nearly so
            llm.engine.policy.costs = StepCosts(
                [1, 2], target={q: [0.01, 0.02] for q in range(1, 6)},
                draft={"default": [1e-4, 1e-4]})
        outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
        sources = set()
        for p, o in zip(plain * 2, outs):
            assert o.token_ids == p.token_ids
            check_record(o)
            s = o.stats
            assert len(s["round_source"]) == s["rounds"]
            assert all((src is None) == (d == 0)
                       for src, d in zip(s["round_source"], s["round_drafted"]))
            sources |= set(s["round_source"]) - {None}
        assert "suffix" in sources and sources <= {"suffix", tiny_draft}
    # a random model draft is almost never right: the suffix source wins the rounds it can
    assert sum(src == "suffix" for o in outs for src in o.stats["round_source"]) > \
        sum(src == tiny_draft for o in outs for src in o.stats["round_source"])


def test_a_job_seeded_with_last_nights_outputs_drafts_from_them(tiny_llama, tmp_path, caplog):
    """suffix_seed: tonight's run of a job drafts from the outputs of last night's (the
    same prompts here, so the same greedy outputs): the outputs equal an unseeded run's and
    the seeded run accepts more drafts. A seed directory without outputs (a first night)
    warns and runs unseeded; a seed without a suffix draft is a configuration error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.jobs.runner import run_local
    from batchspec.jobs.spec import JobSpec
    from tests.jobdata import read_dir
    prompts = [f"def f{i}(x):" for i in range(12)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [str(i) for i in range(12)], "prompt": prompts,
                             "domain": ["code"] * 12}), src)

    def night(name, seed=None):
        spec = JobSpec(inputs=[str(src)], output=str(tmp_path / name), model=tiny_llama,
                       drafts={"default": "suffix"}, max_tokens=24, shard_size=4,
                       min_acceptance=0.0, suffix_seed=seed)
        doc = run_local(spec, progress=False)
        assert doc["state"] == "completed"
        outs = sorted(read_dir(tmp_path / name, "outputs").to_pylist(), key=lambda r: r["id"])
        accepted = sum(read_dir(tmp_path / name, "acceptance").column("total_accepted")
                       .to_pylist())
        return [o["token_ids"] for o in outs], accepted

    with caplog.at_level("WARNING"):
        first, first_accepted = night("night1", seed=str(tmp_path / "night0"))
    assert "holds no outputs" in caplog.text
    second, second_accepted = night("night2", seed=str(tmp_path / "night1"))
    assert second == first
    assert second_accepted > first_accepted
    with pytest.raises(ValueError, match="suffix_seed seeds suffix drafts"):
        JobSpec(inputs=[str(src)], output=str(tmp_path / "x"), model=tiny_llama,
                suffix_seed=str(tmp_path / "night1"))
