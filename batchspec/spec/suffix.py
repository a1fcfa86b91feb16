"""Suffix drafts (after SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): continue the
text with what most often followed its longest suffix, in the request's own prompt + output
and in the outputs of the requests of its domain that already finished in this engine (the
job-wide part: templated jobs repeat their phrasing from row to row).

The structure is a suffix trie bounded in depth: it counts every substring of at most
DEPTH tokens of the texts inserted (a node per distinct substring, its count the number of
occurrences). Appending a token extends the text's DEPTH open suffixes by one node each, so
inserting a text of n tokens costs O(n * DEPTH) and removing it the same; nothing is ever
rebuilt. Memory: at most DEPTH nodes per token held. A request's part lives while the
request runs (prompt + output tokens); a domain's job-wide trie holds the outputs of its most
recently finished requests up to `max_tokens` tokens in all, the oldest removed first, so it
never has more than DEPTH * max_tokens nodes (about 83 bytes each in the C++ trie, 250 in
the Python one: 21 or 64 MiB per domain at the default 16,384 tokens, in the worst case of
text that never repeats).

The trie is kernels/suffix_trie.cpp's SuffixTrie when the CPU kernels build, the Python
SuffixTrie below otherwise (or with BATCHSPEC_SUFFIX_NATIVE=0): the same structure and the
same drafts, ties included (tests/test_suffix.py), at a fraction of the cost. Every finished
output enters and later leaves the job-wide trie; at 32 rows and more the Python trie's
upkeep was a large part of a speculating step. In C++ a request's own part is no trie:
RequestText keeps the text (4 bytes a token) and scans it for the draft a trie over it
gives, where a trie grew DEPTH nodes a token, each a hash insert into memory the target's
forward had just evicted (tested against the Python trie, ties included).

Drafts are deterministic (q one-hot): exactness is the verifier's, as for n-gram drafts."""
from __future__ import annotations

import functools
import logging
import math
import os
from collections import deque

from batchspec.engine.sequence import Sequence
from batchspec.spec.proposer import Proposal

log = logging.getLogger(__name__)

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
        self._open = [0]     # open suffixes of the growing text (extend)

    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def node_count(self, node: int) -> int:
        return self.count[node]

    def edges(self, node: int) -> list[int]:
        """node's children as [token, child, token, child, ...], first added first."""
        return [x for t, child in self.children[node].items() for x in (t, child)]

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the trie's own growing text (a request's prompt + output)."""
        for t in tokens:
            self._open = self.append(self._open, t)

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
                     min_prob: float) -> tuple[list[int], list[float]]:
        """The most frequent continuation of node's string, token by token, while the
        estimated probability of the whole draft (product of each chosen child's share of
        its parent's continuations) stays at least min_prob. Returns (tokens, each token's
        share): the shares estimate each token's acceptance given the ones before it."""
        tokens, shares, prob = [], [], 1.0
        children, count = self.children, self.count
        while len(tokens) < max_len and children[node]:
            kids = children[node]
            token = max(kids, key=lambda t: count[kids[t]])
            share = count[kids[token]] / sum(count[c] for c in kids.values())
            prob *= share
            if prob < min_prob:
                break
            tokens.append(token)
            shares.append(share)
            node = kids[token]
        return tokens, shares

    def draft(self, context: list[int], max_match: int, min_count: int, max_len: int,
              match_factor: float, min_prob: float) -> tuple[list[int], list[float], int]:
        """The continuation of context's longest match (at most max_match tokens, occurring
        at least min_count times), at most min(max_len, ceil(match_factor * match length))
        tokens: (tokens, each token's share, match length); ([], [], 0) when nothing
        matches."""
        node, length = self.longest_match(context, max_match, min_count)
        if length == 0:
            return [], [], 0
        tokens, shares = self.continuation(
            node, min(max_len, math.ceil(match_factor * length)), min_prob)
        return tokens, shares, length

    def propose(self, new_tokens: list[int], context: list[int], max_match: int, max_len: int,
                match_factor: float, min_prob: float,
                domain: SuffixTrie | None) -> tuple[list[int], list[float], int]:
        """One row's draft: append new_tokens to this request's text, then the better
        (preferred()) of this trie's draft, whose match must occur twice (once is the text's
        own end), and the domain trie's, where once is enough. Returns draft()'s triple."""
        self.extend(new_tokens)
        best = self.draft(context, max_match, 2, max_len, match_factor, min_prob)
        if domain is not None:
            other = domain.draft(context, max_match, 1, max_len, match_factor, min_prob)
            if preferred(other, best):
                best = other
        return best


