"""Suffix drafts (after SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): continue the
text with what most often followed its longest suffix, in the request's own prompt + output
and in the outputs of the requests of its domain that already finished in this engine (the
job-wide part: templated jobs repeat their phrasing from row to row).

The structure is a suffix trie bounded in depth: it counts every substring of at most
DEPTH tokens of the texts inserted (a node per distinct substring, its count the number of
occurrences). Appending a token extends the text's DEPTH open suffixes by one node each, so
inserting a text of n tokens costs O(n * DEPTH) and removing it the same; nothing is ever
rebuilt. Memory: at most DEPTH nodes per token held. A request's trie lives while the
request runs (prompt + output tokens); a domain's job-wide trie holds the outputs of its most
recently finished requests up to `max_tokens` tokens in all, the oldest removed first, so it
never has more than DEPTH * max_tokens nodes (about 250 bytes each in CPython: 64 MiB per
domain at the default 16,384 tokens, in the worst case of text that never repeats).

Drafts are deterministic (q one-hot): exactness is the verifier's, as for n-gram drafts."""
from __future__ import annotations

import math
from collections import deque

from batchspec.engine.sequence import Sequence
from batchspec.spec.proposer import Proposal

DEPTH = 16            # longest substring counted: match + draft
MATCH_FACTOR = 1.0    # a match of m tokens drafts at most ceil(MATCH_FACTOR * m) tokens


class SuffixTrie:
    """Occurrence counts of every substring of at most `depth` tokens of the texts inserted.
    Node 0 is the root (the empty string); a freed node's id is reused."""

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def append(self, open_suffixes: list[int], token: int) -> list[int]:
        """Extend a text by one token. open_suffixes: the nodes of the text's last 0, 1, ...
        (at most depth - 1) tokens, shortest first ([0] for an empty text); returns the
        text's new ones. O(depth)."""
        out = [0]
        children, count = self.children, self.count
        for node in open_suffixes:
            child = children[node].get(token)
            if child is None:
                if self._free:
                    child = self._free.pop()
                    children[child] = {}
                    count[child] = 0
                else:
                    child = len(count)
                    children.append({})
                    count.append(0)
                children[node][token] = child
            count[child] += 1
            if len(out) < self.depth:
                out.append(child)
        return out

    def insert(self, tokens: list[int]) -> None:
        open_suffixes = [0]
        for t in tokens:
            open_suffixes = self.append(open_suffixes, t)

    def remove(self, tokens: list[int]) -> None:
        """Undo insert(tokens): every substring's count drops by its occurrences in tokens;
        nodes left at zero are freed (a child never counts more than its parent)."""
        children, count = self.children, self.count
        for i in range(len(tokens)):
            node = 0
            for t in tokens[i:i + self.depth]:
                child = children[node][t]
                count[child] -= 1
                if count[child] == 0:
                    del children[node][t]
                    self._free.append(child)
                node = child

    def find(self, tokens: list[int]) -> int | None:
        node = 0
        for t in tokens:
            node = self.children[node].get(t)
            if node is None:
                return None
        return node

    def longest_match(self, context: list[int], max_len: int,
                      min_count: int = 1) -> tuple[int, int]:
        """(node, length) of the longest suffix of context, at most max_len tokens, that
        occurs at least min_count times. Occurring is monotone in the length (a suffix of an
        occurring string occurs), so a binary search over lengths finds it."""
        lo, hi, best = 0, min(max_len, len(context)), 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.find(context[len(context) - mid:])
            if node is not None and self.count[node] >= min_count:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def continuation(self, node: int, max_len: int,
                     min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of node's string, token by token, while the
        estimated probability of the whole draft (product of each chosen child's share of
        its parent's continuations) stays at least min_prob. Returns (tokens, expected
        number of them accepted under those estimates)."""
        tokens, prob, expected = [], 1.0, 0.0
        children, count = self.children, self.count
        while len(tokens) < max_len and children[node]:
            kids = children[node]
            token = max(kids, key=lambda t: count[kids[t]])
            prob *= count[kids[token]] / sum(count[c] for c in kids.values())
            if prob < min_prob:
                break
            tokens.append(token)
            expected += prob
            node = kids[token]
        return tokens, expected


class _RequestTrie:
    __slots__ = ("trie", "open", "inserted")

    def __init__(self):
        self.trie = SuffixTrie()
        self.open = [0]
        self.inserted = 0


class _DomainTrie:
    __slots__ = ("trie", "texts", "tokens")

    def __init__(self):
        self.trie = SuffixTrie()
        self.texts: deque[list[int]] = deque()
        self.tokens = 0


class SuffixProposer:
    """Drafts from a request's own suffix trie (prompt + output) and its domain's job-wide
    one (outputs of finished requests), whichever expects more accepted tokens."""
    num_params = 0

    def __init__(self, max_tokens: int = 16_384, min_prob: float = 0.1):
        self.max_tokens = max_tokens
        self.min_prob = min_prob
        self.requests: dict[int, _RequestTrie] = {}
        self.domains: dict[str | None, _DomainTrie] = {}

    def propose(self, rows: list[tuple[Sequence, int]]) -> list[Proposal]:
        return [Proposal(self.draft(seq, k), None) for seq, k in rows]

    def draft(self, seq: Sequence, k: int) -> list[int]:
        own = self.requests.get(seq.seq_id)
        if own is None:
            own = self.requests[seq.seq_id] = _RequestTrie()
        for t in seq.token_ids[own.inserted:]:
            own.open = own.trie.append(own.open, t)
        own.inserted = len(seq.token_ids)
        room = DEPTH - k
        best, best_score = [], 0.0
        # the request's own text: the suffix itself occurs once (at the end), so a match
        # must occur at least twice; the domain's outputs: once is enough
        sources = [(own.trie, 2)]
        if (dom := self.domains.get(seq.domain)) is not None:
            sources.append((dom.trie, 1))
        for trie, min_count in sources:
            node, length = trie.longest_match(seq.token_ids, room, min_count)
            if length == 0:
                continue
            tokens, score = trie.continuation(
                node, min(k, math.ceil(MATCH_FACTOR * length)), self.min_prob)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def finish(self, seq: Sequence, completed: bool) -> None:
        """seq left the engine: drop its own trie; a completed request's output joins its
        domain's job-wide trie."""
        self.requests.pop(seq.seq_id, None)
        if completed:
            self.remember(seq.domain, seq.output_token_ids)

    def seed(self, domain: str | None, outputs: list[list[int]]) -> None:
        """Outputs of an earlier run (oldest first) join the domain's job-wide trie as if
        its requests had just finished here: a scheduled job drafts from last night's."""
        for out in outputs:
            self.remember(domain, list(out))

    def remember(self, domain: str | None, out: list[int]) -> None:
        """Add one output to its domain's job-wide trie, whose oldest outputs go once it
        holds max_tokens."""
        if not out or len(out) > self.max_tokens:
            return
        dom = self.domains.get(domain)
        if dom is None:
            dom = self.domains[domain] = _DomainTrie()
        dom.trie.insert(out)
        dom.texts.append(out)
        dom.tokens += len(out)
        while dom.tokens > self.max_tokens:
            old = dom.texts.popleft()
            dom.trie.remove(old)
            dom.tokens -= len(old)
