"""A draft's vocabulary (batchspec.spec.draft_vocab): its output layer scores part of the
vocabulary; outputs stay exact, greedy and sampled; bad files fail fast; the command."""
import json
import os
import shutil

import pytest
from click.testing import CliRunner

from batchspec import LLM, SamplingParams, contract
from batchspec.cli import _register, cli
from batchspec.spec import draft_vocab
from tests.test_spec import GREEDY, PROMPTS, assert_follows, engine_joint, noisy_copy


def with_vocab(src, dst, ids) -> str:
    path = str(shutil.copytree(src, dst))
    draft_vocab.write(path, ids, {})
    return path


def theoretical(stats: dict, cost_ratio: float) -> float:
    """A record's speedup_theoretical from its rounds one by one: (1 - p^(n+1)) / (1 - p)
    tokens a round of n drafts, a draft model's n forwards at cost_ratio each."""
    p = contract.summarize(contract.totals([stats]))["token_acceptance_prob"]
    rounds = list(zip(stats["round_drafted"], stats["round_source"], strict=True))
    tokens = sum(contract.expected_tokens_per_pass(p, n) for n, _ in rounds) / len(rounds)
    model = sum(n for n, src in rounds if n and src not in ("ngram", "suffix")) / len(rounds)
    return tokens / (1 + cost_ratio * model)


