"""Input shards of a job (docs/design.md, "Data formats").

Inputs are Parquet files, or OpenAI Batch request files (*.jsonl, jobs/openai_batch.py),
named by local paths, globs or fsspec URLs (s3://, gs://, ... when the filesystem package
is installed). A job is split into shards of at most `shard_size` rows that never span two
files and follow row-group boundaries where they can, so a shard reads only the row groups
it needs. Shard ids are positions in that plan: the same inputs
and shard size always give the same ids, which is what makes re-running a job resume it."""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, replace

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
    duplicate_rows: tuple[int, ...] = ()   # rows (from start) whose id an earlier row has
    # text inputs (OpenAI Batch .jsonl): (byte offset, line number) of row `start`
    line_at: tuple[int, int] | None = None
    # the input file's version when the job was planned (file_version); None in plans made
    # before versions were recorded
    version: str | None = None

    @property
    def id(self) -> str:
        return f"{self.index:05d}"

    @property
    def filename(self) -> str:
        return f"part-{self.index:05d}.parquet"

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.duplicate_rows:
            del d["duplicate_rows"]
        else:
            d["duplicate_rows"] = list(self.duplicate_rows)
        if self.line_at is None:
            del d["line_at"]
        else:
            d["line_at"] = list(self.line_at)
        if self.version is None:
            del d["version"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Shard:
        line_at = d.get("line_at")
        return cls(**{**d, "duplicate_rows": tuple(d.get("duplicate_rows", ())),
                      "line_at": None if line_at is None else tuple(line_at)})


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def expand_inputs(inputs: list[str]) -> list[str]:
    """Paths, directories (their *.parquet files), globs (of files or directories) and URLs
    -> a list of files, in the order given (each glob sorted), without duplicates. Missing
    inputs raise at once."""
    files: list[str] = []
    for item in inputs:
        fs, path = fsspec.core.url_to_fs(item)
        protocol = item.split("://", 1)[0] + "://" if _is_url(item) else ""
        if any(c in path for c in GLOB_CHARS):
            # a folder it matches gives its *.parquet files, as a folder named does
            found = [f for p in sorted(fs.glob(path)) for f in
                     (sorted(q for q in fs.ls(p, detail=False) if q.endswith(".parquet"))
                      if fs.isdir(p) else [p])]
            if not found:
                raise FileNotFoundError(f"input {item!r} matches no files")
        elif fs.isdir(path):
            found = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".parquet"))
            if not found:
                raise FileNotFoundError(
                    f"input directory {item!r} has no *.parquet files (a folder gives its "
                    f"Parquet files only: name request files, or glob them: '{item}/*.jsonl')")
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
    return _open_versioned(path, versioned=False)[0]


def _open_versioned(path: str, versioned: bool = True) -> tuple[pq.ParquetFile, str | None]:
    """The Parquet file and, if `versioned`, its version (file_version), from one open of
    it."""
    fs, p = fsspec.core.url_to_fs(path)
    try:
        f = fs.open(p, "rb")
        version = _version(fs.info(p), f) if versioned else None
        return pq.ParquetFile(f), version
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


class InputChanged(ValueError):
    """An input file is not the version its job was planned on."""


def file_version(path: str) -> str:
    """What tells one version of an input file from another: its size and, for Parquet, a
    hash of its footer (the schema and every row group's offsets, sizes and statistics),
    which any rewrite of its rows changes while a copy or a `touch` does not; for other
    files (OpenAI Batch .jsonl), its size and modification time or ETag."""
    fs, p = fsspec.core.url_to_fs(path)
    if openai_batch.is_openai_batch(path):
        return _version(fs.info(p))
    with fs.open(p, "rb") as f:
        return _version(fs.info(p), f)


def _version(info: dict, f=None) -> str:
    """file_version from the file's info and, for Parquet, its open handle `f`."""
    size = info.get("size")
    if f is not None and size is not None and size >= 12:
        f.seek(size - 8)
        tail = f.read(8)
        n = int.from_bytes(tail[:4], "little")
        if tail[4:] == b"PAR1" and 0 < n <= size - 12:
            f.seek(size - 8 - n)
            return f"{size}:{hashlib.sha256(f.read(n)).hexdigest()[:16]}"
    for key in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified",
                "last_modified", "updated"):
        if info.get(key) is not None:
            return f"{size}:{info[key]}"
    return str(size)


