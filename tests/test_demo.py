"""The demo model family, `batchspec distill` and `batchspec evaluate` on real (tiny) models."""
from __future__ import annotations

import json
import os
from collections import Counter

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from batchspec.tools import hfref
from batchspec.tools.distill import distill, distill_draft, kl_loss, make_sequences
from batchspec.tools.evaluate import evaluate
from batchspec.tools.training import new_llama, train

TINY_DRAFT = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=64)


def test_demo_models_load_and_share_vocabulary():
    from transformers import AutoConfig, AutoTokenizer

    from batchspec import demo_models
    paths = demo_models()
    assert set(paths) == {"target", "draft", "draft-code", "draft-docs"}
    vocab = {AutoConfig.from_pretrained(p).vocab_size for p in paths.values()}
    assert len(vocab) == 1
    tok = AutoTokenizer.from_pretrained(paths["target"])
    assert len(tok) == vocab.pop() and tok.eos_token is not None
    model = hfref.load_causal_lm(paths["draft-code"])
    assert model.config.num_hidden_layers < AutoConfig.from_pretrained(
        paths["target"]).num_hidden_layers
    total = sum(os.path.getsize(os.path.join(p, f)) for p in paths.values() for f in os.listdir(p))
    assert total < 40e6


def test_demo_tokenizer_round_trips_code_and_prose():
    from transformers import AutoTokenizer

    from batchspec import demo_models
    tok = AutoTokenizer.from_pretrained(demo_models()["target"])
    text = "def f(x):\n    return {'é': x ** 2}  # naïve\n\nReturn the square of x.\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "hi" in chat


@pytest.fixture
def prompts_parquet(tmp_path):
    path = tmp_path / "prompts.parquet"
    pl.DataFrame({"prompt": ["def add(a, b):\n", "Return the", "import os\n", "The value"],
                  "domain": ["code", "docs", "code", "docs"]}).write_parquet(path)
    return str(path)


def test_distill_writes_a_loadable_draft(tiny_llama, prompts_parquet, tmp_path):
    out = str(tmp_path / "draft")
    report = distill_draft(tiny_llama, out, data=prompts_parquet, steps=3, seconds=None,
                           num_prompts=4, gen_tokens=8, batch_size=2, size=TINY_DRAFT,
                           eval_data=prompts_parquet, eval_prompts=4)
    assert report["steps"] == 3 and 0.0 <= report["alpha_after"] <= 1.0
    model = hfref.load_causal_lm(out)
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 1
    assert not os.path.exists(out + ".work")  # work files go once the draft is written
    umask = os.umask(0)
    os.umask(umask)      # the weights as readable as the other files (safetensors: 0600)
    for name in ("model.safetensors", "config.json"):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o666 & ~umask, name


def test_distill_resumes_from_its_checkpoint(tiny_llama, prompts_parquet, tmp_path):
    tok = hfref.load_tokenizer(tiny_llama)
    target = hfref.load_causal_lm(tiny_llama)
    prompts = pl.read_parquet(prompts_parquet).to_dicts()
    ids, conts = make_sequences(target, tok, prompts, max_tokens=6, seed=0)

    def run(ckpt, interrupt_at=None):
        draft = new_llama(tok, **TINY_DRAFT, seed=0)

        def loss_fn(step):
            if step == interrupt_at:
                raise KeyboardInterrupt
            return kl_loss(target, draft, ids, conts, step, batch_size=2,
                           pad_id=tok.eos_token_id, seed=0)
        train(draft, loss_fn, steps=6, seconds=None, lr=1e-2, ckpt_path=ckpt, ckpt_every_s=0)
        return draft

    straight = run(str(tmp_path / "a.pt"))
    with pytest.raises(KeyboardInterrupt):
        run(str(tmp_path / "b.pt"), interrupt_at=4)
    resumed = run(str(tmp_path / "b.pt"))
    assert torch.load(str(tmp_path / "b.pt"), weights_only=True)["state"]["step"] == 6
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_training_autocasts_to_bf16_only_where_the_cpu_multiplies_it(tiny_llama):
    """Training runs its loss under bf16 autocast only on CPUs with bf16 arithmetic (AMX,
    AVX512-BF16): elsewhere bf16 is emulated, and a distillation step ran 7.5x slower under
    it than in fp32 (AVX2). Asked for, autocast is on or off as told."""
    from batchspec.config import cpu_has_native_bf16
    tok = hfref.load_tokenizer(tiny_llama)
    seen = []

    def loss_fn(step):
        seen.append(torch.is_autocast_enabled("cpu"))
        return sum(p.float().pow(2).sum() for p in draft.parameters())

    for told, want in (({}, cpu_has_native_bf16()), ({"autocast": True}, True),
                       ({"autocast": False}, False)):
        draft = new_llama(tok, **TINY_DRAFT, seed=0)
        seen.clear()
        train(draft, loss_fn, steps=1, seconds=None, lr=1e-3, **told)
        assert seen == [want]


