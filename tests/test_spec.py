"""Speculative decoding in the batched engine: exactness (greedy and sampled), acceptance
records, per-domain drafts, confidence threshold, fallback."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from batchspec import LLM, SamplingParams
from batchspec.engine.engine import STEP_COST_CONTEXT
from batchspec.spec.verify_torch import target_probs

PROMPTS = ["def foo(x):\n    return x", "import os\nimport sys\nimport os", "a b a b a b a",
           "The quick brown fox jumps over the lazy dog", "x"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(tiny_llama, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("draft", ["target", "random", "ngram"])
def test_greedy_spec_equals_plain(tiny_llama, tiny_draft, plain, draft, monkeypatch):
    # the target as its own draft keeps its output layer (not the drafts' int8 copy): then
    # it accepts every draft
    monkeypatch.setenv("BATCHSPEC_CPU_DRAFT_HEAD", "bf16")
    path = {"target": tiny_llama, "random": tiny_draft, "ngram": "ngram"}[draft]
    llm = LLM(tiny_llama, drafts={"default": path}, num_speculative_tokens=4, device="cpu",
              min_acceptance=0.0)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(plain, outs):
        assert o.token_ids == p.token_ids
        assert o.stats["total_drafted"] > 0 or draft == "ngram"
    if draft == "target":
        assert all(o.stats["acceptance_rate"] == 1.0 for o in outs)


@pytest.mark.parametrize("draft", ["target", "random", "ngram"])
def test_greedy_spec_equals_plain_in_bf16(model_factory, tiny_draft, draft):
    """In bf16 too, where the CPU kernels compute a token's products and attention the same
    way whatever its batch (AMX tiles, or AVX512-BF16's pair products): a random model's
    near-tied logits would show any difference between a verification window's rounding and
    a decode step's."""
    target = model_factory("llama", seed=2, hidden_size=128, num_heads=2, num_kv_heads=1)
    path = {"target": target, "random": tiny_draft, "ngram": "ngram"}[draft]
    kw = dict(device="cpu", dtype="bfloat16")
    plain_llm = LLM(target, **kw)
    if plain_llm.engine.target.model.weight_layout not in ("amx", "avx512_bf16"):
        pytest.skip("bf16 rounds alike in every batch only on the C++ op's bf16 paths")
    plain_outs = plain_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(target, drafts={"default": path}, num_speculative_tokens=4, min_acceptance=0.0,
              **kw)
    for p, o in zip(plain_outs, llm.generate(PROMPTS, GREEDY, use_tqdm=False)):
        assert o.token_ids == p.token_ids


@pytest.mark.parametrize("head", ["int8", "bf16", "fp32", "fp32-onednn", "fp32-int8",
                                  "fp32-generic", "fp32-vocab", "fp32-int8-vocab"])
def test_draft_steps_in_cpp_are_the_python_loop(model_factory, head, monkeypatch, tmp_path):
    """A draft's steps run in one C++ call (kernels/draft_steps_cpu.cpp) for drafts with
    packed weights (bf16: AMX tiles, AVX512-BF16 pair products on CPUs with those but no
    AMX, or oneDNN; fp32: the
    AVX2 op, or oneDNN with BATCHSPEC_CPU_LINEAR=onednn; int8 output layers in bf16 and
    fp32 drafts): the tokens, q and the keys and values
    written are the step-by-step loop's, bit for bit, for greedy and sampled rows side by
    side (with and without top-k and top-p), ragged pending feeds (one longer
    than a short row: its first step takes the forward, the rest the call) and ragged draft
    counts, with either bf16 output layer; in a job, greedy and sampled, the outputs and
    acceptance counts are the loop's; BATCHSPEC_CPU_DRAFT_STEPS=python turns it off. With
    the host row passes off (BATCHSPEC_VERIFY_HOST_DRAW=0: q by the scalar loop) the two
    agree too. A draft vocabulary (-vocab: its output layer scores part of the vocabulary,
    draft_vocab.json) changes none of this, in calls of greedy rows alone too."""
    import shutil

    from batchspec.engine.runner import ModelRunner
    from batchspec.engine.sequence import Sequence
    from batchspec.spec._build import load
    from batchspec.spec.proposer import DraftModelProposer
    if head == "bf16":
        monkeypatch.setenv("BATCHSPEC_CPU_DRAFT_HEAD", "bf16")
    if head == "fp32-onednn":
        monkeypatch.setenv("BATCHSPEC_CPU_LINEAR", "onednn")
    if head == "fp32-generic":
        monkeypatch.setenv("BATCHSPEC_VERIFY_HOST_DRAW", "0")
    draft = model_factory("llama", seed=3, num_layers=2, hidden_size=64, num_heads=2,
                          num_kv_heads=1, tie_word_embeddings="int8" in head)
    rows = None
    if head.endswith("-vocab"):   # every third token, and the pending tokens' range
        from batchspec.spec import draft_vocab
        ids = sorted(set(range(0, 512, 3)) | set(range(100, 140)))
        draft = str(shutil.copytree(draft, tmp_path / "draft"))
        draft_vocab.write(draft, ids, {})
        rows = torch.tensor(ids)
    g = torch.Generator().manual_seed(0)
    ctx = [30, 15, 47, 9, 12]   # steps cross blocks (block size 16)
    tables = [[7, 3, 12, 0], [5, 9], [1, 2, 4, 6], [8, 10], [11, 13, 14]]
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in ctx]
    pending = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (1, 3, 5, 1, 20)]
    temps, drafts = [0.8, 0.0, 1.0, 0.5, 0.7], [5, 4, 1, 6, 3]
    top_k, top_p = [0, 0, 20, 0, 0], [1.0, 0.9, 1.0, 0.8, 1.0]    # filters, on rows 2 and 3

    dtype = "float32" if head.startswith("fp32") else "bfloat16"
    layouts = {"fp32": ("avx2",), "fp32-generic": ("avx2",), "fp32-onednn": ("onednn",),
               "fp32-int8": ("avx2", "onednn"), "fp32-vocab": ("avx2",),
               "fp32-int8-vocab": ("avx2", "onednn")}.get(head, ("amx", "avx512_bf16", "onednn"))

    def propose(cpp: bool, temps=temps):
        runner = ModelRunner(draft, "cpu", dtype, head_rows=rows)
        if runner.model.weight_layout not in layouts:
            pytest.skip(f"no packed {dtype} weights on this CPU (the C++ draft steps need them)")
        if "int8" in head and not (load(False).head_int8_fast() and runner.use_int8_head()):
            pytest.skip("no AVX512-VNNI or AVX2: no int8 output layer")
        runner.allocate_kv_cache(64, 16)
        if not cpp:
            runner._steps = False            # as where the op is not available
        else:   # a table too short for a row's steps (here the second's) is refused
            with pytest.raises(RuntimeError, match="block table is too short"):
                runner.draft_steps([[1], [1]], [40, 40], [[20, 21, 22], [23, 24]], [1, 1])
        seqs = []
        for i, (p, t) in enumerate(zip(prompts, temps)):
            runner.forward([p], [0], [tables[i]], [1])
            params = SamplingParams(temperature=t, top_k=top_k[i], top_p=top_p[i],
                                    max_tokens=64)
            s = Sequence(i, str(i), p, params, seed=i)
            s.token_ids += pending[i]
            s.block_table, s.spec.num_draft_computed = tables[i], len(p)
            seqs.append(s)
        proposer = DraftModelProposer(runner, 0.0)   # rows 0-3 all in the call; row 4 after
        out = proposer.propose(list(zip(seqs[:4], drafts)))
        assert proposer.catch_up == (0.0, 0)    # every row's pending tokens fit the steps
        out += proposer.propose([(seqs[4], drafts[4])])     # a first step by the forward,
        assert proposer.catch_up[0] > 0.0 and proposer.catch_up[1] == 1   # timed apart
        assert runner.steps_in_one_call == cpp
        return out, [s.spec.num_draft_computed for s in seqs], \
            [c.clone() for pair in runner.kv_caches for c in pair]

    (want, want_n, want_kv), (got, got_n, got_kv) = propose(False), propose(True)
    assert got_n == want_n
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))
    # a call of greedy rows alone (with a draft vocabulary, the argmax over its scored
    # logits mapped to ids, not over full rows)
    greedy_want, greedy_got = propose(False, [0.0] * 5)[0], propose(True, [0.0] * 5)[0]
    assert [o.token_ids for o in greedy_got] == [w.token_ids for w in greedy_want]
    if rows is not None:   # the op takes a vocabulary's ids ascending (as draft_vocab.load)
        runner = ModelRunner(draft, "cpu", dtype, head_rows=rows.flip(0))
        runner.allocate_kv_cache(8, 16)
        if runner.steps_in_one_call:
            with pytest.raises(RuntimeError, match="ids must ascend"):
                runner.draft_steps([[1]], [0], [[0]], [2])
    for w, o, t, n in zip(want, got, temps, drafts):
        assert o.token_ids == w.token_ids and len(o.token_ids) == n
        if t > 0:
            assert o.probs is not None and torch.equal(o.probs, w.probs)
        if rows is not None:   # only the vocabulary's tokens, which alone have probability
            assert set(o.token_ids) <= set(rows.tolist())
            if t > 0:
                outside = torch.ones(o.probs.shape[-1], dtype=torch.bool)
                outside[rows] = False
                assert bool((o.probs[:, outside] == 0).all())

    target = model_factory("llama", seed=2, hidden_size=128, num_heads=2, num_kv_heads=1)
    kw = dict(drafts={"default": draft}, num_speculative_tokens=4, device="cpu",
              dtype=dtype, min_acceptance=0.0)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True,
                             seed=5)
    llm = LLM(target, **kw)
    outs = [llm.generate(PROMPTS, p, use_tqdm=False) for p in (GREEDY, sampled)]
    assert llm.engine.proposers["default"].runner.steps_in_one_call    # the C++ steps ran
    monkeypatch.setenv("BATCHSPEC_CPU_DRAFT_STEPS", "python")
    stepwise = LLM(target, **kw)
    assert stepwise.engine.proposers["default"].runner.model.draft_steps_weights() is None
    for params, got_outs in zip((GREEDY, sampled), outs):
        for a, b in zip(got_outs, stepwise.generate(PROMPTS, params, use_tqdm=False)):
            assert a.token_ids == b.token_ids
            assert (a.stats["total_drafted"], a.stats["total_accepted"]) == \
                (b.stats["total_drafted"], b.stats["total_accepted"])


