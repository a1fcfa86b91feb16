"""Malformed-input campaign: N files, each mixing good rows with malformed ones of one or
more kinds, run as jobs through `batchspec run` and (with --submit) `batchspec submit` to a
real worker on a private redis-server. Checks that every good row is answered exactly once,
every bad row is in errors/ with a reason, every job ends in a final state, and no command
prints a traceback; prints a table.

    python scripts/malformed_campaign.py --files 24 --rows 60 --submit
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# kind -> (column values of one bad row, expected error_type); None: not a row-level kind
KINDS = {
    "empty": ({"prompt": "   "}, "empty_prompt"),
    "null": ({"prompt": None}, "missing_prompt"),
    "long": ({"prompt": "x " * 3000}, "prompt_too_long"),
    "neg_temp": ({"temperature": -1.0}, "invalid_override"),
    "nan_temp": ({"temperature": float("nan")}, "invalid_override"),
    "inf_top_p": ({"top_p": float("inf")}, "invalid_override"),
    "zero_max": ({"max_tokens": 0.0}, "invalid_override"),
    "frac_top_k": ({"top_k": 2.5}, "invalid_override"),
    "huge_seed": ({"seed": 1e30}, "invalid_override"),
    "dup_id": ({}, "duplicate_id"),
}
GOOD_ODD = [{"top_k": float(2**40)}, {"seed": -3.0}, {"max_tokens": 1e6}]   # odd but valid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_file(path: str, index: int, rows: int, rng: random.Random) -> tuple[set, dict]:
    """A file of `rows` rows in 3 row groups, about half malformed, and in every 4th file a
    corrupt page in the second row group; returns (good ids, bad id -> error types)."""
    kinds = rng.sample(sorted(KINDS), k=rng.randint(2, 5))
    cols = {"id": [], "prompt": [], "temperature": [], "top_p": [], "top_k": [],
            "max_tokens": [], "seed": [], "when": []}
    good, bad = set(), {}
    for i in range(rows):
        rid = f"f{index}-r{i}"
        row = {"prompt": f"row {i} of file {index} says", "temperature": None, "top_p": None,
               "top_k": None, "max_tokens": None, "seed": None}
        if i % 2 and good:
            kind = kinds[i % len(kinds)]
            values, error = KINDS[kind]
            if kind == "dup_id":
                rid = sorted(good)[0]
            row |= values
            bad.setdefault(rid, []).append(error)
        else:
            if i % 7 == 0:
                row |= GOOD_ODD[i % len(GOOD_ODD)]
            good.add(rid)
        cols["id"].append(rid)
        for k in row:
            cols[k].append(row[k])
        # an unused column of timestamps, some past year 9999 (never read by a job)
        cols["when"].append(18_000 * 365 * 86400 * 10**6 if i % 5 == 0 else 0)
    table = pa.table({**{k: v for k, v in cols.items() if k != "when"},
                      "when": pa.array(cols["when"], pa.int64()).cast(pa.timestamp("us"))})
    pq.write_table(table, path, row_group_size=rows // 3, compression="NONE")
    if index % 4 == 3:            # its shard (shards follow row groups) fails, alone
        meta = pq.ParquetFile(path).metadata
        chunk = meta.row_group(1).column(table.column_names.index("prompt"))
        with open(path, "r+b") as f:
            f.seek(chunk.data_page_offset)
            f.write(b"\xff" * 24)
        for i in range(rows // 3, 2 * (rows // 3)):
            rid = table.column("id")[i].as_py()
            if rid in good and table.column("id").to_pylist().index(rid) == i:
                good.discard(rid)
                bad.setdefault(rid, []).append("shard_failed")
    return good, bad


def check(out: str, good: set, bad: dict, proc) -> dict:
    def ids(kind):
        folder = os.path.join(out, kind)
        if not os.path.isdir(folder):
            return []
        return [r for f in sorted(os.listdir(folder)) if f.endswith(".parquet")
                for r in pq.read_table(os.path.join(folder, f)).to_pylist()]
    outputs, errors = ids("outputs"), ids("errors")
    out_ids = [r["id"] for r in outputs]
    err_types: dict[str, list] = {}
    for e in errors:
        err_types.setdefault(e["id"], []).append(e["error_type"])
    state = None
    if os.path.exists(os.path.join(out, "_job.json")):
        with open(os.path.join(out, "_job.json")) as f:
            state = json.load(f)["state"]
    return {
        "state": state,
        "good_lost": len(good - set(out_ids)),
        "good_duplicated": len(out_ids) - len(set(out_ids)),
        "bad_rows": sum(map(len, bad.values())),
        "bad_missing": sum(max(0, len(v) - len(err_types.get(k, []))) for k, v in bad.items()),
        "bad_without_reason": sum(1 for e in errors if not e["message"]),
        "traceback": "Traceback" in proc.stdout + proc.stderr,
        "exit": proc.returncode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--submit", action="store_true", help="also through submit + a worker")
    args = ap.parse_args()
    from batchspec.tools.tiny import make_random_model
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="malformed-")
    model = make_random_model(os.path.join(work, "model"), seed=0)
    files = []
    for i in range(args.files):
        path = os.path.join(work, f"in{i:02d}.parquet")
        files.append((path, *make_file(path, i, args.rows, rng)))
    base = [sys.executable, "-m", "batchspec.cli"]
    common = ["--model", model, "--max-tokens", "4", "--shard-size", str(args.rows // 3)]
    results = {"run": [], "submit": []}
    for path, good, bad in files:
        out = path.replace(".parquet", "-run")
        proc = subprocess.run(base + ["run", path, "-o", out, "-q", *common],
                              capture_output=True, text=True, env=ENV, timeout=600)
        results["run"].append(check(out, good, bad, proc))
    if args.submit:
        port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no", "--dir", work],
                                 stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        log = open(os.path.join(work, "worker.log"), "wb")
        worker = subprocess.Popen(base + ["worker", "--broker", url, "--concurrency", "1"],
                                  stdout=log, stderr=subprocess.STDOUT, env=ENV,
                                  start_new_session=True)
        try:
            time.sleep(2)
            for path, good, bad in files:
                out = path.replace(".parquet", "-submit")
                proc = subprocess.run(base + ["submit", path, "-o", out, "--broker", url,
                                              "--wait", "-q", *common],
                                      capture_output=True, text=True, env=ENV, timeout=900)
                results["submit"].append(check(out, good, bad, proc))
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(60)
            redis.terminate()
    print(f"{dt.datetime.now():%Y-%m-%d %H:%M}  {args.files} files x {args.rows} rows, "
          f"seed {args.seed}  ({work})")
    print(f"{'path':8}{'jobs':>6}{'final':>7}{'bad rows':>10}{'bad in errors/':>16}"
          f"{'good lost':>11}{'good dup':>10}{'no reason':>11}{'tracebacks':>12}")
    final = ("completed", "completed_with_errors", "failed", "cancelled")
    for name, rows in results.items():
        if not rows:
            continue
        bad_rows = sum(r["bad_rows"] for r in rows)
        print(f"{name:8}{len(rows):>6}{sum(r['state'] in final for r in rows):>7}"
              f"{bad_rows:>10}{bad_rows - sum(r['bad_missing'] for r in rows):>16}"
              f"{sum(r['good_lost'] for r in rows):>11}"
              f"{sum(r['good_duplicated'] for r in rows):>10}"
              f"{sum(r['bad_without_reason'] for r in rows):>11}"
              f"{sum(r['traceback'] for r in rows):>12}")


if __name__ == "__main__":
    main()
