"""The suffix-draft source's own cost (no model): the C++ trie (kernels/suffix_trie.cpp)
against the Python one, on the work a job gives it; "cpp-trie" is the C++ source with a trie
for each request's own text too, as before RequestText scanned the text instead.

Every row of a job is a held-out standard-library excerpt: its first `--prompt-tokens` tokens
are the prompt, the next `--output-tokens` the output, generated `--per-step` tokens per
engine step. Each step drafts k tokens for the row (from its own text and its domain's
job-wide trie); a finished row's output joins the job-wide trie. The same rows and steps go
through every variant, which must draft the same tokens; the time is the proposer's alone,
so it is the engine step's bookkeeping that the suffix source adds, per row.

    python benchmarks/bench_suffix.py                          # 128 rows, 128-token prompts
    python benchmarks/bench_suffix.py --prompt-tokens 2048     # RAG-sized prompts
    python benchmarks/bench_suffix.py --evict-mb 32            # caches cold, as in an engine
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import SamplingParams  # noqa: E402
from batchspec.engine.sequence import Sequence  # noqa: E402
from batchspec.spec import suffix  # noqa: E402
from batchspec.spec.suffix import SuffixProposer  # noqa: E402


def job_rows(num_rows, prompt_tokens, output_tokens):
    """Token id lists of prompt_tokens + output_tokens tokens (the demo tokenizer) cut from
    held-out standard-library files, one row per file window."""
    from batchspec.demo import demo_models
    from batchspec.demo.corpus import _cached_corpus
    from batchspec.tools import hfref
    tok = hfref.load_tokenizer(demo_models()["target"])
    need, rows = prompt_tokens + output_tokens, []
    for domain in ("code", "docs"):
        for _, text in _cached_corpus()[domain]["heldout"]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            for start in range(0, len(ids) - need + 1, need):
                rows.append((domain, ids[start:start + need]))
    rows.sort(key=lambda r: hash(tuple(r[1][:8])))   # domains interleaved, repeatably
    if len(rows) < num_rows:
        sys.exit(f"only {len(rows)} rows of {need} tokens in the held-out corpus")
    return rows[:num_rows]


def run(rows, prompt_tokens, per_step, k, batch, evict=None):
    """Seconds the proposer spends on the job, and every draft it made. evict: an array
    written over before each step's drafts (untimed), as a target forward leaves the caches
    to the next step's lookups."""
    prop, drafts, seconds = SuffixProposer(), [], 0.0
    for first in range(0, len(rows), batch):
        wave = [(Sequence(i, str(i), ids[:prompt_tokens], SamplingParams(), 0, domain), ids)
                for i, (domain, ids) in enumerate(rows[first:first + batch], first)]
        while wave:
            if evict is not None:
                evict += 1
            t0 = time.perf_counter()
            for seq, _ in wave:
                drafts.append(prop.draft(seq, k))
            still = []
            for seq, ids in wave:
                n = len(seq.token_ids)
                seq.token_ids.extend(ids[n:n + per_step])
                if n + per_step < len(ids):
                    still.append((seq, ids))
                else:
                    prop.finish(seq, completed=True)
            seconds += time.perf_counter() - t0
            wave = still
    return seconds, drafts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="rows running at once")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--per-step", type=int, default=3, help="tokens a row gains per step")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="write over this many MB before each step's drafts (untimed), as "
                         "the target's forward does between steps (the demo target: 12 MB "
                         "of weights, besides its KV)")
    a = ap.parse_args()
    evict = np.zeros(a.evict_mb << 17) if a.evict_mb else None   # 8-byte floats
    rows = job_rows(a.rows, a.prompt_tokens, a.output_tokens)
    steps = a.rows * -(-a.output_tokens // a.per_step)
    times: dict[str, list[float]] = {"cpp": [], "cpp-trie": [], "python": []}
    drafts = {}
    own_text = suffix.new_request_text
    for _ in range(a.repeats):       # they take turns: a busy stretch hits each
        for name, flag in (("cpp", "1"), ("cpp-trie", "1"), ("python", "0")):
            os.environ["BATCHSPEC_SUFFIX_NATIVE"] = flag
            suffix.new_request_text = suffix.new_trie if name == "cpp-trie" else own_text
            seconds, drafts[name] = run(rows, a.prompt_tokens, a.per_step, a.k, a.batch,
                                        evict)
            times[name].append(seconds)
    suffix.new_request_text = own_text
    assert drafts["cpp"] == drafts["python"] == drafts["cpp-trie"], \
        "the sources drafted different tokens"
    found = sum(map(bool, drafts["cpp"])) / len(drafts["cpp"])
    print(f"{a.rows} rows ({a.prompt_tokens} + {a.output_tokens} tokens, {a.per_step} per "
          f"step, batch {a.batch}), k = {a.k}: {steps} row-steps, {found:.0%} with a draft"
          + (f"; {a.evict_mb} MB written over before each step" if a.evict_mb else ""))
    med = {n: statistics.median(t) for n, t in times.items()}
    for name, t in times.items():
        print(f"  {name:8s} median {med[name] * 1e3:8.1f} ms  ({1e6 * med[name] / steps:6.1f} "
              f"us per row-step; runs {', '.join(f'{1e3 * x:.0f}' for x in t)} ms)")
    print(f"  python / cpp: {med['python'] / med['cpp']:.2f}x, cpp-trie / cpp: "
          f"{med['cpp-trie'] / med['cpp']:.2f}x")


if __name__ == "__main__":
    main()
