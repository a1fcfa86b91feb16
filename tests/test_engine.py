"""Continuous batching, preemption, stop conditions, seeded sampling and its distribution."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from batchspec import LLM, SamplingParams
from batchspec.spec.verify_torch import target_probs


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device="cpu")


def test_continuous_batching_with_preemption(tiny_llama, llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, size=rng.integers(3, 30)).tolist() for _ in range(200)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(1, 65, size=200)]
    ref = llm.generate(prompts, params, use_tqdm=False)
    small = LLM(tiny_llama, device="cpu", num_kv_blocks=40, block_size=8,
                max_num_batched_tokens=256)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for p, r, o in zip(params, ref, outs):
        assert len(o.token_ids) == p.max_tokens and o.finish_reason == "length"
        assert o.token_ids == r.token_ids
    assert small.engine.block_manager.num_free_blocks == 40  # everything freed
    # records time a request from its admission; latency includes the queueing before it
    assert all(0 < o.stats["wall_s"] <= o.latency_s for o in outs)
    assert max(o.latency_s - o.stats["wall_s"] for o in outs) > 0


def test_seed_gives_same_tokens_whatever_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=1234,
                            ignore_eos=True)
    alone = llm.generate(["import os"], params, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20)]
    mixed = llm.generate(["x = 1", "import os", "def f():"], [others[0], params, others[1]],
                         use_tqdm=False)
    assert mixed[1].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=99,
                                ignore_eos=True)
    assert llm.generate(["import os"], other_seed, use_tqdm=False)[0].token_ids != alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_tokens_are_the_same_at_any_thread_count(tiny_llama, tiny_draft, dtype):
    """A job's tokens do not depend on --threads: the C++ ops (forwards, draft steps,
    verification's draws) run on torch's threads and compute each output alike on any of
    them. Speculative decoding with a model draft, sampled (T = 0.8, seeded) and greedy, at
    1 and 4 threads."""
    before = torch.get_num_threads()
    prompts = ["import os", "def f(x):", "class A:", "x = [1, 2", "for i in range(",
               "# a comment", "return", "while True:"]
    params = [SamplingParams(temperature=t, max_tokens=24, seed=7, ignore_eos=True)
              for t in (0.8, 0.0) * 4]
    try:
        outs = [[o.token_ids for o in LLM(tiny_llama, drafts={"default": tiny_draft},
                                          device="cpu", dtype=dtype, num_threads=n,
                                          max_num_seqs=4).generate(prompts, params,
                                                                   use_tqdm=False)]
                for n in (1, 4)]
    finally:
        torch.set_num_threads(before)
    assert outs[0] == outs[1]


def test_same_request_ids_reproduce_without_explicit_seed(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = llm.generate(["a", "b"], p, request_ids=["r1", "r2"], use_tqdm=False)
    b = llm.generate(["b"], p, request_ids=["r2"], use_tqdm=False)
    assert a[1].token_ids == b[0].token_ids


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0),
                                                     (1.3, 0, 0.8)])
def test_sampling_follows_the_distribution(model_factory, temperature, top_k, top_p):
    path = model_factory("llama", vocab_size=12, tokenizer=False, init_std=0.5, seed=5)
    llm = LLM(path, device="cpu")
    prompt = [1, 2, 3]
    n = 3000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1,
                             seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = np.bincount([o.token_ids[0] for o in outs], minlength=12)
    logits = llm.engine.target.forward([prompt], [0], [[0]], [1])  # cache block 0 is free
    p = target_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]),
                     torch.tensor([top_p]))[1][0].numpy()
    assert counts[p == 0].sum() == 0  # filtered tokens never appear
    keep = p > 0
    expected = p[keep].astype(np.float64)
    _, pvalue = chisquare(counts[keep], expected / expected.sum() * counts[keep].sum())
    assert pvalue > 1e-3


def test_eos_and_stop_token_ids(llm):
    out = llm.generate(["import os"], SamplingParams(temperature=0, max_tokens=30,
                                                     ignore_eos=True), use_tqdm=False)[0]
    stop_at = out.token_ids[5]
    first = out.token_ids.index(stop_at)
    o2 = llm.generate(["import os"], SamplingParams(temperature=0, max_tokens=30,
                                                    stop_token_ids=[stop_at]),
                      use_tqdm=False)[0]
    assert o2.finish_reason == "stop" and o2.token_ids == out.token_ids[:first + 1]


def test_stop_string_cuts_text(llm):
    out = llm.generate(["def f"], SamplingParams(temperature=0, max_tokens=30,
                                                 ignore_eos=True), use_tqdm=False)[0]
    needle = out.text[8:11]
    assert needle
    o2 = llm.generate(["def f"], SamplingParams(temperature=0, max_tokens=30, stop=[needle]),
                      use_tqdm=False)[0]
    assert o2.finish_reason == "stop" and needle not in o2.text
    assert out.text.startswith(o2.text)


def test_context_limit_and_bad_prompts(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", max_model_len=32)
    out = llm.generate([list(range(1, 30))], SamplingParams(temperature=0, max_tokens=100,
                                                            ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 32
    with pytest.raises(ValueError, match="context holds 32"):
        llm.generate([list(range(1, 40))], use_tqdm=False)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="must be a string"):
        llm.generate([3.5], use_tqdm=False)


def test_api_inputs_a_user_gets_wrong(tiny_llama, tiny_draft):
    """A single string is one prompt (it ran one prompt per character); the other mistakes
    are a clear exception before anything runs, not an error deep in a step."""
    llm = LLM(tiny_llama, device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    one = llm.generate("hello there", greedy, use_tqdm=False)
    assert len(one) == 1
    assert one[0].token_ids == llm.generate(["hello there"], greedy, use_tqdm=False)[0].token_ids
    assert len(llm.generate(iter(["a b", "c d"]), greedy, use_tqdm=False)) == 2
    with pytest.raises(TypeError, match="prompts must be a string or a list"):
        llm.generate(None, use_tqdm=False)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        llm.generate(["a"], {"temperature": 0}, use_tqdm=False)
    for bad, error, match in [(dict(max_tokens=1.5), TypeError, "max_tokens must be an integer"),
                              (dict(max_tokens=True), TypeError, "max_tokens must be an integer"),
                              (dict(temperature="0"), TypeError, "temperature must be a number"),
                              (dict(stop=""), ValueError, "non-empty strings"),
                              (dict(stop=[""]), ValueError, "non-empty strings"),
                              (dict(stop=5), ValueError, "stop must be")]:
        with pytest.raises(error, match=match):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="drafts must map a domain"):
        LLM(tiny_llama, drafts=[tiny_draft], device="cpu")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        LLM(tiny_llama, drafts={"default": tiny_draft}, num_speculative_tokens=2.5,
            device="cpu")
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["a"], use_tqdm=False)


def test_chat_messages(llm):
    msgs = [{"role": "user", "content": "say hi"}]
    ids = llm.encode(msgs)
    assert llm.tokenizer.decode(ids).endswith("<|assistant|>\n")
    out = llm.generate([msgs], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids


def test_abort(llm):
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=50, ignore_eos=True),
                        should_abort=lambda: True, use_tqdm=False)
    assert all(o.finish_reason == "abort" for o in outs)
    assert not llm.engine.has_unfinished()


def test_stop_string_late_in_a_long_output(llm):
    """Stop strings are checked on the output's tail; one that completes late, after many
    tokens, still cuts the text at its first occurrence."""
    params = dict(temperature=0, max_tokens=120, ignore_eos=True)
    out = llm.generate(["import os"], SamplingParams(**params), use_tqdm=False)[0]
    needle = out.text[-12:-8]
    assert needle.strip()
    first = out.text.find(needle)
    o2 = llm.generate(["import os"], SamplingParams(**params, stop=[needle]),
                      use_tqdm=False)[0]
    assert o2.finish_reason == "stop" and o2.text == out.text[:first]
