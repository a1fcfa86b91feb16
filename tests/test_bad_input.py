"""Bad input and a hostile environment end a job cleanly: odd values fail only their rows,
an unreadable row group only its shard, a row that breaks the engine only itself; a full or
read-only disk, an output under a file, Redis unreachable and a missing device give one
line and no traceback, and nothing is written before the failure is known."""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchspec.cli import _register, cli
from batchspec.config import EngineConfig
from tests.jobdata import read_dir

_register()


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def run_job(src, out, model, *extra):
    return run_cli("run", *([src] if isinstance(src, (str, os.PathLike)) else src), "-o", out,
                   "--model", model, "--max-tokens", 4, "-q", *extra)


def test_odd_values_fail_only_their_rows(tmp_path, tiny_llama):
    """Overrides out of range, NaN/inf, a huge top_k (valid: keeps every token), and an
    unused column holding timestamps past year 9999."""
    n = 8
    far = pa.array([dt.datetime(2020, 1, 1)] * (n - 1) + [None], pa.timestamp("us")).cast(
        pa.int64()).to_pylist()
    far[2] = 18_000 * 365 * 86400 * 10**6             # year ~20000: Python cannot hold it
    table = pa.table({
        "id": [f"r{i}" for i in range(n)],
        "prompt": [f"hello {i}" for i in range(n)],
        "top_k": [2**40, None, None, None, None, None, None, 3],
        "temperature": [None, float("nan"), None, float("inf"), None, None, None, None],
        "seed": [None, None, None, None, 1e30, None, -5.0, None],
        "when": pa.array(far, pa.int64()).cast(pa.timestamp("us")),
    })
    src = tmp_path / "odd.parquet"
    pq.write_table(table, src)
    result = run_job(src, tmp_path / "out", tiny_llama, "--template", "{prompt}")
    assert result.exit_code == 0, result.output
    errors = {r["id"]: r for r in read_dir(tmp_path / "out", "errors").to_pylist()}
    assert {k: v["error_type"] for k, v in errors.items()} == {
        "r1": "invalid_override", "r3": "invalid_override", "r4": "invalid_override"}
    assert "finite" in errors["r1"]["message"] and "64 bits" in errors["r4"]["message"]
    ok = sorted(read_dir(tmp_path / "out", "outputs").column("id").to_pylist())
    assert ok == ["r0", "r2", "r5", "r6", "r7"]      # the unused timestamp column is not read
    # Used by the template, the unreadable timestamp fails its own row only.
    result = run_job(src, tmp_path / "out2", tiny_llama, "--template", "{prompt} {when}")
    errors = {r["id"]: r["error_type"] for r in read_dir(tmp_path / "out2", "errors").to_pylist()}
    assert errors["r2"] == "unreadable_value"
    assert "r0" in read_dir(tmp_path / "out2", "outputs").column("id").to_pylist()


def test_duplicate_ids_across_the_job_and_ambiguous_columns(tmp_path, tiny_llama):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": ["x", "y", "z"], "prompt": ["a", "b", "c"]}), a)
    pq.write_table(pa.table({"id": ["y", "w", "x"], "prompt": ["d", "e", "f"]}), b)
    result = run_job([a, b], tmp_path / "out", tiny_llama, "--shard-size", 2)
    assert result.exit_code == 0, result.output
    out = read_dir(tmp_path / "out", "outputs").to_pylist()
    assert sorted(r["id"] for r in out) == ["w", "x", "y", "z"]        # each id once
    firsts = {r["id"]: r["token_ids"] for r in out}
    errors = read_dir(tmp_path / "out", "errors").to_pylist()
    assert sorted((e["id"], e["error_type"]) for e in errors) == [
        ("x", "duplicate_id"), ("y", "duplicate_id")]
    assert firsts                                                       # first rows ran
    two = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["prompt", "prompt"])
    pq.write_table(two, tmp_path / "two.parquet")
    result = run_job(tmp_path / "two.parquet", tmp_path / "out3", tiny_llama)
    assert result.exit_code == 1 and "more than one column named 'prompt'" in result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "out3").exists()


