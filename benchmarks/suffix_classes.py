"""How often verification accepted suffix drafts of each evidence class (suffix.evidence_class:
the tenth of a token's share of its trie's continuations, and the length of the match it
continues), as the adaptive policy counts them (SpecPolicy.by_class), after a job of held-out
code and docs prompts on the demo family with suffix drafts and adaptive lengths.

    python benchmarks/suffix_classes.py                    # 64 prompts, batch 32, T = 0
    python benchmarks/suffix_classes.py --workload templated --num-prompts 128
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec import SamplingParams  # noqa: E402
from batchspec.tools.bench import make_llm, templated_prompts  # noqa: E402

BANDS = ("1", "2", "3", "4-7", "8+")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["corpus", "templated"], default="corpus")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    from batchspec.config import default_dtype
    from batchspec.demo import demo_models
    from batchspec.tools import hfref
    from batchspec.tools.evaluate import load_prompts
    models = demo_models()
    prompts = templated_prompts(a.num_prompts) if a.workload == "templated" else \
        load_prompts(None, None, a.num_prompts, split="heldout")
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    llm = make_llm("suffix-adaptive", models, a.batch_size, 4, 0, 0.0, 1,
                   default_dtype(models["target"], "cpu"))
    llm.generate(ids, SamplingParams(temperature=a.temperature, max_tokens=64),
                 domains=[p["domain"] for p in prompts], use_tqdm=False)
    counts = {}
    for by_class in llm.engine.policy.by_class.values():
        for c, (acc, judged) in by_class.items():
            cell = counts.setdefault(c, [0, 0])
            cell[0] += acc
            cell[1] += judged
    print(f"{a.workload}, {len(ids)} prompts, batch {a.batch_size}, T = {a.temperature}: "
          f"accepted / judged drafts by share of the continuations (rows) and match length")
    print("share    " + "".join(f"{b:>14}" for b in BANDS))
    for tenth in range(9, -1, -1):
        cells = [counts.get(5 * tenth + band) for band in range(len(BANDS))]
        if any(cells):
            print(f"{tenth / 10:.1f}-{(tenth + 1) / 10:.1f}  " + "".join(
                f"{acc / judged:>6.2f} ({judged:>5})" if judged else f"{'':>14}"
                for acc, judged in (c or (0, 0) for c in cells)))


if __name__ == "__main__":
    main()
