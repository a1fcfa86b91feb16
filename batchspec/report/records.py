"""Where acceptance records are: the acceptance/ parquet files of job output dirs (docs/design.md,
"Data formats"), found under dirs, files and globs, and scanned lazily as one Polars frame."""
from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Iterable

import polars as pl

from batchspec.contract import ACCEPTANCE_SCHEMA

log = logging.getLogger(__name__)

_HIVE_DIR = re.compile(r"^[^=]+=[^=]*$")


class NoAcceptanceData(ValueError):
    """A path holds no acceptance records (and no OUT/acceptance/ dir to say it is a job)."""


HOW_TO = "pass job output dirs (OUT with OUT/acceptance/part-*.parquet) or their parquet files"


def _is_done(acc_file: str, acc_dir: str) -> bool:
    """A shard is done exactly when its outputs file exists, and the acceptance file is written
    before it: one without it belongs to a shard still running or cut short, which a rerun
    rewrites. Acceptance logs with no outputs/ dir beside them (copied out of a job) count."""
    outputs = os.path.join(os.path.dirname(os.path.normpath(acc_dir)), "outputs")
    return not os.path.isdir(outputs) or os.path.exists(
        os.path.join(outputs, os.path.relpath(acc_file, acc_dir)))


def _files_under(path: str) -> list[str] | None:
    """Parquet files of done shards in every acceptance/ dir at or below `path`; None if
    there is no acceptance/ dir."""
    acc_dirs = glob.glob(os.path.join(glob.escape(path), "**", "acceptance", ""), recursive=True)
    if os.path.basename(os.path.normpath(path)) == "acceptance":
        acc_dirs.append(path)
    if not acc_dirs:
        return None
    found = [(f, d) for d in acc_dirs
             for f in glob.glob(os.path.join(glob.escape(d), "**", "*.parquet"), recursive=True)]
    done = [f for f, d in found if _is_done(f, d)]
    if len(done) < len(found):
        log.warning("%s: skipping %d acceptance file(s) of shards not done yet (no outputs file)",
                    path, len(found) - len(done))
    return done


def find_acceptance_files(paths: Iterable[str]) -> list[str]:
    """Parquet files of acceptance records under `paths`: job output dirs (any depth, so a tree
    of jobs or hive partitions works), acceptance/ dirs, parquet files, or globs of these. An
    existing but empty acceptance/ dir is a job with nothing written yet, not an error; a dir
    with no acceptance/ dir at all is, unless a glob matched it among others."""
    files: list[str] = []
    for path in [paths] if isinstance(paths, str) else paths:
        is_glob = not os.path.exists(path)
        found: list[str] = []
        for match in sorted(glob.glob(path, recursive=True)) if is_glob else [path]:
            under = _files_under(match) if os.path.isdir(match) else None
            if os.path.isdir(match) and under is None and not is_glob:
                raise NoAcceptanceData(f"{path}: no acceptance/ directory below it; {HOW_TO}")
            found += under or ([match] if match.endswith(".parquet") else [])
        if is_glob and not found:
            raise NoAcceptanceData(f"{path}: no such path, and no acceptance files match it; "
                                   f"{HOW_TO}")
        files += found
    # Writers rename complete files into place, so a zero-byte file is debris, not a shard.
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        log.warning("skipping %d zero-byte file(s), e.g. %s", len(empty), empty[0])
    return sorted({os.path.abspath(f) for f in files} - {os.path.abspath(f) for f in empty})


def _hive_keys(path: str) -> set[str]:
    return {p.split("=")[0] for p in path.split(os.sep)[:-1] if _HIVE_DIR.match(p)}


def scan_acceptance(paths: Iterable[str]) -> pl.LazyFrame:
    """One LazyFrame over every acceptance record under `paths` (see find_acceptance_files)."""
    return scan_files(find_acceptance_files(paths))


def scan_files(files: list[str]) -> pl.LazyFrame:
    if not files:
        return pl.from_arrow(ACCEPTANCE_SCHEMA.empty_table()).lazy()
    lf = pl.scan_parquet(files, include_file_paths="_path", missing_columns="insert",
                         extra_columns="ignore")
    # Hive partition dirs (key=value) become string columns, null for files outside them.
    # A key that names a record field is left out: a path must not overwrite what the engine
    # recorded (Polars' own hive_partitioning would, and wants one layout for all files).
    keys = sorted(set().union(*map(_hive_keys, files)) - set(ACCEPTANCE_SCHEMA.names))
    return lf.with_columns(pl.col("_path").str.extract(rf"[/\\]{re.escape(k)}=([^/\\]*)[/\\]")
                           .alias(k) for k in keys).drop("_path")