def test_greedy_outputs_do_not_change(tiny_llama, tmp_path):
    """The target as its own draft, scoring a quarter of the vocabulary: outputs are plain
    decoding's; every drafted token is one of the list's, so rounds whose next token is
    outside it are rejected there (acceptance below 1). Told nothing, the engine drafts
    greedy rows through the list (a second proposer beside the draft's whole one); with
    draft_vocab=True the draft has the list alone."""
    ids = list(range(0, 512, 4))
    draft = with_vocab(tiny_llama, tmp_path / "draft", ids)
    plain = LLM(tiny_llama, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    kw = dict(num_speculative_tokens=4, device="cpu", min_acceptance=0.0)
    llm = LLM(tiny_llama, drafts={"default": draft}, **kw)
    assert llm.engine.source_for("default", 0.0) == "default+vocab"
    assert llm.engine.proposers["default+vocab"].runner.model.head_size == len(ids)
    assert llm.engine.proposers["default"].runner.model.head_rows is None
    only = LLM(tiny_llama, drafts={"default": draft}, draft_vocab=True, **kw)
    assert only.engine.source_for("default", 0.0) == "default"
    assert only.engine.proposers["default"].runner.model.head_size == len(ids)
    assert [o.token_ids for o in only.generate(PROMPTS, GREEDY, use_tqdm=False)] == \
        [o.token_ids for o in plain]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(plain, outs):
        assert o.token_ids == p.token_ids
    drafted = sum(o.stats["total_drafted"] for o in outs)
    accepted = sum(o.stats["total_accepted"] for o in outs)
    assert 0 < accepted < drafted
    # draft_vocab=False: the whole vocabulary, every draft accepted
    whole = LLM(tiny_llama, drafts={"default": draft}, draft_vocab=False, **kw)
    assert whole.engine.proposers["default"].runner.model.head_rows is None
    # the cost ratio (records' theoretical speedup) leaves out the rows the draft skips
    with open(os.path.join(tiny_llama, "config.json")) as f:
        cfg = json.load(f)
    params = llm.engine.target.num_params
    left_out = (cfg["vocab_size"] - len(ids)) * cfg["hidden_size"]
    assert llm.engine.cost_ratio("default+vocab") == pytest.approx((params - left_out) / params)
    assert only.engine.cost_ratio("default") == pytest.approx((params - left_out) / params)
    assert llm.engine.cost_ratio("default") == pytest.approx(1.0)
    assert whole.engine.cost_ratio("default") == pytest.approx(1.0)
    assert outs[0].stats["speedup_theoretical"] == pytest.approx(theoretical(
        outs[0].stats, llm.engine.cost_ratio("default+vocab")))


def test_each_row_chooses_by_its_temperature(tiny_llama, tmp_path):
    """Told nothing, rows of one batch choose per row: greedy rows draft through the list's
    proposer, sampled rows through the draft's whole vocabulary; the two share the model's
    weights and KV cache. Greedy rows' outputs are still plain decoding's, and each row's
    record prices its drafts with the cost ratio of the proposer it took."""
    ids = list(range(0, 512, 4))
    draft = with_vocab(tiny_llama, tmp_path / "draft", ids)
    prompts = PROMPTS * 2
    params = [GREEDY] * len(PROMPTS) + [
        SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=i)
        for i in range(len(PROMPTS))]
    plain = LLM(tiny_llama, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(tiny_llama, drafts={"default": draft}, num_speculative_tokens=4, device="cpu",
              min_acceptance=0.0)
    engine = llm.engine
    whole, cut = engine.proposers["default"].runner, engine.proposers["default+vocab"].runner
    assert whole.kv_caches is cut.kv_caches and whole.model.layers is cut.model.layers
    served: dict[str, set[str]] = {"default": set(), "default+vocab": set()}
    for name in served:   # which rows each proposer drafts for, and what it drafts
        proposer = engine.proposers[name]

        def propose(rows, *into, name=name, inner=proposer.propose):
            got = inner(rows, *into)
            served[name].update(seq.request_id for seq, _ in rows)
            if name == "default+vocab":
                assert all(t in ids for p in got for t in p.token_ids)
            return got
        proposer.propose = propose
    outs = llm.generate(prompts, params, use_tqdm=False)
    greedy = {str(i) for i in range(len(PROMPTS))}
    assert served["default+vocab"] == greedy
    assert served["default"] == {str(i) for i in range(len(PROMPTS), len(prompts))}
    for p, o in zip(plain, outs):
        assert o.token_ids == p.token_ids
    for o in outs:
        c = engine.cost_ratio("default+vocab" if o.request_id in greedy else "default")
        assert o.stats["speedup_theoretical"] == pytest.approx(theoretical(o.stats, c))
    assert engine.cost_ratio("default+vocab") < engine.cost_ratio("default")


@pytest.mark.slow
def test_speculative_sampling_is_exact_with_a_draft_vocabulary(model_factory, tmp_path):
    """Sampled, with a draft that can propose only tokens 0, 2 and 3 of 6: its q is 0 on
    the others, which verification then makes up for from the target's residual. The first
    three outputs follow the target's own distribution (chi-square)."""
    V, temperature = 6, 1.0
    target = model_factory("llama", vocab_size=V, tokenizer=False, init_std=0.25, seed=11)
    draft = noisy_copy(target, str(tmp_path / "noisy"), scale=0.7)
    draft = with_vocab(draft, tmp_path / "draft", [0, 2, 3])
    llm = LLM(target, drafts={"default": draft}, num_speculative_tokens=4, device="cpu",
              dtype="float32", min_acceptance=0.0, draft_vocab=True)   # (sampled rows too)
    prompt, n = [1, 2, 3], 6000
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    drafted = sum(o.stats["total_drafted"] for o in outs)
    accepted = sum(o.stats["total_accepted"] for o in outs)
    assert drafted > 0.9 * n and 0 < accepted < drafted
    samples = [tuple(o.token_ids) for o in outs]
    assert any(t in (1, 4, 5) for s in samples for t in s)   # tokens the draft cannot give
    assert_follows(samples, engine_joint(llm.engine.target, prompt, temperature))


@pytest.mark.parametrize("content,message", [
    ("not json", "not a draft vocabulary"),
    (json.dumps({"ids": [1]}), "not a draft vocabulary"),
    (json.dumps({"token_ids": []}), "non-empty list"),
    (json.dumps({"token_ids": [1, "2"]}), "non-empty list"),
    (json.dumps({"token_ids": [1, 5000]}), "outside the vocabulary of 512"),
    (json.dumps({"token_ids": [1, 1]}), "repeated ids"),
])
def test_a_bad_file_fails_fast(tiny_llama, tiny_draft, tmp_path, content, message):
    draft = str(shutil.copytree(tiny_draft, tmp_path / "draft"))
    with open(draft_vocab.path_of(draft), "w") as f:
        f.write(content)
    with pytest.raises(ValueError, match=message) as e:
        LLM(tiny_llama, drafts={"default": draft}, device="cpu")
    assert "draft_vocab.json" in str(e.value)
    # where a job is built (submit, run): before any worker loads it
    from batchspec.jobs.spec import JobSpec
    job = dict(inputs=[str(tmp_path / "in.parquet")], output=str(tmp_path / "out"),
               model=tiny_llama, drafts={"default": draft})
    with pytest.raises(ValueError, match=message):
        JobSpec(**job)
    assert JobSpec(**job, draft_vocab=False).engine_config().draft_vocab is False


def test_the_command_counts_prompts_and_outputs(tiny_llama, tiny_draft, tmp_path):
    """What a job reads (a directory of Parquet inputs, prompts and chat messages), a run's
    outputs (their text) and a text file are counted; the file is what the engine reads."""
    import polars as pl

    from batchspec.models.loader import load_tokenizer
    _register()
    tok = load_tokenizer(tiny_draft)
    draft = str(shutil.copytree(tiny_draft, tmp_path / "draft"))
    (tmp_path / "in").mkdir()
    pl.DataFrame({"prompt": ["def foo(x):\n    return x"] * 3}).write_parquet(
        tmp_path / "in" / "a.parquet")
    pl.DataFrame({"messages": [[{"role": "user", "content": "zebra quiz"}]]}).write_parquet(
        tmp_path / "in" / "b.parquet")
    outputs = tmp_path / "outputs.parquet"
    pl.DataFrame({"text": ["import os", None, "x = 1"]}).write_parquet(outputs)
    notes = tmp_path / "notes.txt"
    notes.write_text("The quick brown fox")
    data = [str(tmp_path / "in"), str(outputs), str(notes)]
    texts = ["def foo(x):\n    return x", "zebra quiz", "import os", "x = 1",
             "The quick brown fox"]
    seen = {t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]}

    def draft_vocab_cmd(*args):
        return CliRunner().invoke(cli, ["draft-vocab", draft, *args])

    run = draft_vocab_cmd(*[a for d in data for a in ("--data", d)], "--size", "8")
    assert run.exit_code == 0, run.output
    about = json.load(open(draft_vocab.path_of(draft)))
    ids = draft_vocab.load(draft, 512)
    assert ids == about["token_ids"] and 8 <= len(ids) <= 9   # and end of sequence
    assert set(ids) - {0} <= seen and about["data"] == data and about["covered"] < 1.0
    llm = LLM(tiny_llama, drafts={"default": draft}, device="cpu")
    assert llm.engine.proposers["default+vocab"].runner.model.head_rows.tolist() == ids
    # --coverage 1.0 keeps every counted token; --remove goes back to the whole vocabulary
    run = draft_vocab_cmd(*[a for d in data for a in ("--data", d)], "--coverage", "1.0")
    assert run.exit_code == 0 and json.load(open(draft_vocab.path_of(draft)))["covered"] == 1.0
    assert seen <= set(draft_vocab.load(draft, 512))
    assert draft_vocab_cmd("--remove").exit_code == 0
    assert draft_vocab.load(draft, 512) is None


