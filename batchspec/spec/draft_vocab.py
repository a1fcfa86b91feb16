"""A draft's vocabulary: the tokens its output layer scores.

A small draft spends much of a step in its output layer (the demo drafts: 786k of 1.2M
parameters), yet the tokens a job's text is made of are a small part of the vocabulary. A
draft whose directory holds `draft_vocab.json` scores only those tokens; every other logit
is -inf, so the draft never proposes them and its q gives them probability 0. Verification
is exact for any q that the drafts are drawn from, so outputs do not change, only which
tokens the draft can get accepted: where the target picks a token outside the list, that
round's draft stops being accepted there.

The list is the N most frequent tokens of a sample of the job's text (prompts, and outputs
of earlier runs where there are some), counted by `batchspec draft-vocab`, plus the end of
sequence tokens, which a draft must be able to propose. On the demo code draft, a list of
1,024 of the 4,096 tokens counted on its training text agrees with the target's greedy token
as often as the whole vocabulary does to within 0.2% (docs/benchmarks.md)."""
from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable

FILE = "draft_vocab.json"


def path_of(model_dir: str) -> str:
    return os.path.join(model_dir, FILE)


def load(model_dir: str, vocab_size: int | None = None) -> list[int] | None:
    """The ids of model_dir's draft vocabulary (sorted), or None where it has none. A file
    that is not a list of distinct ids below vocab_size (default: config.json's) raises
    ValueError saying so. Plain JSON, no torch: EngineConfig checks it where a job is
    submitted, so a bad list fails there and not in every worker."""
    path = path_of(model_dir)
    if not os.path.isfile(path):
        return None
    if vocab_size is None:
        try:
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
                vocab_size = int(json.load(f)["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None   # not a model directory: the model's loading says so
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f)["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a draft vocabulary ({e}); write it again with "
                         f"`batchspec draft-vocab`, or delete it to score every token") from None
    if not isinstance(ids, list) or not ids or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{path}: token_ids must be a non-empty list of token ids; write it "
                         f"again with `batchspec draft-vocab`")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad or len(set(ids)) != len(ids):
        what = f"ids outside the vocabulary of {vocab_size} ({bad[:3]})" if bad else \
            "repeated ids"
        raise ValueError(f"{path}: {what}; write it again with `batchspec draft-vocab` "
                         f"for this model")
    return sorted(ids)


def count_tokens(tokenizer, texts: Iterable[str], batch: int = 256) -> collections.Counter:
    """How often each token id occurs in texts, tokenized as the engine tokenizes prompts."""
    counts: collections.Counter = collections.Counter()
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
                counts.update(ids)
            chunk = []
    if chunk:
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            counts.update(ids)
    return counts


def choose(counts: collections.Counter, vocab_size: int, size: int | None = None,
           coverage: float = 0.999, always: Iterable[int] = ()) -> tuple[list[int], float]:
    """The most frequent tokens: `size` of them, or else the fewest that make up `coverage`
    of the counted tokens; plus `always` (end of sequence tokens). Where the text has fewer
    distinct tokens than `size`, the lowest ids it lacks make up the rest (a BPE vocabulary
    numbers its tokens in the order of its merges, the most frequent first). Returns
    (sorted ids, the share of the counted tokens they cover)."""
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no tokens were counted: give text with --data")
    ranked = [t for t, _ in counts.most_common() if 0 <= t < vocab_size]
    if size is None:
        covered, size = 0, 0
        for t in ranked:
            if covered >= coverage * total:
                break
            covered += counts[t]
            size += 1
    chosen = set(ranked[:size])
    fill = (t for t in range(vocab_size) if t not in chosen)
    chosen.update(next(fill) for _ in range(min(size, vocab_size) - len(chosen)))
    chosen |= {t for t in always if 0 <= t < vocab_size}
    return sorted(chosen), sum(counts[t] for t in chosen) / total


def write(model_dir: str, ids: list[int], about: dict) -> str:
    """Write model_dir's draft vocabulary (ids and how they were counted); its path."""
    path = path_of(model_dir)
    tmp = path + ".tmp"
    try:   # whole or not at all: a reader never sees half a list
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**about, "size": len(ids), "token_ids": ids}, f)
            f.write("\n")
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