def test_evaluate_gate(tiny_llama, tiny_draft, prompts_parquet, tmp_path):
    runner = CliRunner()
    args = ["--target", tiny_llama, "--data", prompts_parquet, "--max-tokens", "12",
            "--backend", "transformers", "--min-acceptance", "0.99"]
    bad = runner.invoke(evaluate, args + ["--draft", tiny_draft])
    assert bad.exit_code == 1, bad.output
    report = tmp_path / "alpha.json"
    good = runner.invoke(evaluate, args + ["--draft", tiny_llama, "--json", str(report),
                                           "--temperature", "0", "--temperature", "0.8"])
    assert good.exit_code == 0, good.output
    result = json.loads(report.read_text())
    assert result["by_temperature"]["0.0"]["acceptance_rate"] == 1.0
    assert result["by_temperature"]["0.8"]["acceptance_rate"] == 1.0  # q == p: always accept
    assert set(result["by_domain"]) == {"code", "docs"}


def test_distill_cli_needs_a_target():
    result = CliRunner().invoke(distill, ["-o", "x"])
    assert result.exit_code != 0 and "--target" in result.output


def test_replay_windows_counts_rounds_like_the_engine():
    from batchspec.tools.hfref import replay_windows
    # first token from prefill; 7 more in rounds of up to k=4 drafts, never drafting past
    # the end: 4 drafts (+1 target token), then 1 draft (+1)
    assert replay_windows([True] * 8, 4) == {"rounds": 2, "drafted": 5, "accepted": 5,
                                             "tokens": 7}
    # round 1 drafts 3 and keeps 1 (+1 target token); round 2 drafts 1 and keeps it (+1)
    assert replay_windows([True, True, False, True, False], 4) == {
        "rounds": 2, "drafted": 4, "accepted": 2, "tokens": 4}


def test_bench_runs_every_method_side_by_side(tiny_llama, tiny_draft, prompts_parquet, tmp_path):
    pytest.importorskip("batchspec.spec.verify")
    from batchspec.tools.bench import METHODS, bench
    from tests.test_draft_vocab import with_vocab
    out = tmp_path / "bench.json"
    # the docs draft scores half the vocabulary: at T = 0 only, as a job's draft would
    docs_draft = with_vocab(tiny_draft, tmp_path / "docs-draft", list(range(0, 512, 2)))
    result = CliRunner().invoke(bench, [
        "--target", tiny_llama, "--draft", tiny_draft, "--draft-code", tiny_llama,
        "--draft-docs", docs_draft, "--data", prompts_parquet, "--max-tokens", "8",
        "--batch-sizes", "1,2", "--temperatures", "0,0.8", "--num-prompts", "1",
        "--min-batches", "2", "--fresh-prompts", "--json", str(out)])
    assert result.exit_code == 0, result.output
    info = json.loads(out.read_text())
    rows = info["rows"]
    assert info["fresh_prompts"] is True
    assert {r["method"] for r in rows} == set(METHODS)
    assert len(rows) == 2 * 2 * len(METHODS) - 2  # assisted generation: batch size 1 only
    for r in rows:
        assert r["tok_s"] > 0 and r["tokens"] > 0
        assert r["num_prompts"] == 2 * r["batch_size"]   # two full batches a cell
        # each row says its cell's prompts by domain: the file's domains take turns
        assert r["domains"] == {"code": r["batch_size"], "docs": r["batch_size"]}
    spec = [r for r in rows if r["method"] == "spec-domain" and r["temperature"] == 0.0]
    assert all(0 < r["alpha"] < 1 and "observed_over_theoretical" in r for r in spec)
    # rows of model drafts carry their cost ratio (the code draft is the target: c = 1)
    from batchspec.tools.bench import LOOKUP_METHODS
    for r in rows:
        if r["method"] in ("spec-domain", "spec-adaptive"):
            assert 0.4 < r["cost_ratio"] < 1
        elif r["method"] in ("plain", "hf", "hf-assisted", *LOOKUP_METHODS):
            assert "cost_ratio" not in r
    # the docs draft's list at T = 0, its whole vocabulary at T = 0.8 (a larger c)
    c = {(r["batch_size"], r["temperature"]): r["cost_ratio"] for r in rows
         if r["method"] == "spec-domain"}
    assert all(c[(b, 0.0)] < c[(b, 0.8)] for b in (1, 2)), c
    assert all(r["draft_vocab"] is (r["temperature"] == 0) for r in rows
               if r["method"].startswith("spec"))


