"""Proposers: where draft tokens come from.

- DraftModelProposer: a small model with its own paged KV cache (indexed by the target's block
  tables). One batched forward per draft step over every row it serves; a row stops drafting
  at the first step where the draft's probability of its own token is below the confidence
  threshold τ (draft state only, so sampling stays exact).
- NgramProposer: prompt lookup (copy the continuation of the longest recent suffix match in
  prompt + output); deterministic drafts, so q is one-hot (draft_probs None).
- SuffixProposer (spec/suffix.py): the most frequent continuation in suffix tries over the
  request's own text and its domain's finished outputs; one-hot too.

Both return, per row, the draft token ids and (model drafts) their probabilities q [n, V]:
the proposer and the verifier meet through that data only."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from batchspec.engine.runner import ModelRunner
from batchspec.engine.sequence import Sequence
from batchspec.layers.attention import DECODE_MAX_Q
from batchspec.spec.rng import STREAM_DRAFT
from batchspec.spec.verify import draw_tokens, filtered_probs, greedy_tokens, softmax_probs
from batchspec.spec.verify_torch import target_probs


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None      # [n, V] fp32 draft distribution q, None: one-hot
    stopped_by_confidence: bool = False
    # each draft's class by its source's own evidence (suffix drafts: its share of the
    # continuations its trie counted and the length of the match), or None; the adaptive
    # policy learns each class's acceptance from what verification accepts
    classes: list[int] | None = None

    def cut(self, n: int) -> Proposal | None:
        """The first n drafts (None for none)."""
        if not n:
            return None
        return Proposal(self.token_ids[:n], None if self.probs is None else self.probs[:n],
                        self.stopped_by_confidence,
                        None if self.classes is None else self.classes[:n])


def row_filters(seqs: list[Sequence], vocab_size: int) -> tuple[list[int], list[float]]:
    """Each row's top-k (at most the vocabulary; 0: off) and top-p (1: off)."""
    return ([min(s.params.top_k, vocab_size) for s in seqs],
            [s.params.top_p for s in seqs])


def draft_probs(logits: torch.Tensor, temperature: torch.Tensor, seqs: list[Sequence]):
    """The draft's sampling distribution q [R, V]: temperature, top-k, top-p by the same
    rule as the target's p (verify_torch.target_probs; on the CPU the C++ twin's row passes:
    verify.filtered_probs with a filter, verify.softmax_probs without); T = 0 rows use T = 1
    (their q only serves the confidence rule)."""
    top_k, top_p = row_filters(seqs, logits.shape[-1])
    if any(top_k) or any(p < 1.0 for p in top_p):
        q = filtered_probs(logits, temperature, top_k, top_p)
        if q is not None:
            return q
        return target_probs(logits, temperature,
                            torch.tensor(top_k) if any(top_k) else None,
                            torch.tensor(top_p) if any(p < 1.0 for p in top_p) else None)[1]
    return softmax_probs(logits, temperature)