def test_perfect_draft_accepts_everything(tiny_llama, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_CPU_DRAFT_HEAD", "bf16")   # the target's own output layer
    k = 4
    llm = LLM(tiny_llama, drafts={"default": tiny_llama}, num_speculative_tokens=k,
              device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=1 + 6 * (k + 1), ignore_eos=True)
    for o in llm.generate(PROMPTS, params, use_tqdm=False):
        s = o.stats
        assert s["acceptance_rate"] == 1.0
        assert s["rounds"] == 6 and s["mean_accepted_length"] == k + 1
        assert s["round_drafted"] == [k] * 6 and s["accepted_per_depth"] == [6] * k


def check_record(o):
    s = o.stats
    assert s["tokens_generated"] == len(o.token_ids)
    assert s["total_accepted"] <= s["total_drafted"]
    assert sum(s["drafted_per_depth"]) == s["total_drafted"] == sum(s["round_drafted"])
    assert sum(s["accepted_per_depth"]) == s["total_accepted"] == sum(s["round_accepted"])
    assert s["rounds"] == len(s["round_drafted"]) == len(s["round_output_pos"])
    assert all(a <= d for a, d in zip(s["round_accepted"], s["round_drafted"]))
    # every round emits its accepted drafts plus one token (the stop may cut the last one)
    assert 1 + s["rounds"] + s["total_accepted"] >= s["tokens_generated"]
    if o.finish_reason == "length":
        assert 1 + s["rounds"] + s["total_accepted"] == s["tokens_generated"]
    assert s["round_output_pos"] == sorted(s["round_output_pos"])
    if s["total_drafted"]:
        assert s["acceptance_rate"] == s["total_accepted"] / s["total_drafted"]
        assert s["speedup_theoretical"] > 0


def test_records_consistent_and_routing_by_domain(tiny_llama, tiny_draft, model_factory):
    code_draft = model_factory("llama", seed=7, num_layers=1, hidden_size=32, num_heads=2,
                               num_kv_heads=1)
    llm = LLM(tiny_llama, drafts={"default": tiny_draft, "code": code_draft, "rag": "ngram"},
              num_speculative_tokens=3, device="cpu", min_acceptance=0.0)
    domains = ["code", None, "rag", "unknown", "code"]
    params = [SamplingParams(temperature=t, max_tokens=30) for t in (0.0, 0.8, 0.0, 1.0, 0.5)]
    outs = llm.generate(PROMPTS, params, domains=domains, use_tqdm=False)
    expect = {"code": code_draft, None: tiny_draft, "rag": "ngram", "unknown": tiny_draft}
    for o, d in zip(outs, domains):
        assert o.draft == expect[d] == o.stats["draft"]
        assert o.domain == d == o.stats["domain"]
        check_record(o)


def test_no_default_draft_means_plain_for_other_domains(tiny_llama, tiny_draft):
    llm = LLM(tiny_llama, drafts={"code": tiny_draft}, device="cpu")
    a, b = llm.generate(["x", "y"], GREEDY, domains=["code", "docs"], use_tqdm=False)
    assert a.draft == tiny_draft and a.stats["total_drafted"] > 0
    assert b.draft is None and b.stats["total_drafted"] == 0
    assert b.stats["acceptance_rate"] is None


def test_confidence_threshold_cuts_windows_and_stays_exact(tiny_llama, tiny_draft, plain):
    llm = LLM(tiny_llama, drafts={"default": tiny_draft}, confidence_threshold=0.02,
              device="cpu", min_acceptance=0.0)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sum(o.stats["skipped_by_confidence"] for o in outs) > 0
    for p, o in zip(plain, outs):
        assert o.token_ids == p.token_ids
        check_record(o)


def test_fallback_when_acceptance_is_low(tiny_llama, tiny_draft, plain):
    llm = LLM(tiny_llama, drafts={"default": tiny_draft}, device="cpu", min_acceptance=0.4,
              fallback_window=20, fallback_min_drafted=12)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(plain, outs):
        assert o.token_ids == p.token_ids
        assert o.stats["fallback_triggered"] and o.stats["total_drafted"] <= 12 + 4
        assert o.stats["round_drafted"][-1] == 0


def test_max_spec_temperature(tiny_llama, tiny_draft):
    llm = LLM(tiny_llama, drafts={"default": tiny_draft}, device="cpu",
              max_spec_temperature=0.5)
    hot, cold = llm.generate(["x", "x"], [SamplingParams(temperature=1.0, max_tokens=8),
                                          SamplingParams(temperature=0.3, max_tokens=8)],
                             use_tqdm=False)
    assert hot.draft is None and cold.draft == tiny_draft


def test_draft_with_other_vocabulary_is_refused(tiny_llama, model_factory):
    other = model_factory("llama", vocab_size=64, tokenizer=False, seed=2)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_llama, drafts={"default": other}, device="cpu")