def test_bench_fresh_prompts_has_every_run_compute_its_prompts(tiny_llama):
    """A bench round runs the same prompts as the round before: its prompts' full blocks come
    from the prefix cache, unless --fresh-prompts empties it first, as a job of new prompts
    finds it."""
    from batchspec import SamplingParams
    from batchspec.tools.bench import _start_afresh, make_llm
    models = dict.fromkeys(("target", "draft", "draft-code", "draft-docs"), tiny_llama)
    llm = make_llm("plain", models, 2, 3, 0, 0.0, 1, "float32")
    prompts = [list(range(1, 40)), list(range(2, 41))]    # two full blocks of 16 each
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(fresh_prompts):
        _start_afresh(llm, fresh_prompts)
        return [o.num_cached_prompt_tokens for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
    assert cached(False) == [0, 0]          # the first run
    assert cached(False) == [32, 32]        # the same prompts again: from the cache
    assert cached(True) == [0, 0]


def _resident_share(tensor) -> float:
    """Share of the pages under a contiguous CPU tensor that are in memory (mincore)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec) / pages


def test_bench_engines_hold_their_kv_caches_written_from_the_start(tiny_llama, tiny_draft):
    """Every bench engine's KV caches (the target's and each draft's) are written whole when
    it is built: with pages faulted in as rows first write them, a method whose outputs change
    from run to run took blocks never written in its timed runs, where seeded plain and
    fixed-k runs wrote the same blocks again, and paid page faults the others did not. An
    engine built outside the bench keeps its cache unwritten until rows use it."""
    from batchspec import LLM
    from batchspec.spec.proposer import DraftModelProposer
    from batchspec.tools.bench import make_llm
    models = {"target": tiny_llama, "draft": tiny_draft, "draft-code": tiny_draft,
              "draft-docs": tiny_draft}
    engine = make_llm("spec-adaptive", models, 2, 3, 0, 0.0, 1, "float32").engine
    runners = [engine.target] + [p.runner for p in engine.proposers.values()
                                 if isinstance(p, DraftModelProposer)]
    assert len(runners) >= 2
    for runner in runners:
        for k, v in runner.kv_caches:
            assert _resident_share(k) == 1.0 and _resident_share(v) == 1.0
    lazy = LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=4096).engine
    k, v = lazy.target.kv_caches[-1]
    assert _resident_share(k) < 0.5 and _resident_share(v) < 0.5


def test_bench_pairs_each_rounds_runs_for_its_ratios():
    """The fastest runs of two methods may come from different stretches of a machine whose
    speed drifts; the paired ratio is the median of each round's ratio."""
    from batchspec.tools.bench import add_speedups
    rows = [{"method": "plain", "batch_size": 32, "temperature": 0.0, "tok_s": 100.0,
             "runs_tok_s": [100.0, 50.0, 80.0]},
            {"method": "spec", "batch_size": 32, "temperature": 0.0, "tok_s": 120.0,
             "runs_tok_s": [110.0, 70.0, 120.0]},
            {"method": "ngram", "batch_size": 32, "temperature": 0.0, "tok_s": 90.0,
             "runs_tok_s": [90.0]}]
    add_speedups(rows)
    assert rows[1]["x_plain"] == 1.2 and rows[1]["x_plain_paired"] == 1.4
    assert "x_plain_paired" not in rows[2]     # runs that do not pair up
    assert "x_plain_paired" not in rows[0]     # a baseline is not paired with itself


def test_bench_engines_take_turns_in_slices_to_the_last_job(tiny_llama, tiny_draft):
    """--turns steps: the engines of a round take turns in balanced_turns' orders, each
    charged its own steps' time; an engine whose job is done keeps stepping, untimed, until
    the last is done; a slice runs an engine's steps back to back. Outputs and counts are
    those of whole runs."""
    pytest.importorskip("batchspec.spec.verify")
    from batchspec.tools.bench import balanced_turns, make_llm, run_engine, run_engines_in_turns
    models = {"target": tiny_llama, "draft": tiny_llama, "draft-code": tiny_draft,
              "draft-docs": tiny_llama}   # rows without a domain: a perfect draft
    llms = {m: make_llm(m, models, 2, 3, 0, 0.0, 1, "float32")
            for m in ("plain", "spec-domain", "suffix")}
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [2, 4, 6, 8, 10, 12], [9, 9, 9]]
    domains = [None, "docs", None, "code"]
    kw = dict(domains=domains, temperature=0.0, max_tokens=6)
    alone = {m: run_engine(llm, prompts, **kw) for m, llm in llms.items()}
    order, made = [], dict.fromkeys(llms, 0)

    def stepper(m, step):
        def counted():
            order.append(m)
            finished, tokens = step()
            made[m] += tokens
            return finished, tokens
        return counted
    for m, llm in llms.items():
        llm.step = stepper(m, llm.step)
    timed = []
    turns = run_engines_in_turns(llms, prompts, **kw, slice_s=0,
                                 on_step=lambda turn, m, s, n: timed.append(m))
    for m in llms:
        assert turns[m]["tokens"] == alone[m]["tokens"] == 4 * 6
        assert turns[m]["totals"] == alone[m]["totals"]
        assert 0 < turns[m]["wall_s"]
        assert not llms[m].engine.has_unfinished()      # the untimed steps are cleaned up
    names = list(llms)
    cycle = [names[i] for turn in balanced_turns(3) for i in turn]
    assert order == (cycle * len(order))[:len(order)]   # every engine in every turn, to the end
    assert timed.count("plain") > timed.count("spec-domain")  # spec finishes in fewer steps
    assert made["spec-domain"] > 4 * 6             # then makes tokens, untimed
    assert order.count("plain") == timed.count("plain")              # plain finished last
    order.clear()
    timed.clear()
    run_engines_in_turns(llms, prompts, **kw, slice_s=60.0,
                         on_step=lambda turn, m, s, n: timed.append(m))
    assert order == timed == sorted(timed, key=names.index)   # each job in one slice


