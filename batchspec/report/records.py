"""Where acceptance records are: the acceptance/ parquet files of job output dirs (docs/design.md,
"Data formats"), found under dirs, files and globs, and scanned lazily as one Polars frame.

Paths are local paths or fsspec URLs (`s3://bucket/jobs/`, `gs://...`, `memory://...`,
`file://...`; globs work in both), listed and opened through fsspec, so any filesystem
fsspec has a package for works. Local files are scanned by Polars directly; other files are
handed to Polars as fsspec file objects."""
from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Iterable

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from batchspec.contract import ACCEPTANCE_SCHEMA

log = logging.getLogger(__name__)

_HIVE_DIR = re.compile(r"^[^=]+=[^=]*$")
GLOB_CHARS = "*?["


class NoAcceptanceData(ValueError):
    """A path holds no acceptance records (and no OUT/acceptance/ dir to say it is a job)."""


HOW_TO = "pass job output dirs (OUT with OUT/acceptance/part-*.parquet) or their parquet files"


def _is_done(fs, acc_file: str, acc_dir: str) -> bool:
    """A shard is done exactly when its outputs file exists, and the acceptance file is written
    before it: one without it belongs to a shard still running or cut short, which a rerun
    rewrites. Acceptance logs with no outputs/ dir beside them (copied out of a job) count."""
    outputs = posixpath.join(posixpath.dirname(acc_dir.rstrip("/")), "outputs")
    return not fs.isdir(outputs) or fs.exists(
        posixpath.join(outputs, posixpath.relpath(acc_file, acc_dir)))


def _files_under(fs, path: str) -> list[tuple[str, int]] | None:
    """(file, size) of the parquet files of done shards in every acceptance/ dir at or below
    `path`; None if there is no acceptance/ dir."""
    listing = fs.find(path, withdirs=True, detail=True)
    acc_dirs = {p.rstrip("/") for p, info in listing.items()
                if info["type"] == "directory" and posixpath.basename(p.rstrip("/")) == "acceptance"}
    if posixpath.basename(path.rstrip("/")) == "acceptance":
        acc_dirs.add(path.rstrip("/"))
    if not acc_dirs:
        return None
    found = []
    for p, info in listing.items():
        if info["type"] != "file" or not p.endswith(".parquet"):
            continue
        # The nearest acceptance/ dir above the file, if any.
        parents = [d for d in acc_dirs if p.startswith(d + "/")]
        if parents:
            found.append((p, info.get("size"), max(parents, key=len)))
    done = [(p, size) for p, size, d in found if _is_done(fs, p, d)]
    if len(done) < len(found):
        log.warning("%s: skipping %d acceptance file(s) of shards not done yet (no outputs file)",
                    path, len(found) - len(done))
    return done


def _url(fs, path: str) -> str:
    """How a found file is named: an absolute local path, or a URL."""
    return os.path.abspath(path) if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


# Columns every acceptance file has: a Parquet file given without them is another file of
# a job (outputs/, errors/) or not a job's at all.
RECORD_KEYS = ("request_id", "total_drafted", "total_accepted")


def _holds_records(fs, file: str, path: str, named: bool) -> bool:
    """Whether a Parquet file holds acceptance records: a file named that does not (an
    outputs file, say) is an error; one a glob matched is skipped with a warning (a glob
    over a tree of jobs matches their outputs/ and errors/ files too)."""
    if not fs.size(file):
        return True                              # (debris: skipped with a warning below)
    try:
        with fs.open(file, "rb") as f:
            names = pq.read_schema(f).names
        missing = [c for c in RECORD_KEYS if c not in names]
        why = f"holds no acceptance records (no column {missing[0]!r})" if missing else None
    except pa.ArrowException as e:
        why = f"is not a readable Parquet file ({e})"
    if why is None:
        return True
    if named:
        raise NoAcceptanceData(f"{path}: {file} {why}; {HOW_TO}")
    log.warning("%s: skipping %s, which %s", path, file, why)
    return False