def noisy_copy(src, dst, scale, seed=0):
    """A draft that resembles the target: its weights plus Gaussian noise."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    f = f"{dst}/model.safetensors"
    g = torch.Generator().manual_seed(seed)
    w = {k: (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous()
         for k, v in load_file(f).items()}
    save_file(w, f, metadata={"format": "pt"})
    return dst


def exact_joint(llm, prompt, n_tokens, temperature, top_p):
    """Target's exact distribution over the first n_tokens outputs, by enumeration."""
    V = llm.engine.target.cfg.vocab_size
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32)
    joint = {}
    for seq in itertools.product(range(V), repeat=n_tokens - 1):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1:]
        _, probs = target_probs(logits, torch.full((len(logits),), temperature),
                                None, torch.full((len(logits),), top_p))
        prefix = 1.0
        for j, t in enumerate(seq):
            prefix *= float(probs[j, t])
        for t in range(V):
            joint[seq + (t,)] = prefix * float(probs[n_tokens - 1, t])
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_speculative_sampling_is_exact(model_factory, tmp_path, temperature, top_p):
    """First three outputs: token 1 comes from prefill, tokens 2-3 from a speculative round
    (one draft: accept -> draft + bonus, reject -> corrected token then a plain round)."""
    V = 6
    target = model_factory("llama", vocab_size=V, tokenizer=False, init_std=0.25, seed=11)
    draft = noisy_copy(target, str(tmp_path / "draft"), scale=0.7)
    llm = LLM(target, drafts={"default": draft}, num_speculative_tokens=4, device="cpu",
              min_acceptance=0.0)
    prompt, n = [1, 2, 3], 6000
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, seed=s)
              for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    drafted = sum(o.stats["total_drafted"] for o in outs)
    accepted = sum(o.stats["total_accepted"] for o in outs)
    assert drafted > 0.9 * n and 0 < accepted < drafted  # both paths exercised
    assert_follows([tuple(o.token_ids) for o in outs], exact_joint(llm, prompt, 3, temperature,
                                                                   top_p))