def check_version(shard: Shard, now: str | None = None) -> None:
    """Raise InputChanged when the shard's input file (whose version is `now`, read here
    when not given) is not the version it was planned on: its rows would not be the planned
    ones (a file rewritten while its job ran, or before a re-run resumed it)."""
    if shard.version is None:
        return
    now = file_version(shard.path) if now is None else now
    if now != shard.version:
        raise InputChanged(
            f"input {shard.path} changed since its job was planned (version {shard.version}, "
            f"now {now}): its rows are not the planned ones. Submit the job again with "
            f"--overwrite to start over on the new inputs")


def plan_shards(files: list[str], shard_size: int,
                check_schema=None) -> list[Shard]:
    """Shards of every file, in order. check_schema(path, arrow_schema), when given, raises
    for a file the job cannot use (before anything runs)."""
    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    shards: list[Shard] = []
    for path, source in zip(files, _sources(files), strict=True):
        if openai_batch.is_openai_batch(path):  # OpenAI Batch requests: ranges of lines
            version = file_version(path)
            if check_schema is not None:
                check_schema(path, openai_batch.ROW_SCHEMA)
            total, starts = openai_batch.row_starts(path, shard_size)
            for (start, num_rows), at in zip(split_row_groups([total], shard_size), starts,
                                             strict=True):
                shards.append(Shard(len(shards), path, source, start, num_rows, line_at=at,
                                    version=version))
            continue
        pf, version = _open_versioned(path)
        if check_schema is not None:
            check_schema(path, pf.schema_arrow)
        sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        for start, num_rows in split_row_groups(sizes, shard_size):
            shards.append(Shard(len(shards), path, source, start, num_rows, version=version))
    return shards


def read_shard(shard: Shard, columns: list[str] | None = None) -> pa.Table:
    """The shard's rows (of `columns`, default all), reading only the row groups that hold
    them; InputChanged when its file is not the version it was planned on."""
    if openai_batch.is_openai_batch(shard.path):
        check_version(shard)
        table = openai_batch.read_rows(shard.path, shard.start, shard.num_rows, shard.source,
                                       shard.line_at)
        return table if columns is None else table.select(
            [c for c in columns if c in table.column_names])
    pf, version = _open_versioned(shard.path)
    check_version(shard, version)
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
    table = pf.read_row_groups(groups, columns=columns) if groups else \
        pf.schema_arrow.empty_table()
    return table.slice(shard.start - first, shard.num_rows)


def iter_column(path: str, name: str, on_skip=None):
    """(row, value) of one column of a file, row group by row group; a row group that
    cannot be read is skipped (the shards that need it fail when they run), and
    on_skip(row group, error) told of it where given."""
    if openai_batch.is_openai_batch(path):
        yield from openai_batch.iter_column(path, name)
        return
    pf = _open_parquet(path)
    if name not in pf.schema_arrow.names:
        return
    row = 0
    for i in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(i).num_rows
        try:
            values = pf.read_row_group(i, columns=[name]).column(0).to_pylist()
        except (OSError, ValueError, OverflowError, pa.ArrowException) as e:
            values = None
            if on_skip is not None:
                on_skip(i, e)
        if values is not None:
            yield from enumerate(values, row)
        row += n


def mark_duplicates(shards: list[Shard], key) -> list[Shard]:
    """Shards with duplicate_rows set: rows whose key(shard, row, id value) an earlier row
    of the job has (within the file or in an earlier file). Reads only the id columns."""
    by_file: dict[str, list[Shard]] = {}
    for s in shards:
        by_file.setdefault(s.path, []).append(s)
    seen: set[str] = set()
    dups: dict[int, list[int]] = {}
    for path, file_shards in by_file.items():
        values = dict(iter_column(path, "id"))
        for s in file_shards:
            for i in range(s.num_rows):
                k = key(s, i, values.get(s.start + i))
                if k in seen:
                    dups.setdefault(s.index, []).append(i)
                seen.add(k)
    return [replace(s, duplicate_rows=tuple(dups[s.index])) if s.index in dups else s
            for s in shards]
