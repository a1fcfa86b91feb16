"""`batchspec report` over fsspec URLs (memory://, file://), directories and globs alike,
equal to the report of the same files on a local path."""
from __future__ import annotations

import os

import fsspec
import pytest
from click.testing import CliRunner

from batchspec.report.analysis import NoAcceptanceData, analyze, find_acceptance_files
from batchspec.report.command import report
from tests.acceptance_records import make_record, synthetic_records, write_job, write_records


@pytest.fixture
def local_tree(tmp_path):
    """Two jobs, a hive-partitioned one, a shard not done (acceptance without outputs while
    outputs/ exists), a zero-byte file and an unrelated folder."""
    records = synthetic_records(300, seed=4)
    root = tmp_path / "jobs"
    write_job(str(root / "a"), [records[:100]])
    b = write_job(str(root / "b"), [records[100:250], records[250:]])
    os.makedirs(os.path.join(b, "outputs"))
    for i in (0, 1):
        open(os.path.join(b, "outputs", f"part-{i:05d}.parquet"), "wb").write(b"x")
    write_records(os.path.join(b, "acceptance", "part-00002.parquet"),
                  [make_record("running", [(4, 0)])])      # not done: no outputs file
    write_records(str(root / "day=2026-11-02" / "c" / "acceptance" / "part-00000.parquet"),
                  synthetic_records(20, seed=5, job_id="c"))
    open(root / "a" / "acceptance" / "part-00009.parquet", "wb").close()
    (root / "logs").mkdir()
    return root


def copy_to_memory(local_root, prefix: str) -> str:
    fs = fsspec.filesystem("memory")
    for folder, _, names in os.walk(local_root):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, local_root)
            with open(path, "rb") as f:
                fs.pipe_file(f"/{prefix}/{rel}", f.read())
    return f"memory://{prefix}"


def approx_tree(x):
    """pytest.approx for nested dicts and lists (sums of floats over differently chunked
    scans differ in the last bit)."""
    if isinstance(x, dict):
        return {k: approx_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [approx_tree(v) for v in x]
    return pytest.approx(x, rel=1e-12) if isinstance(x, float) else x


def cli_report(*paths) -> str:
    r = CliRunner().invoke(report, [*map(str, paths), "--by", "domain,draft,temperature,day"])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("spelling", ["dir", "glob", "files"])
def test_memory_and_file_urls_equal_the_local_report(local_tree, spelling):
    url = copy_to_memory(local_tree, f"bucket-{spelling}")
    paths = {"dir": lambda base: [f"{base}"],
             "glob": lambda base: [f"{base}/*"],
             "files": lambda base: [f"{base}/a/acceptance/*.parquet", f"{base}/b",
                                    f"{base}/day=2026-11-02/c/acceptance/part-00000.parquet"]}
    local = paths[spelling](str(local_tree))
    expected = analyze(local, by=["domain", "draft", "day"])
    assert expected["summary"]["requests"] == 320
    for base in (url, f"file://{local_tree}"):
        got = analyze(paths[spelling](base), by=["domain", "draft", "day"])
        assert got == approx_tree(expected), base
        assert cli_report(*paths[spelling](base)) == cli_report(*local)


def test_urls_name_their_files(local_tree):
    url = copy_to_memory(local_tree, "bucket-names")
    files = find_acceptance_files([url])
    assert all(f.startswith("memory://") for f in files) and len(files) == 4
    assert [f.split("bucket-names", 1)[1] for f in files] == [
        f.split("jobs", 1)[1] for f in find_acceptance_files([str(local_tree)])]
    with pytest.raises(NoAcceptanceData, match="no such path"):
        find_acceptance_files(["memory://bucket-names/missing"])
    with pytest.raises(NoAcceptanceData, match="no acceptance/ directory"):
        find_acceptance_files([f"{url}/b/outputs"])