@pytest.mark.parametrize("vocab", [509, 515])
def test_draft_steps_draw_like_the_loop_where_the_vocabulary_is_not_whole_vectors(
        model_factory, vocab):
    """The C++ steps' draw sums q's blocks of 8 tokens as it writes q (draft_draw.h's
    softmax_draw_row); the step-by-step loop sums them from q (draw_rows). With a vocabulary
    that is not a whole number of blocks or vectors (the last block's missing tokens 0), the
    two draw the same tokens from the same q, at temperatures from 0.3 to 1.5."""
    from batchspec.engine.runner import ModelRunner
    from batchspec.engine.sequence import Sequence
    from batchspec.spec.proposer import DraftModelProposer
    draft = model_factory("llama", vocab_size=vocab, tokenizer=False, seed=4, num_layers=1,
                          hidden_size=64, num_heads=2, num_kv_heads=1, init_std=0.5)
    temps = [0.3, 0.8, 1.0, 1.5, 0.6, 1.2]

    def propose(cpp: bool):
        runner = ModelRunner(draft, "cpu", "float32")
        runner.allocate_kv_cache(64, 16)
        if cpp and not runner.steps_in_one_call:
            pytest.skip("no C++ draft steps for this model here")
        if not cpp:
            runner._steps = False
        seqs = []
        for i, t in enumerate(temps):
            prompt = [(7 * i + j) % vocab for j in range(5 + i)]
            runner.forward([prompt], [0], [[2 * i, 2 * i + 1]], [1])
            s = Sequence(i, str(i), prompt, SamplingParams(temperature=t, max_tokens=64),
                         seed=100 + i)
            s.token_ids.append(3)
            s.block_table, s.spec.num_draft_computed = [2 * i, 2 * i + 1], len(prompt)
            seqs.append(s)
        return DraftModelProposer(runner, 0.0).propose([(s, 6) for s in seqs])

    for a, b in zip(propose(True), propose(False)):
        assert a.token_ids == b.token_ids and torch.equal(a.probs, b.probs)