def test_the_command_on_bad_input(tiny_draft, tmp_path):
    """A damaged row group is skipped and said so, the rest counted; an unreadable file, a
    file with nothing to count, a missing input and a file that cannot be written: one line
    each, no traceback, and nothing half written."""
    import polars as pl
    import pyarrow.parquet as pq
    _register()
    draft = str(shutil.copytree(tiny_draft, tmp_path / "draft"))

    def draft_vocab_cmd(*args):
        run = CliRunner().invoke(cli, ["draft-vocab", draft, *args])
        assert run.exception is None or isinstance(run.exception, SystemExit), run.output
        return run

    two = tmp_path / "two.parquet"
    pl.DataFrame({"prompt": ["alpha beta"] * 50 + ["gamma delta"] * 50}).write_parquet(
        two, row_group_size=50, compression="uncompressed", statistics=False)
    at = pq.ParquetFile(two).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(two.read_bytes())
    data[at:at + 24] = b"\xff" * 24   # the second row group's page header, byte by byte
    two.write_bytes(bytes(data))
    run = draft_vocab_cmd("--data", str(two), "--coverage", "1.0")
    assert run.exit_code == 0, run.output
    assert "row group 1 skipped" in run.output
    assert json.load(open(draft_vocab.path_of(draft)))["counted_tokens"] > 0
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    run = draft_vocab_cmd("--data", str(bad))
    assert run.exit_code == 1 and "not a readable Parquet file" in run.output
    pl.DataFrame({"other": ["x"]}).write_parquet(tmp_path / "other.parquet")
    run = draft_vocab_cmd("--data", str(tmp_path / "other.parquet"))
    assert run.exit_code == 1 and "no prompt, messages or text to count" in run.output
    assert "no tokens were counted" in run.output
    run = draft_vocab_cmd("--data", str(tmp_path / "missing.parquet"))
    assert run.exit_code == 1 and "does not exist" in run.output
    # the list cannot be written (here: a directory in its place); the old file stays
    os.remove(draft_vocab.path_of(draft))
    os.mkdir(draft_vocab.path_of(draft))
    run = draft_vocab_cmd("--data", str(tmp_path / "two.parquet"))
    assert run.exit_code == 1 and "cannot write" in run.output
    assert os.path.isdir(draft_vocab.path_of(draft))
    assert sorted(os.listdir(draft)) == sorted(os.listdir(tiny_draft) + ["draft_vocab.json"])
    assert draft_vocab_cmd().exit_code == 2   # no --data: a usage error



