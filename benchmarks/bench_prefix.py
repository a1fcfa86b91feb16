"""Prefix caching on a templated job: every row's prompt is one long instruction block (the
same for all rows, >= 256 tokens) followed by the row's own text. The same job runs with
prefix caching on and off side by side (`batchspec run`'s code path, one process, the two
interleaved `--repeats` times, best of each), and the script checks that the outputs are
identical and reports prompt tokens computed and rows/s.

    python benchmarks/bench_prefix.py --rows 128 --max-tokens 16
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.demo.corpus import corpus_prompts  # noqa: E402
from batchspec.jobs.runner import run_local  # noqa: E402
from batchspec.jobs.spec import JobSpec  # noqa: E402
from batchspec.llm import LLM  # noqa: E402

INSTRUCTIONS = """You are reviewing snippets from a large Python code base before a release.
For every snippet below, do the following. First, say in one sentence what the code does,
naming the functions, classes and modules it touches. Second, list anything that could go
wrong at run time: unchecked None values, missing keys in dictionaries, files that may not
exist, encodings that are assumed, integer overflow in loops that count bytes, and calls that
may block for a long time without a timeout. Third, point out any behaviour that differs
between platforms, such as path separators, line endings, signal handling, process spawning
and the default text encoding. Fourth, suggest the smallest change that would make the code
more robust, keeping its interface as it is, and say which tests should cover the change.
Do not rewrite the code in another style, do not rename public names, and do not add new
dependencies. Keep the answer short and concrete: a reviewer reads hundreds of these.
When a snippet is only a fragment, say what context is missing instead of guessing.
When a snippet is documentation rather than code, check that it describes the behaviour
correctly, that its examples would run, and that it names the exceptions that can be raised.
"""
TEMPLATE = INSTRUCTIONS + "\nSnippet:\n{prompt}\nReview:"


def make_input(path: str, rows: int) -> None:
    prompts = corpus_prompts("heldout", num_per_domain=(rows + 1) // 2, seed=0)[:rows]
    assert len(prompts) == rows, f"only {len(prompts)} held-out prompts"
    pq.write_table(pa.table({"id": [f"r{i:04d}" for i in range(rows)],
                             "prompt": [p["prompt"] for p in prompts],
                             "domain": [p["domain"] for p in prompts]}), path)


def outputs(out_dir: str) -> dict:
    rows = pq.read_table(os.path.join(out_dir, "outputs")).to_pylist()
    return {r["id"]: r["text"] for r in rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default) computes the same "
                    "tokens whatever the batch; in bfloat16 any change of batch composition, "
                    "caching or not, can flip near-tied greedy tokens.")
    ap.add_argument("--plain", action="store_true", help="No drafts (default: the demo "
                                                         "drafts per domain).")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench_prefix_")
    data = os.path.join(work, "rows.parquet")
    make_input(data, args.rows)
    common = dict(inputs=[data], template=TEMPLATE, max_tokens=args.max_tokens,
                  temperature=args.temperature, shard_size=args.rows, num_threads=1, dtype=args.dtype)
    if args.plain:
        common["num_speculative_tokens"] = 0
    specs = {name: JobSpec(output=os.path.join(work, name), prefix_caching=on, **common)
             for name, on in (("caching off", False), ("caching on", True))}
    llms = {name: LLM.from_config(s.engine_config()) for name, s in specs.items()}
    prefix = len(llms["caching on"].encode(INSTRUCTIONS))
    best, docs = dict.fromkeys(specs, 0.0), {}
    for _ in range(args.repeats):
        for name, spec in specs.items():
            shutil.rmtree(spec.output, ignore_errors=True)
            llms[name].engine.block_manager.reset_prefix_cache()  # nothing from the last run
            t0 = time.perf_counter()
            docs[name] = run_local(spec, progress=False, llm=llms[name])
            best[name] = max(best[name], args.rows / (time.perf_counter() - t0))
    same = outputs(specs["caching on"].output) == outputs(specs["caching off"].output)
    print(f"{args.rows} rows, shared prefix {prefix} tokens, max_tokens {args.max_tokens}, "
          f"T={args.temperature}, {args.dtype}, {'plain' if args.plain else 'demo drafts'}")
    for name in specs:
        s = docs[name]["summary"]
        computed = s["prompt_tokens"] - s["cached_prompt_tokens"]
        print(f"{name:<12} prompt tokens computed {computed:>7,} of {s['prompt_tokens']:,}  "
              f"{best[name]:6.2f} rows/s")
    off, on = (docs[n]["summary"] for n in ("caching off", "caching on"))
    drop = 1 - (on["prompt_tokens"] - on["cached_prompt_tokens"]) / (
        off["prompt_tokens"] - off["cached_prompt_tokens"])
    print(json.dumps({"prompt_tokens_computed_drop": round(drop, 4),
                      "rows_per_s_ratio": round(best["caching on"] / best["caching off"], 3),
                      "outputs_identical": same}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
