"""Input files shared by the job tests: three Parquet files, one with malformed rows."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

# id -> error_type of every malformed row in bad.parquet
BAD_ROWS = {"bad-empty": "empty_prompt", "bad-null": "missing_prompt",
            "bad-long": "prompt_too_long", "bad-temp": "invalid_override",
            "bad-max": "invalid_override"}
GOOD_IDS = ([f"a{i}" for i in range(5)] + ["b:0", "b:1", "b:2"]
            + ["bad-ok1", "bad-ok2"])


def make_inputs(folder) -> list[str]:
    """a.parquet (5 prompts, row groups of 2), b.parquet (3 chat rows, no id column),
    bad.parquet (2 good rows and the 5 of BAD_ROWS). Returns the three paths."""
    os.makedirs(folder, exist_ok=True)
    a = pa.table({"id": [f"a{i}" for i in range(5)],
                  "prompt": ["def add(a, b):", "import json\n", "class Foo:", "x = [1, 2,",
                             "for line in lines:"],
                  "domain": [None, "code", None, "code", None]})
    b = pa.table({"messages": [[{"role": "user", "content": c}] for c in
                               ("Say hello.", "Name a colour.", "Count to three.")]})
    bad = pa.table({
        "id": ["bad-ok1", "bad-empty", "bad-null", "bad-long", "bad-temp", "bad-max",
               "bad-ok2"],
        "prompt": ["The quick brown fox", "   ", None, "x " * 3000, "hello", "hello",
                   "return value"],
        "temperature": [None, None, None, None, -1.0, None, None],
        "max_tokens": [None, None, None, None, None, 0, 3],
    })
    paths = [os.path.join(folder, n) for n in ("a.parquet", "b.parquet", "bad.parquet")]
    pq.write_table(a, paths[0], row_group_size=2)
    pq.write_table(b, paths[1])
    pq.write_table(bad, paths[2])
    return paths


def read_dir(out, kind: str) -> pa.Table:
    """All part files of OUT/kind concatenated (no other file may be there)."""
    folder = os.path.join(out, kind)
    names = sorted(os.listdir(folder))
    assert all(n.startswith("part-") and n.endswith(".parquet") for n in names), names
    return pa.concat_tables([pq.read_table(os.path.join(folder, n)) for n in names])


def job_spec_of(args: list[str]):
    """The JobSpec that `run` and `submit` build from these command-line arguments (their
    options alone: nothing runs). The inputs are only named, so they need not exist."""
    import click
    from click.testing import CliRunner

    from batchspec.jobs.commands import job_options
    from batchspec.jobs.spec import JobSpec
    got = {}

    @click.command()
    @job_options
    def probe(config, **options):
        got["spec"] = JobSpec.build(config=config, **options)

    result = CliRunner().invoke(probe, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return got["spec"]
