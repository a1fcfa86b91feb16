"""Input expansion, shard planning and reading, row validation, atomic writes."""
from __future__ import annotations

import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchspec.contract import request_seed
from batchspec.jobs.outputs import remove_stale_temps, write_atomic, write_table_atomic
from batchspec.jobs.rows import check_columns, prepare_requests, row_ids
from batchspec.jobs.shards import Shard, expand_inputs, plan_shards, read_shard, split_row_groups
from tests.jobdata import BAD_ROWS, make_inputs


@pytest.mark.parametrize("sizes,shard_size", [
    ([2, 2, 1], 4), ([4, 4, 2], 5), ([10], 3), ([1] * 7, 3), ([3, 9, 1, 1], 4), ([5], 5)])
def test_split_row_groups_covers_every_row_once(sizes, shard_size):
    ranges = split_row_groups(sizes, shard_size)
    assert all(1 <= n <= shard_size for _, n in ranges)
    rows = [r for start, n in ranges for r in range(start, start + n)]
    assert rows == list(range(sum(sizes)))


def test_split_row_groups_keeps_row_groups_whole_when_they_fit():
    # Row groups [0,4) [4,8) [8,10): a shard of 5 must not cut a group of 4.
    assert split_row_groups([4, 4, 2], 5) == [(0, 4), (4, 4), (8, 2)]
    assert split_row_groups([2, 2, 2], 4) == [(0, 4), (4, 2)]


def test_plan_is_stable_and_reads_exact_rows(tmp_path):
    paths = make_inputs(tmp_path)
    files = expand_inputs([str(tmp_path / "*.parquet")])
    assert files == sorted(paths)
    shards = plan_shards(files, 2)
    assert plan_shards(expand_inputs([str(tmp_path / "*.parquet")]), 2) == shards
    assert [s.id for s in shards] == [f"{i:05d}" for i in range(len(shards))]
    for path in files:
        whole = pq.read_table(path)
        parts = [read_shard(s) for s in shards if s.path == path]
        assert pa.concat_tables(parts).equals(whole)
    assert Shard.from_dict(shards[1].to_dict()) == shards[1]


def test_expand_inputs_dirs_and_missing(tmp_path):
    paths = make_inputs(tmp_path)
    assert expand_inputs([str(tmp_path), paths[0]]) == sorted(paths)  # no duplicates
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        expand_inputs([str(tmp_path / "nope.parquet")])
    with pytest.raises(FileNotFoundError, match="matches no files"):
        expand_inputs([str(tmp_path / "*.csv")])
    # a glob that matches folders gives their Parquet files (it gave the folders, which
    # then failed to read: "Is a directory")
    for day in ("d1", "d2"):
        (tmp_path / day / "outputs").mkdir(parents=True)
        pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / day / "outputs" / "p.parquet")
    assert expand_inputs([str(tmp_path / "d*" / "outputs")]) == [
        str(tmp_path / day / "outputs" / "p.parquet") for day in ("d1", "d2")]


def test_fsspec_url_inputs(tmp_path):
    fs = fsspec.filesystem("memory")
    with fs.open("/shards-test/in.parquet", "wb") as f:
        pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), f, row_group_size=1)
    files = expand_inputs(["memory://shards-test/*.parquet"])
    assert files == ["memory://shards-test/in.parquet"]
    shards = plan_shards(files, 2)
    assert [(s.start, s.num_rows) for s in shards] == [(0, 2), (2, 1)]
    assert read_shard(shards[1]).column("prompt").to_pylist() == ["c"]


def test_unreadable_and_promptless_inputs_fail_fast(tmp_path):
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        plan_shards([str(tmp_path / "x.parquet")], 10)
    schema = pa.schema([("text", pa.string())])
    with pytest.raises(ValueError, match="neither a 'prompt' nor a 'messages'"):
        check_columns("in.parquet", schema, None)
    with pytest.raises(ValueError, match=r"\['question'\]"):
        check_columns("in.parquet", schema, "Q: {question} {text}")
    check_columns("in.parquet", schema, "Summarize: {text}")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from batchspec import LLM
    return LLM(tiny_llama, device="cpu", max_model_len=1024, num_kv_blocks=80, max_num_seqs=4)