def test_joined_is_cat_and_shares_the_memory_of_consecutive_views():
    """proposer.joined: what torch.cat gives, in the blocks' own memory where they lie one
    after the other (a draft's call's rows' q), copied where they do not."""
    from batchspec.spec.proposer import joined
    q = torch.randn(10, 8)
    parts = list(q.split([3, 2, 5]))
    cases = [(parts, True), (parts[1:], True), ([parts[1]], True), ([parts[0], parts[2]], False),
             ([parts[1], parts[0]], False), ([parts[0][:2], parts[1]], False),
             ([parts[0], parts[1], torch.randn(4, 8)], False)]
    for blocks, shared in cases:
        got = joined(blocks)
        assert torch.equal(got, torch.cat(blocks)) and got.is_contiguous()
        assert (got.data_ptr() == blocks[0].data_ptr()) == shared


@pytest.mark.parametrize("two_drafts", [False, True])
def test_drafts_q_reach_verification_without_a_copy(model_factory, monkeypatch, two_drafts):
    """Rows drafted in C++ calls (ModelRunner.draft_steps) write their q into one buffer of
    the step, the rows' slots in the order verification reads them (Engine._q_buffer),
    ragged lengths included, and verification takes that memory as it is
    (Engine._verify_metadata); with two drafts (rows of two domains side by side) too. The
    rows' q were stacked a row at a time, then copied again into one tensor: at 64 rows and
    k = 4, 0.3 ms of an 18 ms step. The outputs are those of the step-by-step loop."""
    from batchspec.engine.engine import Engine
    draft = model_factory("llama", seed=3, num_layers=2, hidden_size=64, num_heads=2,
                          num_kv_heads=1)
    other = model_factory("llama", seed=4, num_layers=1, hidden_size=64, num_heads=2,
                          num_kv_heads=1)
    target = model_factory("llama", seed=2, hidden_size=128, num_heads=2, num_kv_heads=1)
    drafts = {"default": draft, "code": other} if two_drafts else {"default": draft}
    kw = dict(drafts=drafts, num_speculative_tokens=4, device="cpu", dtype="bfloat16",
              min_acceptance=0.0)
    domains = ["code", None, "code", None, None] if two_drafts else None
    llm = LLM(target, **kw)
    if not llm.engine.proposers["default"].runner.steps_in_one_call:
        pytest.skip("no C++ draft steps for this model here")
    seen = []
    metadata = Engine._verify_metadata

    def checked(self, sampling):
        meta = metadata(self, sampling)
        probs = [s.proposal.probs for s in sampling if s.num_drafts]
        if meta.draft_probs is not None and all(p is not None for p in probs):
            seen.append((meta.draft_probs.data_ptr() == probs[0].data_ptr(),
                         len({len(p) for p in probs}) > 1,
                         len({s.source for s in sampling if s.num_drafts})))
        return meta
    monkeypatch.setattr(Engine, "_verify_metadata", checked)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=5)
    outs = llm.generate(PROMPTS, sampled, use_tqdm=False, domains=domains)
    # (the first step's rows catch up on their prompts with a forward before the call: their
    # q joins that forward's, a copy)
    assert len(seen) > 5 and all(shared for shared, _, _ in seen[1:])
    assert any(ragged for _, ragged, _ in seen[1:])
    assert max(n for _, _, n in seen) == (2 if two_drafts else 1)
    monkeypatch.setattr(Engine, "_verify_metadata", metadata)
    monkeypatch.setenv("BATCHSPEC_CPU_DRAFT_STEPS", "python")
    for a, b in zip(outs, LLM(target, **kw).generate(PROMPTS, sampled, use_tqdm=False,
                                                     domains=domains)):
        assert a.token_ids == b.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_is_exact_with_cpp_draft_steps(model_factory, tmp_path,
                                                            temperature, dtype):
    """As above in bf16 (AMX weights) and fp32 (oneDNN-packed weights), where the draft's
    sampled steps run in one C++ call (kernels/draft_steps_cpu.cpp): the outputs follow the
    target's own distribution, enumerated from its forward over each prefix (the short-row
    path verification windows take)."""
    V = 6
    target = model_factory("llama", vocab_size=V, tokenizer=False, init_std=0.25, seed=11)
    draft = noisy_copy(target, str(tmp_path / "draft"), scale=0.7)
    llm = LLM(target, drafts={"default": draft}, num_speculative_tokens=4, device="cpu",
              dtype=dtype, min_acceptance=0.0)
    if not llm.engine.proposers["default"].runner.steps_in_one_call:
        pytest.skip(f"no C++ draft steps for {dtype} drafts on this CPU (bf16: AMX weights)")
    prompt, n = [1, 2, 3], 6000
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    drafted = sum(o.stats["total_drafted"] for o in outs)
    accepted = sum(o.stats["total_accepted"] for o in outs)
    assert drafted > 0.9 * n and 0 < accepted < drafted  # both paths exercised
    assert_follows([tuple(o.token_ids) for o in outs],
                   engine_joint(llm.engine.target, prompt, temperature))