def find_acceptance_files(paths: Iterable[str]) -> list[str]:
    """Parquet files of acceptance records under `paths`: job output dirs (any depth, so a tree
    of jobs or hive partitions works), acceptance/ dirs, parquet files, or globs of these;
    local paths or fsspec URLs. An existing but empty acceptance/ dir is a job with nothing
    written yet, not an error; a dir with no acceptance/ dir at all is, unless a glob matched
    it among others."""
    files: dict[str, int | None] = {}
    for path in [paths] if isinstance(paths, str) else paths:
        fs, root = fsspec.core.url_to_fs(path)
        is_glob = any(c in root for c in GLOB_CHARS) and not fs.exists(root)
        if not is_glob and not fs.exists(root):
            raise NoAcceptanceData(f"{path}: no such path, and no acceptance files match it; "
                                   f"{HOW_TO}")
        found: list[tuple[str, int | None]] = []
        for match in sorted(fs.glob(root)) if is_glob else [root]:
            is_dir = fs.isdir(match)
            under = _files_under(fs, match) if is_dir else None
            if is_dir and under is None and not is_glob:
                if not fs.exists(posixpath.join(match, "_job.json")):
                    raise NoAcceptanceData(f"{path}: no acceptance/ directory below it; "
                                           f"{HOW_TO}")
                under = []           # a job whose inputs held no rows: no shard, no records
            if under is None and not is_dir and match.endswith(".parquet"):
                # (a glob's matches in acceptance/ dirs are trusted as files found under a
                # dir are: a glob over a thousand shards reads no footer twice)
                trusted = is_glob and posixpath.basename(posixpath.dirname(match)) == "acceptance"
                if trusted or _holds_records(fs, match, path, named=not is_glob):
                    under = [(match, fs.size(match))]
            elif under is None and not is_dir and not is_glob:
                raise NoAcceptanceData(f"{path}: not a Parquet file; {HOW_TO}")
            found += under or []
        if is_glob and not found:
            raise NoAcceptanceData(f"{path}: no such path, and no acceptance files match it; "
                                   f"{HOW_TO}")
        files |= {_url(fs, p): size for p, size in found}
    # Writers rename complete files into place, so a zero-byte file is debris, not a shard.
    empty = [f for f, size in files.items() if size == 0]
    if empty:
        log.warning("skipping %d zero-byte file(s), e.g. %s", len(empty), empty[0])
    return sorted(set(files) - set(empty))


def unreadable_file(paths: Iterable[str]) -> str | None:
    """The first acceptance file under `paths` whose Parquet footer cannot be read (what to
    name when a scan fails), or None."""
    for file in find_acceptance_files(paths):
        fs, path = fsspec.core.url_to_fs(file)
        try:
            with fs.open(path, "rb") as f:
                pq.ParquetFile(f)
        except (pa.ArrowException, OSError):
            return file
    return None


def _hive_keys(path: str) -> set[str]:
    return {p.split("=")[0] for p in re.split(r"[/\\]", path)[:-1] if _HIVE_DIR.match(p)}


def scan_acceptance(paths: Iterable[str]) -> pl.LazyFrame:
    """One LazyFrame over every acceptance record under `paths` (see find_acceptance_files)."""
    return scan_files(find_acceptance_files(paths))


def _scan(files: list[str]) -> pl.LazyFrame:
    """The files with their names in column _path: local ones in one Polars scan, others
    through fsspec file objects, one scan each."""
    options = dict(missing_columns="insert", extra_columns="ignore")
    local = [f for f in files if "://" not in f]
    frames = [pl.scan_parquet(local, include_file_paths="_path", **options)] if local else []
    frames += [pl.scan_parquet(fsspec.open(f, "rb").open(), **options)
               .with_columns(pl.lit(f).alias("_path")) for f in files if "://" in f]
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")


def scan_files(files: list[str]) -> pl.LazyFrame:
    if not files:
        return pl.from_arrow(ACCEPTANCE_SCHEMA.empty_table()).lazy()
    lf = _scan(files)
    # Hive partition dirs (key=value) become string columns, null for files outside them.
    # A key that names a record field is left out: a path must not overwrite what the engine
    # recorded (Polars' own hive_partitioning would, and wants one layout for all files).
    keys = sorted(set().union(*map(_hive_keys, files)) - set(ACCEPTANCE_SCHEMA.names))
    return lf.with_columns(pl.col("_path").str.extract(rf"[/\\]{re.escape(k)}=([^/\\]*)[/\\]")
                           .alias(k) for k in keys).drop("_path")