def test_turn_orders_follow_each_engine_by_each_other_equally():
    """balanced_turns: every turn runs each engine once, and over a cycle of turns (taken
    again and again) each engine's slice comes right after each other engine's exactly once,
    the last turn's end handing to the first turn's start included."""
    from batchspec.tools.bench import balanced_turns
    for n in range(1, 8):
        turns = balanced_turns(n)
        assert all(sorted(turn) == list(range(n)) for turn in turns)
        seq = [e for turn in turns for e in turn]
        pairs = Counter(zip(seq, seq[1:] + seq[:1]))
        if n == 1:
            assert pairs == {(0, 0): 1}
            continue
        assert len(turns) == n - 1
        assert pairs == {(a, b): 1 for a in range(n) for b in range(n) if a != b}


def test_replayed_alpha_equals_the_engines_at_greedy(prompts_parquet):
    """The transformers replay (used by distill) and real speculative decoding count the
    same rounds on the bundled pair at T=0 (in fp32: in bf16 the two ways of computing the
    same logits round differently and near-ties can flip)."""
    pytest.importorskip("batchspec.spec.verify")
    from batchspec import demo_models
    from batchspec.tools.evaluate import evaluate_pair, load_prompts
    models = demo_models()
    prompts = load_prompts(None, None, 8, split="heldout")
    results = [evaluate_pair(models["target"], models["draft"], prompts, max_tokens=32,
                             backend=b, dtype="float32")["overall"] for b in ("transformers", "engine")]
    assert results[0] == results[1]
    assert 0.3 < results[0]["acceptance_rate"] < 1.0