def test_the_command_skips_directories_it_matched(tiny_draft, tmp_path):
    """A folder a glob (or a folder named) matches may hold folders named like files (a
    Parquet dataset written as x.parquet/): skipped and said so, the rest counted (it failed
    with 'Is a directory')."""
    import polars as pl
    _register()
    draft = str(shutil.copytree(tiny_draft, tmp_path / "draft"))
    (tmp_path / "in" / "dataset.parquet").mkdir(parents=True)
    pl.DataFrame({"prompt": ["def foo(x):"]}).write_parquet(tmp_path / "in" / "a.parquet")
    (tmp_path / "notes.txt").write_text("The quick brown fox")
    for data in (str(tmp_path / "i*"), str(tmp_path / "in")):
        run = CliRunner().invoke(cli, ["draft-vocab", draft, "--data", data, "--data",
                                       str(tmp_path / "*.txt"), "--size", "8"])
        assert run.exit_code == 0, run.output
        assert "dataset.parquet: a directory, skipped" in run.output
        assert json.load(open(draft_vocab.path_of(draft)))["counted_tokens"] > 0


def test_choose_keeps_the_most_frequent_and_fills_from_the_lowest_ids():
    import collections
    counts = collections.Counter({7: 5, 3: 4, 9: 1})
    assert draft_vocab.choose(counts, 12, size=2, always=[11]) == ([3, 7, 11], 0.9)
    # fewer distinct tokens than asked: the lowest ids the text lacks make up the rest
    assert draft_vocab.choose(counts, 12, size=5)[0] == [0, 1, 3, 7, 9]
    assert draft_vocab.choose(counts, 12, coverage=0.5)[0] == [7]
    with pytest.raises(ValueError, match="no tokens were counted"):
        draft_vocab.choose(collections.Counter(), 12, size=4)


def test_a_job_may_score_every_token(tiny_llama, tiny_draft, tmp_path):
    """`--whole-draft-vocab` (run, submit) and `draft_vocab: false` in a job file reach the
    engine: its drafts score every token despite their draft_vocab.json. Told nothing, the
    engine chooses per row (None)."""
    import yaml

    from batchspec.jobs.spec import JobSpec
    from tests.jobdata import job_spec_of
    draft = with_vocab(tiny_draft, tmp_path / "draft", list(range(0, 512, 2)))
    shard = tmp_path / "in.parquet"
    args = [shard, "-o", tmp_path / "out", "--model", tiny_llama, "--draft", f"default={draft}"]
    sampled = ["--temperature", "0.8"]
    configs = {}
    for extra, want in (([], None), (["--whole-draft-vocab"], False), (["--draft-vocab"], True),
                        (sampled, None), (sampled + ["--draft-vocab"], True),
                        (sampled + ["--whole-draft-vocab"], False)):
        config = job_spec_of(args + extra).engine_config()
        assert config.draft_vocab is want, extra
        configs[tuple(extra)] = config
    # jobs that differ in temperature only have one engine config: a worker keeps its engine
    # from one to the other (tasks.get_llm reloads the models for another config)
    assert configs[()] == configs[tuple(sampled)]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"inputs": [str(shard)], "output": str(tmp_path / "o2"),
                                   "model": tiny_llama, "drafts": {"default": draft},
                                   "draft_vocab": False}))
    config = JobSpec.build(config=str(job)).engine_config()
    assert config.draft_vocab is False
    job.write_text(yaml.safe_dump({"inputs": [str(shard)], "output": str(tmp_path / "o3"),
                                   "model": tiny_llama, "drafts": {"default": draft},
                                   "temperature": 0.7}))
    assert JobSpec.build(config=str(job)).engine_config().draft_vocab is None
    llm = LLM.from_config(config)
    assert llm.engine.proposers["default"].runner.model.head_rows is None
    assert llm.engine.source_for("default", 0.0) == "default" and \
        "default+vocab" not in llm.engine.proposers