def joined(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The 2-D blocks one under the other, as torch.cat gives them, without a copy where
    they already lie so in memory: a model draft's call gives its rows' q as consecutive
    views of one tensor (ModelRunner.draft_steps), or of the step's buffer (Engine.propose),
    so that verification reads them as they are. Copying them cost 1-2 us a drafted token (16
    KiB each with the demo's vocabulary); blocks that lie apart are copied."""
    first = blocks[0]
    for last, b in zip(blocks, blocks[1:]):
        if not (b.is_contiguous() and last.is_contiguous() and b.dtype == last.dtype and
                b.shape[1:] == last.shape[1:] and
                b.untyped_storage().data_ptr() == last.untyped_storage().data_ptr() and
                b.storage_offset() == last.storage_offset() + last.numel()):
            return torch.cat(blocks)
    if len(blocks) == 1:
        return first
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                   (sum(b.shape[0] for b in blocks), *first.shape[1:]),
                                   first.stride())


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, confidence_threshold: float):
        self.runner = runner
        self.threshold = confidence_threshold
        self.num_params = runner.num_params
        # seconds and rows of the last propose's catch-up forward: the first, where a row's
        # draft had more than DECODE_MAX_Q tokens of it to read (a new row's prompt, a row
        # drafted for again after plain steps); 0.0 when none ran
        self.catch_up = (0.0, 0)

    def finish(self, seq: Sequence, completed: bool) -> None:
        """seq left the engine (its KV blocks go with it)."""

    def propose(self, rows: list[tuple[Sequence, int]],
                into: tuple[torch.Tensor, list[int]] | None = None) -> list[Proposal]:
        """rows: (seq, max_drafts >= 1). Brings each row's draft KV up to date, then drafts
        up to max_drafts tokens per row, all rows in one forward per draft step. into:
        (buffer [N, V] fp32, each row's first row in it): the sampled rows' q are written
        there, a row's steps one after the other, and their proposals' probs are views of it
        (Engine.propose lays a step's rows out in the order verification reads them)."""
        out = [Proposal([], None) for _ in rows]
        feed = [seq.token_ids[seq.spec.num_draft_computed:] for seq, _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]   # per row: q's blocks [n, V]
        active = list(range(len(rows)))
        step = 0
        self.catch_up = (0.0, 0)
        while active:
            if self._in_one_call(rows, active, feed, out, probs, step, into):
                break
            seqs = [rows[i][0] for i in active]
            t0 = time.perf_counter() if step == 0 else 0.0
            logits = self.runner.forward(
                [feed[i] for i in active], [s.spec.num_draft_computed for s in seqs],
                [s.block_table for s in seqs], [1] * len(active))       # [A, V]
            if step == 0 and any(len(feed[i]) > DECODE_MAX_Q for i in active):
                self.catch_up = (time.perf_counter() - t0, len(active))
            for s, i in zip(seqs, active):
                s.spec.num_draft_computed += len(feed[i])
            # (at T = 0 a step's only tensor op besides the forward is the argmax: at small
            # batches each op's dispatch costs as much as its arithmetic)
            all_greedy = all(s.params.temperature == 0 for s in seqs)
            tokens = greedy_tokens(logits)
            q = None  # greedy rows need q only for the confidence rule
            if not all_greedy or self.threshold > 0:
                temps = torch.tensor([s.params.temperature for s in seqs])
                greedy = temps == 0
                q = draft_probs(logits, temps, seqs)                    # [A, V]
            if not all_greedy:  # inverse-CDF draw from q, keyed like verification
                sampled = draw_tokens(q, torch.tensor([s.seed for s in seqs]),
                                      torch.tensor([s.num_output_tokens for s in seqs]),
                                      torch.full((len(seqs),), step), STREAM_DRAFT)
                tokens = torch.where(greedy, tokens, sampled)
            # confidence: the draft's probability of its own token (greedy rows: at T=1)
            conf = None if self.threshold == 0 else q.gather(1, tokens[:, None]).squeeze(1)
            token_list = tokens.tolist()
            still = []
            for a, i in enumerate(active):
                if conf is not None and conf[a] < self.threshold:
                    out[i].stopped_by_confidence = True
                    continue
                out[i].token_ids.append(token_list[a])
                if q is not None:
                    if into is not None:    # (a row's q lands in the buffer as it is drawn)
                        j = into[1][i] + len(out[i].token_ids) - 1
                        probs[i].append(into[0][j:j + 1].copy_(q[a:a + 1]))
                    else:
                        probs[i].append(q[a:a + 1])
                if len(out[i].token_ids) < rows[i][1]:
                    feed[i] = [token_list[a]]
                    still.append(i)
            active = still
            step += 1
        for i, p in enumerate(probs):
            if p and sum(len(b) for b in p) == len(out[i].token_ids):
                # a row drafted in one call keeps the call's view of its q, a row in a
                # buffer its view of the buffer (no copy)
                out[i].probs = joined(p)
        return out

    def _in_one_call(self, rows, active: list[int], feed: list[list[int]],
                     out: list[Proposal], probs: list[list[torch.Tensor]], step: int,
                     into: tuple[torch.Tensor, list[int]] | None = None) -> bool:
        """The active rows' remaining drafts from `step` on in one C++ call, where the
        draft's model has one (ModelRunner.draft_steps: the same tokens and q as the loop
        below); not for rows under a confidence rule, nor while a row's pending feed is long
        (a draft's first catch-up of a prompt: that step takes the forward, the rest the
        call). False where it does not run."""
        if self.threshold > 0 or not self.runner.steps_in_one_call:
            return False
        seqs = [rows[i][0] for i in active]
        if any(not feed[i] or len(feed[i]) > DECODE_MAX_Q for i in active):
            return False
        more = [rows[i][1] - len(out[i].token_ids) for i in active]
        sampling = None
        if any(s.params.temperature > 0 for s in seqs):
            sampling = ([s.params.temperature for s in seqs], [s.seed for s in seqs],
                        [s.num_output_tokens for s in seqs],
                        *row_filters(seqs, self.runner.cfg.vocab_size))
        got = self.runner.draft_steps(
            [feed[i] for i in active], [s.spec.num_draft_computed for s in seqs],
            [s.block_table for s in seqs], more, step, sampling,
            None if into is None else
            (into[0], [into[1][i] + len(out[i].token_ids) for i in active]))
        if got is None:
            return False
        tokens, q = got
        for a, (i, s, n) in enumerate(zip(active, seqs, more)):
            out[i].token_ids.extend(tokens[a])
            s.spec.num_draft_computed += len(feed[i]) + n - 1
            if q is not None and s.params.temperature > 0:   # greedy rows need no q
                probs[i].append(q[a])
        return True


class NgramProposer:
    num_params = 0

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, rows: list[tuple[Sequence, int]]) -> list[Proposal]:
        return [Proposal(self.lookup(seq.token_ids, k), None) for seq, k in rows]

    def finish(self, seq: Sequence, completed: bool) -> None:
        """Nothing to forget: the lookup reads the sequence itself."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Continuation (<= k tokens) after the most recent earlier occurrence of the longest
        suffix of `tokens` of length max_n..min_n."""
        n_tok = len(tokens)
        arr = np.asarray(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            # every earlier window of n tokens (ending before the suffix itself), vectorised:
            # a RAG prompt has thousands of tokens and this runs per row per step
            windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
            hits = np.flatnonzero((windows == arr[n_tok - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1])
                return tokens[start + n:start + n + k]
        return []