def prepare(table, llm, **kw):
    shard = Shard(0, "/data/in.parquet", "in", 10, len(table))
    kw = {"sampling": {"temperature": 0.5, "top_p": 1.0, "top_k": 0, "max_tokens": 8},
          "make_request": llm.make_request} | kw
    return prepare_requests(table, shard, **kw)


def test_bad_rows_become_errors_with_reasons(tmp_path, tokenizer, llm):
    bad = pq.read_table(make_inputs(tmp_path)[2])
    requests, errors = prepare(bad, llm)
    assert [r.request_id for r in requests] == ["bad-ok1", "bad-ok2"]
    assert {e["id"]: e["error_type"] for e in errors} == BAD_ROWS
    messages = {e["id"]: e["message"] for e in errors}
    assert "temperature" in messages["bad-temp"] and "max_tokens" in messages["bad-max"]
    assert "1024" in messages["bad-long"]
    ok2 = requests[1]
    assert ok2.params.max_tokens == 3 and ok2.params.temperature == 0.5
    assert ok2.prompt_token_ids == tokenizer.encode("return value")


def test_wrong_types_and_overrides(tokenizer, llm):
    table = pa.table({"prompt": [1, 2], "top_k": [3.5, 1.0]})
    _, errors = prepare(table, llm)
    assert [e["error_type"] for e in errors] == ["invalid_override", "invalid_prompt"]
    table = pa.table({"prompt": ["a", "b"], "seed": [None, 5], "top_k": [None, 2.0],
                      "domain": ["code", None]})
    requests, errors = prepare(table, llm)
    assert not errors
    assert requests[0].params.seed is None and requests[0].domain == "code"  # engine derives it
    assert requests[1].params.seed == 5 and requests[1].params.top_k == 2


def test_generated_ids_and_seeds_are_stable(tokenizer, llm):
    table = pa.table({"prompt": ["a", "b", "c"], "id": [None, "given", ""]})
    requests, _ = prepare(table, llm)
    assert [r.request_id for r in requests] == ["in:10", "given", "in:12"]
    assert row_ids(table, Shard(0, "/data/in.parquet", "in", 10, 3)) == \
        [r.request_id for r in requests]
    assert request_seed(7, "in:10") == request_seed(7, "in:10") != request_seed(8, "in:10")


def test_duplicate_ids(tokenizer, llm):
    requests, errors = prepare(pa.table({"id": ["x", "y", "x"], "prompt": ["a", "b", "c"]}),
                               llm)
    assert [r.request_id for r in requests] == ["x", "y"]
    assert [(e["id"], e["error_type"]) for e in errors] == [("x", "duplicate_id")]


def test_template_and_chat(tokenizer, llm):
    table = pa.table({"question": ["Why?", None], "context": ["Because.", "x"]})
    requests, errors = prepare(table, llm, template="Q: {question}\nC: {context}\nA:")
    assert requests[0].prompt_token_ids == tokenizer.encode("Q: Why?\nC: Because.\nA:")
    assert errors[0]["error_type"] == "missing_field"
    requests, _ = prepare(pa.table({"prompt": ["hi"]}), llm, chat=True)
    assert requests[0].prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)


def test_write_atomic_replaces_whole_and_leaves_no_temp(tmp_path):
    fs = fsspec.filesystem("file")
    path = str(tmp_path / "outputs" / "part-00000.parquet")
    write_table_atomic(fs, path, pa.table({"x": [1, 2]}))
    write_table_atomic(fs, path, pa.table({"x": [3]}))
    assert pq.read_table(path).column("x").to_pylist() == [3]
    assert os.listdir(tmp_path / "outputs") == ["part-00000.parquet"]
    stale = tmp_path / "outputs" / ".part-00000.parquet.dead.tmp"
    stale.write_bytes(b"half a file")
    remove_stale_temps(fs, str(tmp_path / "outputs"), "part-00000.parquet")
    assert os.listdir(tmp_path / "outputs") == ["part-00000.parquet"]
    write_atomic(fs, str(tmp_path / "_SUCCESS"), b"")
    assert (tmp_path / "_SUCCESS").read_bytes() == b""