def test_a_prompt_pools_first_rows_hold_every_domain(tmp_path):
    """`batchspec bench` gives a cell of batch size b the first max(num_prompts, min_batches
    x b) prompts of one pool: from the demo corpus, as from a Parquet file, those first rows
    hold an even share of each domain (the corpus's prompts came domain after domain, and
    the cells up to 32 rows of a bench up to 64 ran code prompts alone)."""
    import polars as pl

    from batchspec.demo.corpus import corpus_prompts
    from batchspec.tools.evaluate import load_prompts
    pool = load_prompts(None, None, 512, split="heldout")
    for n in (1, 2, 64, 256, 512):
        codes = sum(p["domain"] == "code" for p in pool[:n])
        assert codes == -(-n // 2), n
    assert sorted(p["prompt"] for p in pool) == sorted(     # the same prompts, in turns
        p["prompt"] for p in corpus_prompts("heldout", num_per_domain=256, seed=0))
    path = tmp_path / "p.parquet"
    pl.DataFrame({"prompt": [f"c{i}" for i in range(6)] + [f"d{i}" for i in range(6)],
                  "domain": ["code"] * 6 + ["docs"] * 6}).write_parquet(path)
    assert [p["prompt"] for p in load_prompts(str(path), None, 4, split="heldout")] == \
        ["c0", "d0", "c1", "d1"]


def test_bench_on_a_target_without_drafts(tiny_llama, prompts_parquet, tmp_path):
    from batchspec.tools.bench import bench
    out = tmp_path / "bench.json"
    args = ["--target", tiny_llama, "--data", prompts_parquet, "--max-tokens", "4",
            "--batch-sizes", "2", "--temperatures", "0"]
    result = CliRunner().invoke(bench, args + ["--json", str(out)])
    assert result.exit_code == 0, result.output
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == \
        ["hf", "plain", "ngram", "suffix", "suffix-adaptive"]
    result = CliRunner().invoke(bench, args + ["--methods", "spec"])
    assert result.exit_code == 2 and "need a draft model" in result.output


def one_line_error(result, code: int, message: str):
    """A user's mistake: exit `code`, `message` on one line, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output, result.output


@pytest.fixture
def bad_inputs(tmp_path, model_factory):
    """Paths a user may get wrong: a text file given as Parquet, a file with an empty prompt,
    a draft of another vocabulary, a --json whose directory does not exist."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a table")
    empty = tmp_path / "empty.parquet"
    pl.DataFrame({"prompt": ["def f():\n", ""]}).write_parquet(empty)
    return {"notes": str(notes), "empty": str(empty),
            "other_vocab": model_factory("llama", vocab_size=600, num_layers=1, hidden_size=32,
                                         num_heads=2, num_kv_heads=1, seed=2),
            "no_dir_json": str(tmp_path / "missing" / "x.json"), "nodir": str(tmp_path / "nodir")}


@pytest.mark.parametrize("args,message", [
    (["--draft", "{nodir}"], "has no config.json"),
    (["--target", "{nodir}"], "has no config.json"),
    (["--draft", "{other_vocab}"], "has vocabulary size 600"),
    (["--k", "-1"], "Invalid value for '--k'"),
    (["--temperature", "-1"], "Invalid value for '--temperature'"),
    (["--temperature", "nan"], "not a finite number"),
    (["--max-tokens", "0"], "Invalid value for '--max-tokens'"),
    (["--num-prompts", "0"], "Invalid value for '--num-prompts'"),
    (["--data", "{notes}"], "not a readable Parquet file"),
    (["--data", "{empty}"], "prompt 1 is empty"),
    (["--domain", "nosuch"], "no prompts of domain 'nosuch'"),
    (["--json", "{no_dir_json}"], "cannot write"),
])
def test_evaluate_user_errors_exit_2(tiny_llama, tiny_draft, prompts_parquet, bad_inputs,
                                     args, message):
    """A command that cannot run exits 2 (a failed gate exits 1), one line, before any model
    runs: the --json path too, which failed only after the whole evaluation."""
    base = {"--target": tiny_llama, "--draft": tiny_draft, "--data": prompts_parquet,
            "--max-tokens": "4", "--backend": "transformers"}
    given = dict(zip(args[::2], (a.format(**bad_inputs) for a in args[1::2])))
    result = CliRunner().invoke(evaluate, [a for kv in {**base, **given}.items() for a in kv])
    one_line_error(result, 2, message)
    assert "alpha" not in result.output     # nothing was evaluated