def engine_joint(runner, prompt: list[int], temperature: float) -> dict:
    """The target's exact distribution over its first three outputs after prompt, from its
    own forward over each prefix (the short-row path verification windows take), by
    enumeration over its vocabulary (after a job: the cache's last block is free)."""
    V = runner.cfg.vocab_size
    last_block = runner.kv_caches[0][0].shape[0] // runner.block_size - 1
    joint = {}
    for seq in itertools.product(range(V), repeat=2):
        logits = runner.forward([prompt + list(seq)], [0], [[last_block]], [3])
        _, probs = target_probs(logits, torch.full((3,), temperature), None, None)
        for t in range(V):
            joint[seq + (t,)] = float(probs[0, seq[0]] * probs[1, seq[1]] * probs[2, t])
    return joint


def assert_follows(samples: list[tuple], joint: dict):
    """Chi-square test of sampled token tuples against the exact joint distribution (rare
    outcomes pooled into one cell); impossible outcomes must not occur."""
    keys = list(joint)
    counts = dict.fromkeys(keys, 0)
    for sample in samples:
        assert sample in counts, f"sampled {sample}, which has probability 0"
        counts[sample] += 1
    exp = np.array([joint[k] for k in keys]) * len(samples)
    obs = np.array([counts[k] for k in keys])
    assert obs[exp == 0].sum() == 0
    big = exp >= 5  # pool the rare outcomes into one cell
    obs_c, exp_c = obs[big], exp[big]
    if exp[~big].sum() > 0:
        obs_c, exp_c = np.append(obs_c, obs[~big].sum()), np.append(exp_c, exp[~big].sum())
    _, pvalue = chisquare(obs_c, exp_c * obs_c.sum() / exp_c.sum())
    assert pvalue > 1e-3


