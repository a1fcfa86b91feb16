"""Prefix caching in the engine: the same tokens with caching on and off (greedy, and sampled
with the same seeds), with draft models, n-gram drafts, chunked prefill and preemption."""
import random

import pytest

from batchspec import LLM, SamplingParams

PREFIX = [(7 * i + 3) % 500 + 1 for i in range(37)]   # 37 tokens: 9 full blocks of 4


def prompts(n=10, seed=0):
    rng = random.Random(seed)
    # repeated suffixes give the n-gram proposer matches; two rows are the bare prefix
    rows = [PREFIX + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 9))] * 2
            for _ in range(n - 2)]
    return rows + [PREFIX, PREFIX[:20]]


def run(model, caching, drafts=None, temperature=0.0, **kw):
    llm = LLM(model, drafts=drafts or {}, num_speculative_tokens=3, device="cpu",
              min_acceptance=0.0, block_size=4, enable_prefix_caching=caching, **kw)
    params = [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=s)
              for s in range(10)]
    outs = llm.generate(prompts(), params, use_tqdm=False)
    return llm, outs


def check_same(model, drafts=None, temperature=0.0, **kw):
    _, off = run(model, False, drafts, temperature, **kw)
    llm, on = run(model, True, drafts, temperature, **kw)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert all(o.num_cached_prompt_tokens == 0 for o in off)
    cached = [o.num_cached_prompt_tokens for o in on]
    assert sum(cached) >= 8 * 36                      # the later rows hit the prefix
    assert all(c % 4 == 0 and c < len(o.prompt_token_ids) for c, o in zip(cached, on))
    assert [o.stats["cached_prompt_tokens"] for o in on] == cached
    return llm, on


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("draft", ["plain", "model", "ngram"])
def test_same_tokens_with_and_without_caching(tiny_llama, tiny_draft, draft, temperature):
    drafts = {"plain": None, "model": {"default": tiny_draft},
              "ngram": {"default": "ngram"}}[draft]
    _, on = check_same(tiny_llama, drafts, temperature)
    if draft != "plain":
        assert sum(o.stats["total_drafted"] for o in on) > 0


@pytest.mark.parametrize("draft,temperature", [("plain", 0.8), ("model", 0.0), ("ngram", 0.0)])
def test_same_tokens_under_preemption_and_chunked_prefill(tiny_llama, tiny_draft, draft,
                                                          temperature):
    """26 blocks of 4 tokens hold about two rows: rows are preempted and recomputed, and
    prefills are cut into chunks of at most 16 tokens per step. (Sampled rows with drafts are
    left out: a step budget this tight cuts draft windows differently when the schedule
    differs, and a sampled token depends on its window, with or without caching.)"""
    drafts = {"plain": None, "model": {"default": tiny_draft},
              "ngram": {"default": "ngram"}}[draft]
    llm, _ = check_same(tiny_llama, drafts, temperature, num_kv_blocks=26,
                        max_num_batched_tokens=16)
    assert llm.engine.scheduler.num_preemptions > 0


def test_cached_draft_kv_is_valid(tiny_llama, monkeypatch):
    """The target as its own draft accepts every greedy draft, so any block whose draft KV
    were taken from the cache without that draft having computed it would show up as a
    rejection. (The draft keeps the target's bf16 output layer: an int8 one rounds its
    logits, and a near tie could reject a draft.)"""
    monkeypatch.setenv("BATCHSPEC_CPU_DRAFT_HEAD", "bf16")
    _, on = check_same(tiny_llama, {"default": tiny_llama}, 0.0, max_num_batched_tokens=16)
    assert all(o.stats["acceptance_rate"] == 1.0 for o in on)


def test_job_summary_and_report_count_cached_prompt_tokens(tiny_llama, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.jobs.runner import run_local
    from batchspec.jobs.spec import JobSpec
    from batchspec.report.analysis import analyze
    from batchspec.report.command import render_text
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)],
                             "q": [f"question number {i}?" for i in range(6)]}),
                   tmp_path / "in.parquet")
    template = "Answer the question below carefully and briefly. " * 6 + "Q: {q}\nA:"
    docs = {}
    for on in (False, True):
        spec = JobSpec(inputs=[str(tmp_path / "in.parquet")], output=str(tmp_path / str(on)),
                       model=tiny_llama, template=template, max_tokens=4,
                       prefix_caching=on)
        docs[on] = run_local(spec, progress=False)["summary"]
    assert docs[True]["prompt_tokens"] == docs[False]["prompt_tokens"] > 0
    assert docs[False]["cached_prompt_tokens"] == 0
    assert docs[True]["cached_prompt_tokens"] > docs[True]["prompt_tokens"] / 2
    report = analyze([str(tmp_path / "True")])
    assert report["summary"]["cached_prompt_tokens"] == docs[True]["cached_prompt_tokens"]
    assert report["summary"]["prompt_cache_hit_rate"] == docs[True]["prompt_cache_hit_rate"]
    assert "prompt tokens from the prefix cache" in render_text(report)