def test_evaluate_without_drafts_reports_no_acceptance_rate(tiny_llama, tiny_draft,
                                                            prompts_parquet, tmp_path):
    """k = 0 drafts nothing: α is n/a (null), as the rest of the project says it, not 0;
    a gate cannot pass on it."""
    report = tmp_path / "alpha.json"
    args = ["--target", tiny_llama, "--draft", tiny_draft, "--data", prompts_parquet,
            "--max-tokens", "4", "--backend", "transformers", "--k", "0"]
    result = CliRunner().invoke(evaluate, args + ["--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "n/a" in result.output
    assert json.loads(report.read_text())["overall"]["acceptance_rate"] is None
    gate = CliRunner().invoke(evaluate, args + ["--min-acceptance", "0.5"])
    assert gate.exit_code == 1 and "nothing was drafted" in gate.output


@pytest.mark.parametrize("args,code,message", [
    (["--steps", "0"], 2, "Invalid value for '--steps'"),
    (["--steps", "-1"], 2, "Invalid value for '--steps'"),      # it never stopped
    (["--time-budget", "0"], 2, "Invalid value for '--time-budget'"),
    (["--batch-size", "0"], 2, "Invalid value for '--batch-size'"),
    (["--gen-tokens", "0"], 2, "Invalid value for '--gen-tokens'"),
    (["--lr", "-1"], 2, "Invalid value for '--lr'"),
    (["--num-prompts", "0"], 2, "Invalid value for '--num-prompts'"),
    (["--domain", "nosuch"], 1, "no prompts of domain 'nosuch'"),
    (["--data", "{empty}"], 1, "prompt 1 is empty"),
    (["--data", "{notes}"], 1, "not a readable Parquet file"),
    (["--target", "{nodir}"], 1, "has no config.json"),
    (["--init", "{other_vocab}"], 1, "has vocabulary size 600"),
    (["-o", "{notes}/draft"], 1, "cannot write"),
])
def test_distill_user_errors_are_one_line(tiny_llama, prompts_parquet, bad_inputs, tmp_path,
                                          args, code, message):
    """Bad options and inputs fail before the target generates (no Hugging Face Hub for a
    missing target, no torch error for an empty prompt list)."""
    base = {"--target": tiny_llama, "-o": str(tmp_path / "draft"), "--data": prompts_parquet,
            "--eval-data": prompts_parquet, "--steps": "1", "--num-prompts": "2",
            "--gen-tokens": "2", "--batch-size": "2", "--eval-prompts": "2"}
    given = dict(zip(args[::2], (a.format(**bad_inputs) for a in args[1::2])))
    result = CliRunner().invoke(distill, [a for kv in {**base, **given}.items() for a in kv])
    one_line_error(result, code, message)
    assert "huggingface.co" not in result.output
    assert not os.path.exists(tmp_path / "draft.work")     # nothing was generated


@pytest.mark.parametrize("args,code,message", [
    (["--batch-sizes", "0"], 2, "Invalid value for '--batch-sizes'"),
    (["--batch-sizes", "-2"], 2, "Invalid value for '--batch-sizes'"),
    (["--batch-sizes", ""], 2, "give at least one value"),
    (["--batch-sizes", "a"], 2, "Invalid value for '--batch-sizes'"),
    (["--temperatures", "-1"], 2, "Invalid value for '--temperatures'"),
    (["--temperatures", "nan"], 2, "not a finite number"),
    (["--temperatures", ""], 2, "give at least one value"),  # it printed a bare header
    (["--repeats", "0"], 2, "Invalid value for '--repeats'"),
    (["--max-tokens", "0"], 2, "Invalid value for '--max-tokens'"),
    (["--domain", "nosuch"], 1, "no prompts of domain 'nosuch'"),  # it printed 0.0 tok/s
    (["--data", "{notes}"], 1, "not a readable Parquet file"),
    (["--draft", "{other_vocab}"], 1, "has vocabulary size 600"),
    (["--target", "{nodir}"], 1, "has no config.json"),
    (["--json", "{no_dir_json}"], 1, "cannot write"),
])
def test_bench_user_errors_are_one_line(tiny_llama, prompts_parquet, bad_inputs, args, code,
                                        message):
    """Bad options and inputs fail before any model loads or runs."""
    from batchspec.tools.bench import bench
    base = {"--target": tiny_llama, "--data": prompts_parquet, "--max-tokens": "2",
            "--methods": "plain", "--batch-sizes": "1", "--temperatures": "0",
            "--num-prompts": "1", "--min-batches": "1"}
    given = dict(zip(args[::2], (a.format(**bad_inputs) for a in args[1::2])))
    result = CliRunner().invoke(bench, [a for kv in {**base, **given}.items() for a in kv])
    one_line_error(result, code, message)
    assert "tok/s" not in result.output and "huggingface.co" not in result.output