def corrupt_row_group(path, group: int, column: str) -> None:
    """Overwrite the page header of one column chunk in one row group; the footer stays."""
    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    chunk = meta.row_group(group).column(names.index(column))
    with open(path, "r+b") as f:
        f.seek(chunk.data_page_offset)
        f.write(b"\xff" * 24)


def test_unreadable_row_group_fails_only_its_shard(tmp_path, tiny_llama):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(12)],
                             "prompt": [f"text {i}" for i in range(12)]}), src,
                   row_group_size=4, compression="NONE")
    corrupt_row_group(src, 1, "prompt")
    result = run_job(src, tmp_path / "out", tiny_llama, "--shard-size", 4)
    assert result.exit_code == 0, result.output          # completed_with_errors
    assert "Traceback" not in result.output
    doc = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert doc["state"] == "completed_with_errors" and list(doc["failed_shards"]) == ["00001"]
    done = sorted(read_dir(tmp_path / "out", "outputs").column("id").to_pylist())
    assert done == sorted(f"r{i}" for i in (0, 1, 2, 3, 8, 9, 10, 11))
    errors = read_dir(tmp_path / "out", "errors").to_pylist()
    assert sorted(e["id"] for e in errors) == [f"r{i}" for i in (4, 5, 6, 7)]
    assert {e["error_type"] for e in errors} == {"shard_failed"}


def test_a_row_that_breaks_the_engine_fails_alone(tmp_path, tiny_llama, monkeypatch):
    """Rows after a failed step are replayed one at a time: the row that fails again goes
    to errors/ with the reason; the others give the tokens a clean run gives."""
    from batchspec.engine.engine import Engine
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)],
                             "prompt": [f"some words {i}" for i in range(6)]}), src)
    clean = run_job(src, tmp_path / "clean", tiny_llama, "--temperature", 0.7)
    assert clean.exit_code == 0
    check_stop = Engine._check_stop

    def broken(self, seq, new):
        if seq.request_id == "r3" and seq.num_output_tokens >= 2:
            raise RuntimeError("simulated kernel fault")
        return check_stop(self, seq, new)

    monkeypatch.setattr(Engine, "_check_stop", broken)
    result = run_job(src, tmp_path / "out", tiny_llama, "--temperature", 0.7)
    assert result.exit_code == 0, result.output
    errors = read_dir(tmp_path / "out", "errors").to_pylist()
    assert [(e["id"], e["error_type"]) for e in errors] == [("r3", "engine_error")]
    assert "simulated kernel fault" in errors[0]["message"]
    got = {r["id"]: r["token_ids"] for r in read_dir(tmp_path / "out", "outputs").to_pylist()}
    want = {r["id"]: r["token_ids"] for r in read_dir(tmp_path / "clean", "outputs").to_pylist()}
    assert got == {k: v for k, v in want.items() if k != "r3"}


def test_overwrite_runs_a_completed_job_again(tmp_path, tiny_llama):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b", "c d"]}), src)
    assert run_job(src, tmp_path / "out", tiny_llama).exit_code == 0
    first = json.loads((tmp_path / "out" / "_job.json").read_text())["job_id"]
    again = run_job(src, tmp_path / "out", tiny_llama)
    assert again.exit_code == 0 and "already complete" in again.stderr
    redo = run_job(src, tmp_path / "out", tiny_llama, "--overwrite")
    assert redo.exit_code == 0
    doc = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert doc["job_id"] != first and doc["shards_run"] == ["00000"]