def preferred(a: tuple[list[int], list[float], int], b: tuple[list[int], list[float], int]
              ) -> bool:
    """Whether draft a (draft()'s triple) is proposed over draft b: a draft over none; else
    the one continuing the longer match; on equal matches, the one with more expected
    accepted tokens; b on a tie. Shares do not compare across match lengths: one
    occurrence of a one-token match gives its continuation a share of 1, and a one-token
    match is the weakest evidence there is (evidence_class). Choosing between the request's
    own draft and the job-wide one by expected accepted tokens alone (the sum of the
    shares' running products) took the shorter match's draft often enough that the longer
    match's makes 1.1% more tokens per cost of a round at 32 rows
    (benchmarks/suffix_rules.py)."""
    if bool(a[0]) != bool(b[0]):
        return bool(a[0])
    if a[2] != b[2]:
        return a[2] > b[2]
    return expected_accepted(a[1]) > expected_accepted(b[1])


def evidence_class(share: float, match: int) -> int:
    """A suffix draft token's class for the adaptive policy's calibration (policy.record):
    the tenth of its share of the continuations (0-9) and the length of the match it
    continues (1, 2, 3, 4-7, 8 or more). On held-out code and prose at 32 rows
    (benchmarks/suffix_classes.py), with a share of 0.9 or more a token continuing a
    one-token match was accepted 4% of the time, after 2-3 tokens 72-77%, 4-7 88%, 8 or
    more 95%; with a share below 0.7, 0-40%."""
    band = match - 1 if match < 4 else 3 if match < 8 else 4
    return 5 * min(int(share * 10), 9) + band


def expected_accepted(shares: list[float]) -> float:
    """Expected accepted tokens of a draft whose tokens are each accepted, given the ones
    before them, with these probabilities: the sum of their running products."""
    prob, total = 1.0, 0.0
    for share in shares:
        prob *= share
        total += prob
    return total


def new_trie(depth: int = DEPTH):
    """A suffix trie: the C++ one when the CPU kernels load, else SuffixTrie."""
    native = _native_if_wanted()
    return native.SuffixTrie(depth) if native is not None else SuffixTrie(depth)


def new_request_text(depth: int = DEPTH):
    """A request's own text for its drafts: kernels/suffix_trie.cpp's RequestText when the
    CPU kernels load (the drafts of a trie over the text, found by scanning it), else a
    SuffixTrie. Both take extend() and propose() alike."""
    native = _native_if_wanted()
    return native.RequestText(depth) if native is not None else SuffixTrie(depth)


def _native_if_wanted():
    """The C++ module, unless BATCHSPEC_SUFFIX_NATIVE=0 asks for the Python trie (read at
    each call: tests and benchmarks switch it) or it cannot be built."""
    return _native() if os.environ.get("BATCHSPEC_SUFFIX_NATIVE", "1") != "0" else None


@functools.cache
def _native():
    """The C++ module of SuffixTrie and RequestText, or None (looked up once: a build that
    failed is not retried)."""
    try:
        from batchspec.spec._build import cpu_module
        return cpu_module()
    except Exception as e:  # noqa: BLE001 - no compiler: the Python trie
        log.warning("C++ suffix trie unavailable (%s); using the Python one", e)
        return None


class _RequestTrie:
    __slots__ = ("trie", "inserted")

    def __init__(self):
        self.trie = new_request_text()
        self.inserted = 0


class _DomainTrie:
    __slots__ = ("trie", "texts", "tokens")

    def __init__(self):
        self.trie = new_trie()
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
        out = []
        for seq, k in rows:
            tokens, shares, length = self.draft_with_evidence(seq, k)
            out.append(Proposal(tokens, None, classes=[
                evidence_class(share, length + i) for i, share in enumerate(shares)]))
        return out

    def draft(self, seq: Sequence, k: int) -> list[int]:
        return self.draft_with_evidence(seq, k)[0]

    def draft_with_evidence(self, seq: Sequence, k: int) -> tuple[list[int], list[float], int]:
        """Up to k draft tokens for seq, each one's share of its parent's continuations in
        the trie it came from, and the length of the match the draft continues."""
        own = self.requests.get(seq.seq_id)
        if own is None:
            own = self.requests[seq.seq_id] = _RequestTrie()
        ids = seq.token_ids
        room = DEPTH - k
        dom = self.domains.get(seq.domain)
        best = own.trie.propose(ids[own.inserted:], ids[-room:] if room > 0 else [], room, k,
                                MATCH_FACTOR, self.min_prob, dom.trie if dom else None)
        own.inserted = len(ids)
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
