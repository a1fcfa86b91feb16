"""Input shards of a job (docs/design.md, "Data formats").

Inputs are Parquet files, or OpenAI Batch request files (*.jsonl, jobs/openai_batch.py),
named by local paths, globs or fsspec URLs (s3://, gs://, ... when the filesystem package
is installed). A job is split into shards of at most `shard_size` rows that never span two
files and follow row-group boundaries where they can, so a shard reads only the row groups
it needs. Shard ids are positions in that plan: the same inputs
and shard size always give the same ids, which is what makes re-running a job resume it."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.jobs import openai_batch

GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Shard:
    index: int
    path: str        # URL or absolute local path of the input file
    source: str      # short stable name of the file, used to generate missing row ids
    start: int       # first row (within the file)
    num_rows: int

    @property
    def id(self) -> str:
        return f"{self.index:05d}"

    @property
    def filename(self) -> str:
        return f"part-{self.index:05d}.parquet"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Shard:
        return cls(**d)


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def expand_inputs(inputs: list[str]) -> list[str]:
    """Paths, directories (their *.parquet files), globs and URLs -> a list of files, in the
    order given (each glob sorted), without duplicates. Missing inputs raise at once."""
    files: list[str] = []
    for item in inputs:
        fs, path = fsspec.core.url_to_fs(item)
        protocol = item.split("://", 1)[0] + "://" if _is_url(item) else ""
        if any(c in path for c in GLOB_CHARS):
            found = sorted(fs.glob(path))
            if not found:
                raise FileNotFoundError(f"input {item!r} matches no files")
        elif fs.isdir(path):
            found = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".parquet"))
            if not found:
                raise FileNotFoundError(f"input directory {item!r} has no *.parquet files")
        elif fs.exists(path):
            found = [path]
        else:
            raise FileNotFoundError(f"input {item!r} does not exist")
        for p in found:
            name = protocol + p.lstrip("/") if protocol else os.path.abspath(p)
            if name not in files:
                files.append(name)
    return files


def _open_parquet(path: str) -> pq.ParquetFile:
    fs, p = fsspec.core.url_to_fs(path)
    try:
        return pq.ParquetFile(fs.open(p, "rb"))
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"input {path!r} is not a readable Parquet file: {e}") from e


def _sources(files: list[str]) -> list[str]:
    """File names relative to the inputs' common folder, without .parquet: short, and
    distinct for distinct files."""
    if len(files) == 1:
        return [_stem(os.path.basename(files[0]))]
    common = os.path.commonpath([f.split("://", 1)[-1] for f in files])
    return [_stem(os.path.relpath(f.split("://", 1)[-1], common)) for f in files]


def _stem(name: str) -> str:
    return name.removesuffix(".parquet").removesuffix(".jsonl")


def split_row_groups(row_group_sizes: list[int], shard_size: int) -> list[tuple[int, int]]:
    """(start, num_rows) ranges of at most shard_size rows. Whole row groups are packed
    together while they fit; a row group larger than shard_size is cut into pieces."""
    ranges: list[tuple[int, int]] = []
    pos = cur_start = 0
    for n in row_group_sizes:
        if pos + n - cur_start > shard_size and pos > cur_start:
            ranges.append((cur_start, pos - cur_start))
            cur_start = pos
        while pos + n - cur_start > shard_size:
            ranges.append((cur_start, shard_size))
            cur_start += shard_size
        pos += n
    if pos > cur_start:
        ranges.append((cur_start, pos - cur_start))
    return ranges


def plan_shards(files: list[str], shard_size: int,
                check_schema=None) -> list[Shard]:
    """Shards of every file, in order. check_schema(path, arrow_schema), when given, raises
    for a file the job cannot use (before anything runs)."""
    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    shards: list[Shard] = []
    for path, source in zip(files, _sources(files), strict=True):
        if openai_batch.is_openai_batch(path):  # OpenAI Batch requests: ranges of lines
            if check_schema is not None:
                check_schema(path, openai_batch.ROW_SCHEMA)
            for start, num_rows in split_row_groups([openai_batch.count_rows(path)], shard_size):
                shards.append(Shard(len(shards), path, source, start, num_rows))
            continue
        pf = _open_parquet(path)
        if check_schema is not None:
            check_schema(path, pf.schema_arrow)
        sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        for start, num_rows in split_row_groups(sizes, shard_size):
            shards.append(Shard(len(shards), path, source, start, num_rows))
    return shards


def read_shard(shard: Shard) -> pa.Table:
    """The shard's rows, reading only the row groups that hold them."""
    if openai_batch.is_openai_batch(shard.path):
        return openai_batch.read_rows(shard.path, shard.start, shard.num_rows, shard.source)
    pf = _open_parquet(shard.path)
    first = offset = 0
    groups = []
    end = shard.start + shard.num_rows
    for i in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(i).num_rows
        if offset < end and offset + n > shard.start:
            if not groups:
                first = offset
            groups.append(i)
        offset += n
    table = pf.read_row_groups(groups) if groups else pf.schema_arrow.empty_table()
    return table.slice(shard.start - first, shard.num_rows)