def test_ngram_lookup_takes_the_longest_most_recent_match():
    from batchspec.spec.proposer import NgramProposer
    p = NgramProposer(min_n=1, max_n=3)
    # suffix [7, 8, 9] occurred at 0 and at 5; the most recent earlier one (5) wins
    assert p.lookup([7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 7, 8, 9], 2) == [3, 4]
    # no 3- or 2-gram match: fall back to the last earlier occurrence of the last token
    assert p.lookup([5, 1, 5, 2, 6, 5], 3) == [2, 6, 5]
    assert p.lookup([1, 2, 3], 4) == [] and p.lookup([4], 4) == []
    assert p.lookup([1, 2, 1, 2], 5) == [1, 2]  # continuation may run into the suffix


def test_adaptive_k_is_exact_and_measures_costs(tiny_llama, tiny_draft, plain):
    """adaptive_k measures step costs at start-up, then picks k per step; greedy outputs are
    the plain ones whatever it picks. A random draft (almost never right, and on models this
    small not much cheaper than the target) does not pay: (almost) no drafts. n-gram drafts
    cost nothing: it drafts."""
    outs = {}
    for name, path in (("random", tiny_draft), ("ngram", "ngram")):
        llm = LLM(tiny_llama, drafts={"default": path}, device="cpu", min_acceptance=0.0,
                  adaptive_k=True, max_num_seqs=4)
        costs = llm.engine.policy.costs
        assert costs is not None and costs.batch_sizes == [1, 2, 4]
        assert set(costs.target) == {1, 2, 3, 4, 5}
        assert set(costs.draft) == ({"default"} if name == "random" else set())
        # what sampling at T > 0 adds to a slot: the model draft's draw is timed (against
        # its greedy steps) where its steps run in one call, as on this CPU
        runner = llm.engine.proposers["default"].runner if name == "random" else None
        assert set(costs.draft_sample_s) == \
            ({"default"} if runner is not None and runner.steps_in_one_call else set())
        # what a row's context token adds below the grid's context and above it: timed at
        # an eighth of it and four times it, lines in q for the target
        assert costs.context == STEP_COST_CONTEXT
        assert set(costs.target_ctx) == set(costs.target) and \
            min(min(s) for s in costs.target_ctx.values()) >= 0.0
        assert set(costs.draft_ctx) == set(costs.draft)
        outs[name] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for p, o in zip(plain, outs[name]):
            assert o.token_ids == p.token_ids
            check_record(o)
    rounds = sum(o.stats["rounds"] for o in outs["random"])
    # fixed k would draft 4 per round; timing noise on models this small may make it try
    assert sum(o.stats["total_drafted"] for o in outs["random"]) < 0.5 * rounds
    assert sum(o.stats["total_drafted"] for o in outs["ngram"]) > 0


