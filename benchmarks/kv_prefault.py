"""What the KV cache's page faults cost each method: every method's engine twice, once with
the cache's pages faulted in as rows first write them (an engine's default, models/llama.py:
zeroed) and once written whole at start-up (prefault_kv_cache, as `batchspec bench` builds
its engines), all taking turns over the same job (batchspec.tools.bench.run_engines_in_turns)
for several runs, the first of them untimed. Prints each engine's tokens per second x the
first method's prefaulted engine (medians of the timed runs) and the minor page faults a timed step
took, on average.

A method whose outputs are the same in every run (greedy decoding, or a seeded sampler whose
draws do not depend on timing: plain, a fixed k) writes the same blocks each time; their hashes
are registered already, so the blocks go back to the free list and are taken again. Adaptive
lengths at T > 0 sample other outputs in each run (which rows draft how far depends on the
measured step times), whose full blocks are registered and kept, and new blocks are taken from
pages never written:

    python benchmarks/kv_prefault.py --batch-size 64 --temperature 0.8
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.tools import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="plain,spec-domain,spec-adaptive")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts a run takes [the bench's: max(64, 8 x batch size)]")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    B = a.batch_size
    models, dtype, ids, domains = bench.demo_workload(a.num_prompts or max(64, 8 * B))
    llms = {}
    for method in a.methods.split(","):
        for prefault in (False, True):
            llms[f"{method}{', prefaulted' if prefault else ''}"] = bench.make_llm(
                method, models, B, 4, 0, 0.0, 1, dtype, prefault_kv_cache=prefault)
    faults_before = {}
    for name, llm in llms.items():
        def step(inner=llm.step, name=name):
            faults_before[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            return inner()
        llm.step = step
    faults = {name: [0, 0] for name in llms}     # faults, steps of the timed runs

    def on_step(turn, name, seconds, tokens):
        f = faults[name]
        f[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before[name]
        f[1] += 1
    rates = {name: [] for name in llms}
    for r in range(a.repeats + 1):
        res = bench.run_engines_in_turns(llms, ids, domains=domains, temperature=a.temperature,
                                         max_tokens=a.max_tokens,
                                         on_step=on_step if r else None)
        if r:
            for name in llms:
                rates[name].append(res[name]["tokens"] / res[name]["wall_s"])
    first = f"{a.methods.split(',')[0]}, prefaulted"
    base = statistics.median(rates[first])
    print(f"{B} rows, T = {a.temperature}, {dtype}, {len(ids)} prompts; medians of "
          f"{a.repeats} runs in turns")
    print(f"{'engine':34}{'tok/s':>9}{'x ' + first:>28}{'faults a step':>15}")
    for name, v in rates.items():
        rate = statistics.median(v)
        f, steps = faults[name]
        print(f"{name:34}{rate:9.0f}{rate / base:28.3f}{f / max(steps, 1):15.1f}")


if __name__ == "__main__":
    main()