def test_overwrite_starts_another_job_over_and_a_bad_model_clears_nothing(tmp_path, tiny_llama):
    """A directory holding another job (other inputs, other max_tokens) is refused with a
    line that names --overwrite, and --overwrite then runs the new job there (it used to
    be refused the same way); a run with --overwrite whose model fails to load leaves the
    old job's files whole; the OpenAI files of the old job go with it."""
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    pq.write_table(pa.table({"prompt": ["a b", "c d"]}), one)
    pq.write_table(pa.table({"prompt": ["e f"]}), two)
    out = tmp_path / "out"
    assert run_job(one, out, tiny_llama, "--output-format", "openai").exit_code == 0
    assert (out / "openai" / "output.jsonl").exists()
    refused = run_job(two, out, tiny_llama)
    assert refused.exit_code == 1 and "--overwrite" in refused.stderr
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    bad = run_job(two, out, str(tmp_path / "no-model"), "--overwrite")
    assert bad.exit_code == 1 and "Traceback" not in bad.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    redo = run_job(two, out, tiny_llama, "--overwrite")
    assert redo.exit_code == 0, redo.output
    assert read_dir(out, "outputs").num_rows == 1 and not (out / "openai").exists()
    other = run_job(two, out, tiny_llama, "--max-tokens", 3, "--overwrite")
    assert other.exit_code == 0, other.output
    assert json.loads((out / "_job.json").read_text())["spec"]["max_tokens"] == 3


def test_damaged_job_files_are_named_in_one_line(tmp_path, tiny_llama):
    """A job file damaged after the job wrote it (a _plan.json cut short, an outputs file
    overwritten): one line that names the file and what to do, which works."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b", "c d"]}), src)
    out = tmp_path / "out"
    assert run_job(src, out, tiny_llama).exit_code == 0
    plan = (out / "_plan.json").read_bytes()
    (out / "_plan.json").write_bytes(plan[:len(plan) // 2])
    r = run_job(src, out, tiny_llama)
    assert r.exit_code == 1 and f"{out / '_plan.json'} is damaged" in r.stderr
    assert "--overwrite" in r.stderr and "Traceback" not in r.output
    (out / "_plan.json").write_bytes(plan)
    part = out / "outputs" / "part-00000.parquet"
    part.write_bytes(part.read_bytes()[:64])
    (out / "_SUCCESS").unlink()
    r = run_job(src, out, tiny_llama)
    assert r.exit_code == 1 and f"{part} is not a readable Parquet file" in r.stderr
    assert "delete it" in r.stderr and "Traceback" not in r.output
    part.unlink()
    assert run_job(src, out, tiny_llama).exit_code == 0
    assert read_dir(out, "outputs").num_rows == 2


def test_a_completed_job_run_again_for_openai_files_writes_them(tmp_path, tiny_llama):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b", "c d"]}), src)
    out = tmp_path / "out"
    assert run_job(src, out, tiny_llama).exit_code == 0
    again = run_job(src, out, tiny_llama, "--output-format", "openai")
    assert again.exit_code == 0, again.output
    lines = (out / "openai" / "output.jsonl").read_text().splitlines()
    assert len(lines) == 2
    doc = json.loads((out / "_job.json").read_text())
    assert doc["shards_run"] == [] and doc["openai_files"]


def _mount_tmpfs(path, options: str) -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 96 KiB filesystem (tmpfs; needs root, as CI has)."""
    path = tmp_path / "disk"
    if not _mount_tmpfs(path, "size=96k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield path
    subprocess.run(["umount", "-l", str(path)])


def test_full_disk_ends_the_job_with_one_line(tmp_path, tiny_llama, small_disk):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"word {i} " * 40 for i in range(40)]}), src)
    with open(small_disk / "filler", "wb") as f:          # leave ~20 KiB
        f.write(b"\0" * 76 * 1024)
    result = run_job(src, small_disk / "out", tiny_llama, "--shard-size", 4, "--max-tokens", 24)
    assert result.exit_code == 1, result.output
    assert "No space left on device" in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) <= 2


