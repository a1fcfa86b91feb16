"""Output files of a job: the Arrow schemas of outputs/ and errors/ (acceptance/ holds the
records of batchspec.contract), and atomic writes.

Every output file is written whole to a temporary name and renamed into place, so a reader
(or a crashed writer's successor) never sees half a file."""
from __future__ import annotations

import glob as globlib
import os
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from batchspec.contract import ACCEPTANCE_SCHEMA
from batchspec.jobs.shards import Shard

TMP_SUFFIX = ".tmp"
KINDS = ("outputs", "acceptance", "errors")

i32_list = pa.list_(pa.int32())

OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("text", pa.string()),
    ("token_ids", i32_list),
    ("finish_reason", pa.string()),      # stop | length | abort
    ("num_prompt_tokens", pa.int32()),
    ("num_output_tokens", pa.int32()),
    ("domain", pa.string()),
    ("draft", pa.string()),              # path of the draft (or "ngram"); null = plain
    ("latency_s", pa.float64()),
])

ERROR_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("error_type", pa.string()),
    ("message", pa.string()),
])


def output_fs(out: str):
    """(filesystem, root path) of an output directory (local path or fsspec URL)."""
    fs, root = fsspec.core.url_to_fs(out)
    return fs, root.rstrip("/")


def write_atomic(fs, path: str, data: bytes) -> None:
    """Write `data` to path so that it appears whole or not at all. Locally: temporary file
    in the same folder, fsync, rename, fsync the folder (the rename survives a power cut).
    Object stores publish an object only when its upload completes, so one put suffices."""
    folder = os.path.dirname(path)
    fs.makedirs(folder, exist_ok=True)
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_table_atomic(fs, path: str, table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_atomic(fs, path, sink.getvalue().to_pybytes())


def remove_stale_temps(fs, folder: str, filename: str) -> None:
    """Temporary files a killed writer of `filename` left behind."""
    if isinstance(fs, LocalFileSystem) and os.path.isdir(folder):
        for p in globlib.glob(os.path.join(folder, f".{filename}.*{TMP_SUFFIX}")):
            os.unlink(p)


def shard_path(root: str, kind: str, shard: Shard) -> str:
    return f"{root}/{kind}/{shard.filename}"


def _num_rows(fs, path: str) -> int:
    with fs.open(path, "rb") as f:
        try:
            return pq.ParquetFile(f).metadata.num_rows
        except pa.ArrowException as e:      # (a file damaged after the job wrote it)
            raise ValueError(f"{path} is not a readable Parquet file ({e}): delete it and run "
                             f"the job again, which runs its shard again") from e


def shard_counts(fs, root: str, shard: Shard) -> tuple[int, int]:
    """(rows in outputs, rows in errors) of a shard's files; zeros for files not there."""
    return tuple(_num_rows(fs, p) if fs.exists(p) else 0
                 for p in (shard_path(root, "outputs", shard), shard_path(root, "errors", shard)))


def write_shard_file(fs, root: str, kind: str, shard: Shard, rows: list[dict]) -> None:
    schema = {"outputs": OUTPUT_SCHEMA, "errors": ERROR_SCHEMA,
              "acceptance": ACCEPTANCE_SCHEMA}[kind]
    remove_stale_temps(fs, f"{root}/{kind}", shard.filename)
    write_table_atomic(fs, shard_path(root, kind, shard), pa.Table.from_pylist(rows, schema))


def write_shard(output: str, shard: Shard, outputs: list[dict], records: list[dict],
                errors: list[dict]) -> None:
    """Write a shard's acceptance records, errors and, last (the commit point), outputs."""
    fs, root = output_fs(output)
    write_shard_file(fs, root, "acceptance", shard, records)
    write_shard_file(fs, root, "errors", shard, errors)
    write_shard_file(fs, root, "outputs", shard, outputs)


def read_outputs_for_seed(output: str, max_tokens: int) -> dict[str | None, list[list[int]]]:
    """The completed outputs (token ids) of an earlier run in `output`, per domain, oldest
    shard first, keeping per domain only the newest that fit in max_tokens tokens: what a
    job's suffix_seed feeds the job-wide suffix tries. {} when the directory has no outputs
    (a first run). Only the token_ids, domain and finish_reason columns are read."""
    fs, root = output_fs(output)
    paths = sorted(fs.glob(f"{root}/outputs/*.parquet"))
    per_domain: dict[str | None, list[list[int]]] = {}
    for path in paths:
        with fs.open(path, "rb") as f:
            table = pq.read_table(f, columns=["token_ids", "domain", "finish_reason"])
        for ids, domain, reason in zip(*(table.column(c).to_pylist() for c in
                                         ("token_ids", "domain", "finish_reason"))):
            if ids and reason in ("stop", "length"):
                per_domain.setdefault(domain, []).append(ids)
    for domain, outs in per_domain.items():
        kept, total = [], 0
        for ids in reversed(outs):
            if total + len(ids) > max_tokens:
                break
            kept.append(ids)
            total += len(ids)
        per_domain[domain] = kept[::-1]
    return per_domain