@pytest.mark.parametrize("tied", [False, True])
def test_drafts_output_layer_in_int8(tiny_llama, model_factory, plain, tied, monkeypatch):
    """On CPUs with AVX512-VNNI or AVX2 a draft's forwards take an int8 copy of its output layer
    (tied to the embeddings or its own): its logits move by the rounding only, a row's
    logits are the same in any batch (so sampled drafts do not depend on the batch), greedy
    outputs stay plain decoding's, and BATCHSPEC_CPU_DRAFT_HEAD=bf16 keeps bf16."""
    from batchspec.spec._build import load
    draft = model_factory("llama", seed=1, num_layers=1, hidden_size=32, num_heads=2,
                          num_kv_heads=1, tie_word_embeddings=tied)
    kw = dict(drafts={"default": draft}, num_speculative_tokens=4, device="cpu",
              min_acceptance=0.0)
    llm = LLM(tiny_llama, **kw)
    model = llm.engine.proposers["default"].runner.model
    if not load(False).head_int8_fast():
        assert model.int8_head is None
        pytest.skip("no AVX512-VNNI or AVX2: drafts keep their output layer")
    assert model.int8_head is not None
    hidden = torch.randn(9, 32)
    int8 = model.compute_logits(hidden)
    for rows in (hidden[:1], hidden[3:8]):      # one row, five: each row as in nine
        got = model.compute_logits(rows)
        assert torch.equal(got, int8[:1] if len(rows) == 1 else int8[3:8])
    assert model.lm_head is None     # the bf16 layer is not kept besides
    for p, o in zip(plain, llm.generate(PROMPTS, GREEDY, use_tqdm=False)):
        assert o.token_ids == p.token_ids
    monkeypatch.setenv("BATCHSPEC_CPU_DRAFT_HEAD", "bf16")
    bf16 = LLM(tiny_llama, **kw).engine.proposers["default"].runner.model
    assert bf16.int8_head is None and bf16.lm_head is not None
    full = bf16.compute_logits(hidden)
    assert not torch.equal(int8, full)
    assert (int8 - full).abs().max() <= 0.03 * full.abs().max()
