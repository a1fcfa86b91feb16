"""The contract from row to record (batchspec.contract): one seed derivation for the API and
jobs, one definition of each aggregate wherever it is reported, verification backends that
agree on malformed drafts, and a core that loads none of the job stack."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from batchspec import contract
from batchspec.cli import _register, cli
from batchspec.spec.verify import VerifyMetadata, resolve_backend, verify

_register()


def test_llm_generate_equals_a_job_token_for_token(tiny_llama, tiny_draft, tmp_path):
    """The same ids and seed through LLM.generate and `batchspec run` (several shards, a
    draft) give the same tokens at T = 0.8: one seed derivation. The job keeps k fixed, as
    LLM does by default: with adaptive lengths (a job's default) which sample a seed gives
    depends on the lengths chosen."""
    import pyarrow as pa

    from batchspec import LLM, SamplingParams
    prompts = [f"row {i} says" + " more" * i for i in range(6)]
    ids = [f"r{i}" for i in range(6)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), src)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["run", str(src), "-o", str(out), "--model", tiny_llama,
                                      "--draft", f"default={tiny_draft}", "--temperature", "0.8",
                                      "--max-tokens", "12", "--seed", "11", "--shard-size", "4",
                                      "--fixed-k", "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    job = {r["id"]: r["token_ids"] for r in pq.read_table(out / "outputs").to_pylist()}

    llm = LLM(tiny_llama, drafts={"default": tiny_draft}, device="cpu", seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=12),
                        request_ids=ids, use_tqdm=False)
    assert {o.request_id: o.token_ids for o in outs} == job
    assert len({tuple(t) for t in job.values()}) > 1


def test_aggregates_agree_everywhere(tiny_llama, tiny_draft, tmp_path):
    """mean_accepted_length and α of one set of records: `_job.json` == `report --json` ==
    evaluate's summary == bench's row, all through batchspec.contract."""
    import pyarrow as pa

    from batchspec.tools.bench import finish_row
    from batchspec.tools.evaluate import summarize as evaluate_summary
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"the {i} and the" for i in range(8)]}), src)
    out = tmp_path / "out"
    runner = CliRunner()
    result = runner.invoke(cli, ["run", str(src), "-o", str(out), "--model", tiny_llama,
                                 "--draft", f"default={tiny_llama}", "--max-tokens", "10",
                                 "--shard-size", "3", "-k", "3", "--min-acceptance", "0",
                                 "--fixed-k", "-q"],   # (adaptive lengths may not draft)
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "acceptance").to_pylist()
    job = json.loads((out / "_job.json").read_text())["summary"]
    report_json = tmp_path / "report.json"
    result = runner.invoke(cli, ["report", str(out), "--json", str(report_json)],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(report_json.read_text())["summary"]
    evaluated = evaluate_summary([{"rounds": r["rounds"], "drafted": r["total_drafted"],
                                   "accepted": r["total_accepted"],
                                   "tokens": contract.decode_tokens(r["tokens_generated"])}
                                  for r in records])
    bench = finish_row({"tokens": 1, "wall_s": 1.0, "totals": contract.totals(records)}, 3, 0.0)

    # Independently: Σ(tokens - 1) / Σ rounds, Σ accepted / Σ drafted.
    want_len = sum(r["tokens_generated"] - 1 for r in records) / sum(r["rounds"] for r in records)
    want_alpha = sum(r["total_accepted"] for r in records) / sum(r["total_drafted"] for r in records)
    assert want_len > 1.0                       # the target drafts for itself: windows accepted
    for got in (job["mean_accepted_length"], report["mean_accepted_length"]):
        assert got == pytest.approx(want_len)
    for got in (evaluated["mean_accepted_length"], bench["tokens_per_pass"]):
        assert got == pytest.approx(want_len, abs=1e-3)   # rounded to 3 digits
    assert job["acceptance_rate"] == pytest.approx(want_alpha)
    assert report["acceptance_rate"] == pytest.approx(want_alpha)
    assert evaluated["acceptance_rate"] == bench["alpha"] == pytest.approx(want_alpha, abs=1e-4)


def test_formulas_take_numbers_and_polars_expressions():
    import polars as pl
    df = pl.DataFrame({"a": [3, 0], "d": [4, 0], "t": [5, 0], "k": [2, 2]})
    got = df.select(contract.acceptance_rate(pl.col("a"), pl.col("d")).alias("alpha"),
                    contract.decode_tokens(pl.col("t")).alias("dec"),
                    contract.expected_tokens_per_pass(0.5, pl.col("k")).alias("e")).to_dicts()
    assert got[0] == {"alpha": 0.75, "dec": 4, "e": contract.expected_tokens_per_pass(0.5, 2)}
    assert got[1]["alpha"] is None and got[1]["dec"] == 0
    assert contract.acceptance_rate(0, 0) is None and contract.decode_tokens(0) == 0
    assert contract.draft_token_share(3, 5) == 0.6 and contract.draft_token_share(0, 0) is None
    assert contract.expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)


def test_a_requests_theoretical_speedup_takes_each_rounds_own_drafts():
    """A round of n drafts makes (1 - p^(n+1)) / (1 - p) tokens (one at n = 0, an adaptive
    engine's plain step) and costs n draft forwards from a model (none from a lookup). A row
    that drafted one round in 41 is priced near plain decoding's 1.0, not at what drafting k
    every round would make; rounds that all draft k from a model give Leviathan's formula.
    The mean comes from the rounds' drafts per depth (what records and the report keep)."""
    e = contract.expected_tokens_per_pass

    def theo(p, drafted, sources, c):
        per_depth = [sum(n > d for n in drafted) for d in range(max(drafted, default=0))]
        return contract.rounds_speedup_theoretical(
            p, len(drafted), per_depth, contract.model_drafted(drafted, sources), c)
    for p in (0.0, 0.5, 0.9, 1.0):
        drafted = [4, 0, 2, 1, 0, 3]
        assert contract.expected_tokens_per_round(p, 6, [4, 3, 2, 1]) == \
            pytest.approx(sum(e(p, n) for n in drafted) / 6)
    assert theo(0.9, [4] * 3, ["/m"] * 3, 0.1) == pytest.approx(e(0.9, 4) / (1 + 4 * 0.1))
    rare = theo(0.9, [4] + [0] * 40, ["/m"] + [None] * 40, 0.1)
    assert rare == pytest.approx((e(0.9, 4) + 40) / 41 / (1 + 0.4 / 41)) and rare < 1.07
    assert theo(1.0, [1] * 8 + [0] * 31, ["/m"] * 8 + [None] * 31, 0.0) == \
        pytest.approx((8 * 2 + 31) / 39)    # one draft a round: two tokens at most
    assert theo(0.5, [4, 2], ["suffix", "/m"], 0.25) == pytest.approx(
        (e(0.5, 4) + e(0.5, 2)) / 2 / (1 + 0.25 * 2 / 2))   # the lookup's drafts are free
    assert theo(0.5, [], [], 0.1) is None
    assert contract.model_drafted([4, 0, 2, 3], ["/m", None, "ngram", "/m"]) == 7


BACKENDS = ["torch", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _meta(drafts, num_draft, temperature, draft_probs=None, dev="cpu"):
    cu = [0]
    for n in num_draft:
        cu.append(cu[-1] + n)
    B = len(num_draft)
    return VerifyMetadata(
        draft_token_ids=torch.tensor(drafts, dtype=torch.int64, device=dev),
        cu_num_draft=torch.tensor(cu, dtype=torch.int32, device=dev),
        temperature=torch.full((B,), temperature, device=dev),
        seeds=torch.arange(B, dtype=torch.int64, device=dev) + 5,
        offsets=torch.zeros(B, dtype=torch.int64, device=dev),
        draft_probs=None if draft_probs is None else draft_probs.to(dev))


def _run(backend, logits, drafts, num_draft, temperature, draft_probs=None):
    dev = "cuda" if backend == "cuda" else "cpu"
    if backend != "torch" and resolve_backend("auto", dev) != backend:
        pytest.skip(f"{backend} kernel not available")
    out, acc = verify(logits.to(dev), _meta(drafts, num_draft, temperature, draft_probs, dev),
                      backend)
    return out.cpu().tolist(), acc.cpu().tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_probs", [False, True])
def test_out_of_range_draft_ids_are_rejected_on_every_backend(temperature, with_probs):
    """docs/verification.md "Malformed drafts": an id outside [0, V) (e.g. a -1 placeholder)
    is rejected, and the token comes from the residual (greedy: the argmax)."""
    V = 16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4 + 4, V, generator=gen)   # rows: request 0 0..3, request 1 4..7
    logits[0, 4] = logits[4, 4] = 9.0              # the valid drafts are the likely tokens
    drafts = [4, -1, 7, 4, V, 2]                   # request 0: 4 ok, -1; request 1: 4 ok, V
    probs = torch.softmax(torch.randn(6, V, generator=gen), -1) if with_probs else None
    results = {b: _run(b, logits, drafts, [3, 3], temperature, probs) for b in BACKENDS}
    out, acc = results["torch"]
    for b in BACKENDS:
        assert results[b] == (out, acc), b
    assert max(acc) <= 1                           # never past the malformed draft
    if temperature == 0:
        assert acc == [1, 1]
    for row, a in zip(out, acc, strict=True):
        assert 0 <= row[a] < V and all(t == -1 for t in row[a + 1:])
    if temperature == 0:
        assert out[0][1] == int(logits[1].argmax()) and out[1][1] == int(logits[5].argmax())


def test_draft_with_zero_draft_probability_is_rejected_on_every_backend():
    """A draft x with q(x) = 0 cannot have been sampled from q: rejected even where p(x) is
    large (vLLM's rule), on every backend."""
    V = 8
    logits = torch.zeros(2, V)
    logits[0, 3] = 6.0                             # p(3) ~ 0.98
    q = torch.full((1, V), 1.0 / (V - 1))
    q[0, 3] = 0.0
    results = {b: _run(b, logits, [3], [1], 1.0, q) for b in BACKENDS}
    for b in BACKENDS:
        assert results[b] == results["torch"], b
    out, acc = results["torch"]
    assert acc == [0] and out[0][1] == -1 and 0 <= out[0][0] < V
    q[0, 3] = 1e-3                                 # any q(x) > 0: accepted (u * q < p)
    assert _run("torch", logits, [3], [1], 1.0, q)[1] == [1]


def test_core_imports_no_job_stack():
    code = ("import sys, batchspec.engine.engine, batchspec.llm, batchspec.contract; "
            "bad = [m for m in ('polars', 'pyarrow', 'celery', 'redis') if m in sys.modules]; "
            "print(','.join(bad))")
    for mod in ("batchspec.engine", ""):
        cmd = code if not mod else code.replace("import sys,", f"import sys, {mod},")
        out = subprocess.run([sys.executable, "-c", cmd], capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == "", f"the core imports {out.stdout.strip()}"