def test_read_only_output_and_output_under_a_file(tmp_path, tiny_llama):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b"]}), src)
    (tmp_path / "file").write_text("x")
    result = run_job(src, tmp_path / "file" / "out", tiny_llama)
    assert result.exit_code == 1 and "is a file" in result.stderr
    assert "Traceback" not in result.output
    ro = tmp_path / "ro"
    if not _mount_tmpfs(ro, "ro,size=64k"):
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        result = run_job(src, ro / "out", tiny_llama)
        assert result.exit_code == 1 and "read-only" in result.stderr.lower()
        assert "Traceback" not in result.output
    finally:
        subprocess.run(["umount", "-l", str(ro)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["submit", "status"])
def test_redis_unreachable_is_one_line_and_writes_nothing(command, tmp_path, tiny_llama):
    """In a subprocess, as a user runs it: exit 1, one line on stderr, no file written."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b"]}), src)
    url = f"redis://127.0.0.1:{_free_port()}/0"
    args = {"submit": ["submit", str(src), "-o", str(tmp_path / "out"), "--model", tiny_llama],
            "status": ["status", "job-x"], "jobs": ["jobs"], "cancel": ["cancel", "job-x"]}
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", *args[command],
                           "--broker", url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"Error: cannot reach Redis at {url} (connection refused): start "
                     f"redis-server, or pass --broker / set BATCHSPEC_REDIS_URL"], proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_connection_reset_by_the_redis_port_is_said_in_one_line(tmp_path):
    """A port that accepts and resets each connection (a firewall or proxy in front of
    Redis, or a Redis going down mid-reply): said as 'connection lost', not with redis-py's
    'Error while reading from HOST:PORT : (104, ...)'."""
    import struct
    import threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"

    def reset_all():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(1024)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()                                      # RST, not FIN
    threading.Thread(target=reset_all, daemon=True).start()
    try:
        proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "status", "job-x",
                               "--broker", url], capture_output=True, text=True, timeout=120)
    finally:
        listener.close()
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"Error: cannot reach Redis at {url} (connection lost): start redis-server, or pass "
        f"--broker / set BATCHSPEC_REDIS_URL"], proc.stderr


def test_corrupt_model_files_fail_in_one_line(tmp_path, tiny_llama):
    """A truncated *.safetensors file, a malformed tokenizer_config.json or config.json, and a
    config.json that does not describe the weights (a layer more, another hidden size),
    written byte by byte: `run` exits 1 with one line naming the file and what is wrong, and
    writes no output."""
    import shutil
    pq.write_table(pa.table({"id": ["a"], "prompt": ["hello"]}), tmp_path / "in.parquet")

    def model(name: str):
        shutil.copytree(tiny_llama, tmp_path / name)
        return tmp_path / name

    weights = model("weights")
    for name in os.listdir(weights):
        if name.endswith(".safetensors"):
            data = (weights / name).read_bytes()
            (weights / name).write_bytes(data[:100])
    cut = model("cut")      # the header whole, the last tensor's bytes short
    for name in os.listdir(cut):
        if name.endswith(".safetensors"):
            data = (cut / name).read_bytes()
            (cut / name).write_bytes(data[:-1000])
    tokenizer = model("tokenizer")
    (tokenizer / "tokenizer_config.json").write_bytes(b'{"tokenizer_class": ')
    tokenizer_json = model("tokenizer_json")      # read by the tokenizers library alone
    (tokenizer_json / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": ')
    config = model("config")
    (config / "config.json").write_bytes(b'{"architectures": ["LlamaForCausalLM"],')
    with open(os.path.join(tiny_llama, "config.json")) as f:
        cfg = json.load(f)
    layers, hidden = model("layers"), model("hidden")
    (layers / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers":
                                                           cfg["num_hidden_layers"] + 1}))
    (hidden / "config.json").write_text(json.dumps(cfg | {"hidden_size": cfg["hidden_size"] * 2,
                                                           "head_dim": cfg.get("head_dim") or
                                                           cfg["hidden_size"] //
                                                           cfg["num_attention_heads"]}))
    last = cfg["num_hidden_layers"]
    (tmp_path / "empty").mkdir()
    for model, says in (
            (tmp_path / "empty", "has no config.json: give a Hugging Face model directory"),
            (weights, "model.safetensors is not a readable safetensors file"),
            (cut, "model.safetensors is not a readable safetensors file"),
            (tokenizer, f"{tokenizer / 'tokenizer_config.json'} is not valid JSON"),
            (tokenizer_json, f"cannot load the tokenizer of {str(tokenizer_json)!r}"),
            (config, f"{config / 'config.json'} is not valid JSON"),
            (layers, f"has no tensor model.layers.{last}.input_layernorm.weight that its "
                     f"config.json calls for"),
            (hidden, "tensor model.embed_tokens.weight has shape")):
        result = run_job(tmp_path / "in.parquet", tmp_path / f"out-{model.name}", model)
        assert result.exit_code == 1, result.output
        assert says in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1
        assert not (tmp_path / f"out-{model.name}").exists()     # nothing written
        # what `submit` checks, without torch or reading weights: the same error there
        if model is tokenizer_json:   # submit parses tokenizer_config.json, not the tokenizer
            EngineConfig(model=str(model), device="cpu")
            continue
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(says)):
            EngineConfig(model=str(model), device="cpu")
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(says)):
            EngineConfig(model=tiny_llama, drafts={"code": str(model)}, device="cpu")
    # a broken target and a broken draft: the target's error, every time
    for _ in range(3):
        with pytest.raises(ValueError, match=re.escape(f"{config / 'config.json'} is not valid")):
            EngineConfig(model=str(config), drafts={"code": str(layers), "docs": str(hidden)},
                         device="cpu")


def test_inputs_rewritten_since_the_job_was_planned(tmp_path, tiny_llama):
    """A job's plan records each input file's version (size and a hash of the Parquet
    footer). A re-run into the same directory after an input was rewritten is refused in
    one line (resuming would mix outputs of two versions of it); one after a copy or a
    touch, which leave the rows as they were, resumes. A shard whose file was rewritten
    while its job ran fails with the reason, not with other rows under the planned ids."""
    from batchspec.jobs.runner import ShardDriver, plan_job
    from batchspec.jobs.shards import InputChanged
    from batchspec.jobs.spec import JobSpec
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["a b", "c d"]}), src)
    assert run_job(src, out, tiny_llama).exit_code == 0
    os.utime(src, (1, 1))                            # touched: the same rows
    again = run_job(src, out, tiny_llama)
    assert again.exit_code == 0 and "already complete" in again.stderr, again.output
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["e f", "g h"]}), src)
    again = run_job(src, out, tiny_llama)
    assert again.exit_code == 1 and "Traceback" not in again.output
    assert again.stderr.strip().splitlines()[-1] == (
        f"Error: {out} holds a job planned on another version of its inputs ({src} changed "
        f"since); resuming it would mix outputs of both. Pass --overwrite to start over on "
        f"the new inputs")
    assert run_job(src, out, tiny_llama, "--overwrite").exit_code == 0
    # rewritten between the plan and the shard's run (a worker's view of it)
    spec = JobSpec(inputs=str(src), output=str(tmp_path / "o2"), model=tiny_llama,
                   max_tokens=4)
    [shard] = plan_job(spec)
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["i j", "k l"]}), src)
    from batchspec import LLM
    driver = ShardDriver(spec, LLM(tiny_llama, device="cpu"), "j", contain_failures=False)
    with pytest.raises(InputChanged, match=f"input {src} changed since its job was planned"):
        driver.add(shard)


def test_a_plan_made_before_input_versions_still_resumes(tmp_path, tiny_llama):
    """A job directory whose `_plan.json` holds no input versions (planned before they were
    recorded) resumes as it did: the plans are compared without them."""
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["a b", "c d"]}), src)
    assert run_job(src, out, tiny_llama).exit_code == 0
    plan = json.loads((out / "_plan.json").read_text())
    assert all("version" in s for s in plan["shards"])
    for s in plan["shards"]:
        del s["version"]
    (out / "_plan.json").write_text(json.dumps(plan))
    again = run_job(src, out, tiny_llama)
    assert again.exit_code == 0 and "already complete" in again.stderr, again.output
