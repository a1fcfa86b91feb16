"""Rules for suffix drafts, priced offline on one greedy job: which of a row's two drafts (its
own text's and its domain's job-wide trie's) to propose, and where to cut a draft by the
running product of its tokens' shares (`suffix_min_prob`).

The job runs once with the suffix method (32 rows, T = 0, held-out code and docs prompts);
each round records both drafts, uncut (min_prob 0), and the row's greedy continuation, which
at T = 0 does not depend on what was drafted. Each rule then proposes one draft per round,
its accepted tokens are its common prefix with the continuation, and the rule is priced as
tokens per cost of a round: sum(1 + accepted) / sum(1 + round_cost + price x drafted), where
price is what a verified token costs against a decoded one (`benchmarks/step_costs.py`: 0.40
at 32 rows on the demo, bf16, AVX512-BF16 CPU) and round_cost what a round costs besides
the forwards (default 0). The rounds are those of the recorded run, so a rule is
judged on the states that run went through: an estimate for ranking rules, which the bench
then measures.

    python benchmarks/suffix_rules.py
    python benchmarks/suffix_rules.py --price 0.04      # a price like one row's
    python benchmarks/suffix_rules.py --round-cost 0.13 # each round's Python and bookkeeping
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchspec.config import default_dtype  # noqa: E402
from batchspec.demo import demo_models  # noqa: E402
from batchspec.spec import suffix as sx  # noqa: E402
from batchspec.tools import hfref  # noqa: E402
from batchspec.tools.bench import _params, _start_afresh, make_llm  # noqa: E402
from batchspec.tools.evaluate import load_prompts  # noqa: E402


def record_rounds(batch_size: int, num_prompts: int, k: int, max_tokens: int):
    """[(continuation, own draft, job-wide draft)] of every round of the job's second run
    (the first fills the prefix cache, as in the bench); drafts uncut by shares."""
    torch.set_num_threads(1)
    models = demo_models()
    prompts = load_prompts(None, None, num_prompts, split="heldout", seed=0)
    tok = hfref.load_tokenizer(models["target"])
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    llm = make_llm("suffix", models, batch_size, k, 0, 0.0, 1,
                   default_dtype(models["target"], "cpu"))
    rounds = []

    def draft_with_evidence(self, seq, k):
        own = self.requests.get(seq.seq_id)
        if own is None:
            own = self.requests[seq.seq_id] = sx._RequestTrie()
        tokens, room = seq.token_ids, sx.DEPTH - k
        dom = self.domains.get(seq.domain)
        own.trie.extend(tokens[own.inserted:])
        own.inserted = len(tokens)
        if room <= 0:
            return [], [], 0
        context = tokens[-room:]
        if isinstance(own.trie, sx.SuffixTrie):   # the Python fallback
            a = own.trie.draft(context, room, 2, k, sx.MATCH_FACTOR, 0.0)
        else:
            a = own.trie.draft(room, k, sx.MATCH_FACTOR, 0.0)
        b = dom.trie.draft(context, room, 1, k, sx.MATCH_FACTOR, 0.0) if dom else ([], [], 0)
        a, b = (list(a[0]), list(a[1]), a[2]), (list(b[0]), list(b[1]), b[2])
        rounds.append((seq, len(tokens), a, b))
        a, b = cut_at(a, self.min_prob), cut_at(b, self.min_prob)   # as the proposer does
        return b if sx.preferred(b, a) else a

    for proposer in llm.engine.proposers.values():
        proposer.draft_with_evidence = draft_with_evidence.__get__(proposer)
    for _ in range(2):
        rounds.clear()
        _start_afresh(llm)
        llm.add_requests(ids, _params(0.0, 1.0, max_tokens), domains)
        while llm.engine.has_unfinished():
            llm.step()
    return [(seq.token_ids[pos:pos + k], a, b) for seq, pos, a, b in rounds]


def cut_at(draft, min_prob: float):
    """The draft (tokens, shares, match length) while the running product of its shares is
    at least min_prob, as SuffixTrie.draft cuts."""
    tokens, shares, length = draft
    n, prob = 0, 1.0
    for share in shares:
        prob *= share
        if prob < min_prob:
            break
        n += 1
    return tokens[:n], shares[:n], length


def accepted(draft: list[int], continuation: list[int]) -> int:
    n = 0
    for t, c in zip(draft, continuation):
        if t != c:
            break
        n += 1
    return n


def by_expected(a, b) -> bool:
    """The choice before suffix.preferred: more expected accepted tokens (a over b)."""
    return sx.expected_accepted(a[1]) > sx.expected_accepted(b[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 8 x batch size")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--price", type=float, default=0.40,
                    help="a verified token's cost in decoded tokens (step_costs.py)")
    ap.add_argument("--round-cost", type=float, default=0.0,
                    help="what a round costs besides the forwards, in decoded tokens (its "
                         "Python, bookkeeping), added to every round's cost")
    args = ap.parse_args()
    rounds = record_rounds(args.batch_size, args.num_prompts or 8 * args.batch_size, args.k,
                           args.max_tokens)
    choices = {"longer match (suffix.preferred)": sx.preferred,
               "more expected accepted": by_expected,
               "the request's own only": lambda a, b: False,
               "the job-wide only": lambda a, b: True}
    print(f"{len(rounds)} rounds; price of a verified token {args.price}, of a round "
          f"besides its forwards {args.round_cost}")
    print(f"{'choice':<34}{'min_prob':>9}{'drafted':>9}{'accepted':>9}{'alpha':>7}"
          f"{'tokens/cost':>12}")
    for name, other_wins in choices.items():
        for min_prob in (0.1, 0.3, 0.5, 0.7, 0.9):
            drafted = acc = 0
            value = cost = 0.0
            for cont, a, b in rounds:
                a, b = cut_at(a, min_prob), cut_at(b, min_prob)  # cut, then chosen
                draft = b[0] if other_wins(b, a) else a[0]
                m = accepted(draft, cont)
                drafted, acc = drafted + len(draft), acc + m
                value += 1 + m
                cost += 1 + args.round_cost + args.price * len(draft)
            print(f"{name:<34}{min_prob:>9.1f}{drafted:>9}{acc:>9}"
                  f"{acc / max(drafted, 1):>7.3f}{value / cost:>12.4f}")


if __name__ == "__main__":
    main()
