"""The engine step: schedule -> propose -> verify (one target forward over every row's
1 + n_i tokens, then rejection sampling) -> commit (accepted tokens, KV rollback, stop checks).
Plain decoding is the same step with zero drafts."""
from __future__ import annotations

import logging
import time

import torch

from batchspec.config import EngineConfig, draft_sources, draft_vocab_for
from batchspec.contract import NGRAM, SUFFIX, Request, request_seed
from batchspec.engine.block_manager import BlockManager
from batchspec.engine.distributed import make_target_runner
from batchspec.engine.runner import ModelRunner
from batchspec.engine.scheduler import ScheduledSeq, Scheduler
from batchspec.engine.sequence import Sequence
from batchspec.models.loader import load_tokenizer
from batchspec.spec import draft_vocab
from batchspec.spec.policy import PROMPT_TIMED, SpecPolicy, StepCosts
from batchspec.spec.proposer import DraftModelProposer, NgramProposer, Proposal, joined
from batchspec.spec.suffix import SuffixProposer
from batchspec.spec.verify import VerifyMetadata, resolve_backend, verify

log = logging.getLogger(__name__)
CPU_KV_CACHE_GB = 1.0
# tokens of context the start-up step costs are timed at (measure_step_costs)
STEP_COST_CONTEXT = 128
SMALL_MODEL_PARAMS = 50_000_000


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = c = config
        self.target = make_target_runner(c)   # sharded over ranks when tensor_parallel_size > 1
        self.verify_backend = resolve_backend(c.verify_backend, self.target.device)  # once
        self._set_threads()
        self.tokenizer = load_tokenizer(c.model)
        cfg = self.target.cfg
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.proposers: dict[str, DraftModelProposer | NgramProposer | SuffixProposer] = {}
        self.routes: dict[str, str] = {}   # model draft -> the lookup source routed with it
        self.source_label: dict[str, str] = {}  # proposer -> its path, "ngram" or "suffix"
        # model draft -> the proposer of its draft_vocab.json's tokens, for the rows that
        # score them while others score every token (draft_vocab None: by each row's
        # temperature; source_for)
        self.vocab_sources: dict[str, str] = {}
        runners: dict[str, ModelRunner] = {}
        for name, value in c.drafts.items():
            path, *lookup = draft_sources(value)
            if lookup:
                self.routes[name] = f"{name}+{lookup[0]}"
                self._add_lookup(self.routes[name], lookup[0])
            if path in (NGRAM, SUFFIX):
                self._add_lookup(name, path)
                continue
            if path not in runners:
                runners[path] = ModelRunner(path, c.devices[0], c.dtype, c.attention_backend,
                                            head_rows=self._draft_vocab(path)
                                            if c.draft_vocab else None)
                self._check_draft(path, runners[path])
                runners[path].use_int8_head()   # a draft's logits may round (CPU: VNNI, AVX2)
            self.proposers[name] = DraftModelProposer(runners[path], c.confidence_threshold)
            self.source_label[name] = path
        # drafts whose rows draft from lookups (alone or routed): what those find changes with
        # the text, and the job-wide trie's with every finished row
        self.lookup_fed = {name for name in c.drafts
                           if name in self.routes or self.source_label[name] in (NGRAM, SUFFIX)}
        k = c.num_speculative_tokens if c.speculative else 0
        self.max_model_len = min(c.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        for r in runners.values():
            self.max_model_len = min(self.max_model_len, r.cfg.max_position_embeddings)
        all_runners = [self.target, *runners.values()]
        num_blocks = self._num_kv_blocks(all_runners, k)
        capacity = num_blocks * c.block_size - k
        if capacity < self.max_model_len:
            log.warning("KV cache holds %d tokens; max_model_len lowered from %d",
                        capacity, self.max_model_len)
            self.max_model_len = capacity
        for r in all_runners:
            r.allocate_kv_cache(num_blocks, c.block_size, c.prefault_kv_cache)
        if c.draft_vocab is None:
            self._add_vocab_sources(runners)
        # which proposers run a draft model, the vocabularies' too (the rest look their drafts up)
        self.is_model = {name: isinstance(p, DraftModelProposer)
                         for name, p in self.proposers.items()}
        self.policy = SpecPolicy(c, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens,
                                   self.policy.lookahead)
        self._next_id = 0
        # rows of the batch that may draft: (scheduler version, rows, any from lookups,
        # their mix of temperatures)
        self._drafting: tuple[int, list[Sequence], bool, tuple] = (-1, [], False, ())
        self._step_mix: tuple | None = None   # the mix this step asked the policy about
        if c.adaptive_k and k > 0:
            self.policy.costs = self.measure_step_costs()

    def _add_vocab_sources(self, runners: dict[str, ModelRunner]) -> None:
        """Beside each model draft with a draft_vocab.json, a proposer that scores only its
        tokens: the same model and KV cache with a cut output layer
        (ModelRunner.scoring_only), so a row may draft through either."""
        cut: dict[str, ModelRunner | None] = {}
        for name in [n for n, p in self.proposers.items() if isinstance(p, DraftModelProposer)]:
            path = self.source_label[name]
            if path not in cut:
                ids = self._draft_vocab(path)
                cut[path] = None if ids is None else runners[path].scoring_only(ids)
            if cut[path] is None:
                continue
            vocab = self.vocab_sources[name] = f"{name}+vocab"
            self.proposers[vocab] = DraftModelProposer(cut[path],
                                                       self.config.confidence_threshold)
            self.source_label[vocab] = path
            if name in self.routes:
                self.routes[vocab] = self.routes[name]

    def source_for(self, draft: str | None, temperature: float) -> str | None:
        """The proposer that drafts for a row of model draft `draft` at this temperature:
        where the draft has a list and the engine chooses per row (draft_vocab None), the
        list's proposer if the row samples greedily (config.draft_vocab_for), else the
        draft's own."""
        vocab = self.vocab_sources.get(draft)
        return vocab if vocab is not None and draft_vocab_for(temperature) else draft

    def _add_lookup(self, name: str, kind: str) -> None:
        c = self.config
        self.proposers[name] = NgramProposer(c.ngram_min, c.ngram_max) if kind == NGRAM else \
            SuffixProposer(c.suffix_max_tokens, c.suffix_min_prob)
        self.source_label[name] = kind

    def measure_step_costs(self, ctx_len: int = STEP_COST_CONTEXT, repeats: int = 3,
                           max_batch: int = 64) -> StepCosts:
        """Time the target over B rows of q tokens (q = 1, k + 1 and one between; a line in q
        gives the rest: StepCosts.smooth) and each draft over B rows of one
        token (a k-th of k steps where they run in one call, ModelRunner.draft_steps),
        B = 1, 2, 4, ... up to what one step can hold (at most max_batch; larger
        batches are extrapolated, and the online correction absorbs the error), at a context
        of ctx_len tokens (the largest batch also at an eighth of it and, where its KV fits,
        four times it: what a row's context token adds, StepCosts.at), and what a prompt of
        PROMPT_TIMED tokens adds beside the largest batch: the fastest of `repeats` rounds
        (two at the least) in which every shape is timed once, the first of them, cold,
        serving as the warm-up; then smoothed (StepCosts.smooth). The KV written lands in
        free blocks and is never read."""
        c = self.config
        k = c.num_speculative_tokens
        ctx = max(1, min(ctx_len, self.max_model_len - k - 1))
        per_row = -(-(ctx + k + 1) // c.block_size)
        max_b = max(1, min(c.max_num_seqs, max_batch, self.block_manager.num_blocks // per_row,
                           c.max_num_batched_tokens // (k + 1)))
        grid = sorted({2 ** i for i in range(max_b.bit_length()) if 2 ** i <= max_b} | {max_b})
        costs = StepCosts(grid)
        runners = {name: p.runner for name, p in self.proposers.items()
                   if isinstance(p, DraftModelProposer)}

        tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(max_b)]

        def timed(runner, b, q, draft=False, context=ctx, blocks=tables):
            """(a forward of runner over b rows of q tokens after `context` tokens each (their
            KV in `blocks`), the steps it counts for, the device to synchronise)."""
            args = ([[0] * q] * b, [context] * b, blocks[:b], [q] * b)
            # a draft whose steps run in one C++ call: a step is a k-th of k steps' call
            if draft and runner.steps_in_one_call:
                return (lambda: runner.draft_steps(*args[:3], [k] * b)), k, runner.device
            return (lambda: runner.forward(*args).sum().item()), 1, runner.device

        # the target at q = 1, k + 1 and one between: smooth() fits a line in q through them
        # and fills the rest. Start-up of the demo family (k = 4, B up to 64, three drafts
        # of two output layers each) on a 2-core CPU: 7.4 s timing every q in five rounds,
        # 5.0 s timing three, 3.4 s in three rounds, whose costs came within 1-3% of five's,
        # and 2.6 s without a round of warm-up before them (costs within 1-2% of those with)
        timed_qs = sorted({1, (k + 2) // 2, k + 1})
        runs = {("target", q, b): timed(self.target, b, q) for q in timed_qs for b in grid}
        # the largest batch again at a short context and a long one (where its KV fits):
        # what a row's context token adds to each shape below the context and above it
        # (attention reads it; it grows faster at long contexts), so that plans price a step
        # at its rows' context (StepCosts.at)
        short, long = ctx // 8, 4 * ctx
        long_rows = -(-(long + k + 1) // c.block_size)
        if long + k + 1 > self.max_model_len or \
                max_b * long_rows > self.block_manager.num_blocks:
            long = 0
        tables_long = [list(range(i * long_rows, (i + 1) * long_rows))
                       for i in range(max_b)] if long else tables
        others = [n for n in (short, long) if n]
        ctx_qs = sorted({1, k + 1})      # (a line in q through them: smooth())
        for n in others:
            runs.update({("target", q, max_b, n): timed(self.target, max_b, q, context=n,
                                                        blocks=tables_long if n == long
                                                        else tables)
                         for q in ctx_qs})
        # a draft model's runner (its whole or cut output layer) -> the proposers it serves
        served: dict[int, list[str]] = {}
        for name, runner in runners.items():
            if id(runner) not in served:
                runs.update({(id(runner), b): timed(runner, b, 1, draft=True) for b in grid})
                for n in others:
                    runs[id(runner), max_b, n] = timed(
                        runner, max_b, 1, draft=True, context=n,
                        blocks=tables_long if n == long else tables)
            served.setdefault(id(runner), []).append(name)
        # the largest batch of one-token rows and, beside it, a prompt of its last logit only
        # (its table is the first row's: the KV it writes is never read)
        prompt = min(PROMPT_TIMED, ctx)
        runs["prompt"] = ((lambda: self.target.forward(
            [[0]] * max_b + [[0] * prompt], [ctx] * max_b + [0], tables + tables[:1],
            [1] * (max_b + 1)).sum().item()), 1, self.target.device)
        runs.update(self._sampling_runs(runners, max_b, k, ctx, tables))
        self._warm_verification()
        # Every shape is timed once a round, round after round, and keeps its fastest: the
        # machine's speed drifts while this runs, and timing the shapes one after another
        # put the drift into the costs' slope in q (at 64 rows, 5-token windows were timed
        # at 1.7x a decode step where steps measured 2.2x), which the online correction, one
        # factor per side, cannot take out.
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(max(repeats, 2)):
            for key, (run, steps, device) in runs.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best[key] = min(best[key], (time.perf_counter() - t0) / steps)
        for q in timed_qs:
            costs.target[q] = [best["target", q, b] for b in grid]
        for key, names in served.items():
            for name in names:
                costs.draft[name] = [best[key, b] for b in grid]
        if others:
            costs.context = ctx

            def slopes(at_ctx: float, key: tuple) -> tuple[float, float]:
                """Seconds a row's context token adds below ctx and above (one side timed:
                both alike)."""
                side = [max(0.0, at_ctx - best[key + (short,)]) / (max_b * (ctx - short))
                        if short else None,
                        max(0.0, best[key + (long,)] - at_ctx) / (max_b * (long - ctx))
                        if long else None]
                return (side[0] if side[0] is not None else side[1],
                        side[1] if side[1] is not None else side[0])
            costs.target_ctx = {q: slopes(best["target", q, max_b], ("target", q, max_b))
                                for q in ctx_qs}
            for key, names in served.items():
                for name in names:
                    costs.draft_ctx[name] = slopes(best[key, max_b], (key, max_b))
        costs.prompt_token_s = max(0.0, best["prompt"] - best["target", 1, max_b]) / prompt
        slots = max_b * k
        costs.verify_token_s = max(0.0, best["verify", 1.0] - best["verify", 0.0]) / slots
        for key, names in served.items():
            if ("draw", key) in best:
                for name in names:
                    costs.draft_sample_s[name] = max(
                        0.0, best["draw", key] - k * best[key, max_b]) / slots
        costs.smooth()
        log.info("step costs (ms) at B=%s and a context of %d: target %s; drafts %s; a row's "
                 "context token (us) %s, drafts' %s; a prompt token %.4f; a "
                 "drafted token at T > 0: verification %.4f, drafts' draws %s", grid, ctx,
                 {q: [round(1e3 * t, 2) for t in v] for q, v in costs.target.items()},
                 {n: [round(1e3 * t, 2) for t in v] for n, v in costs.draft.items()},
                 {q: [round(1e6 * t, 4) for t in s] for q, s in costs.target_ctx.items()},
                 {n: [round(1e6 * t, 4) for t in s] for n, s in costs.draft_ctx.items()},
                 1e3 * costs.prompt_token_s, 1e3 * costs.verify_token_s,
                 {n: round(1e3 * t, 4) for n, t in costs.draft_sample_s.items()})
        return costs

    def _sampling_runs(self, runners: dict[str, ModelRunner], b: int, k: int, ctx: int,
                       tables: list[list[int]]) -> dict:
        """Shapes that time what sampling at T > 0 adds to a round of b rows drafting k tokens
        each, beyond the forwards (which are timed greedy): verification of the k + 1
        windows with the drafts' q (the rows' views of one draft's call, which
        _verify_metadata joins without a copy) at T = 1 against T = 0, and each model
        draft's k steps in one call drawing from q (softmax over the vocabulary, q kept per
        row as propose keeps it) against its greedy steps. At 32 rows and T = 0.8 a fixed
        k = 4 spent 3.8 ms a step in its draft's calls against 2.2 at T = 0, and 0.9 ms
        verifying against 0.13: about 19 us a drafted token that the greedy forwards leave
        out (benchmarks/step_phases.py)."""
        dev, V = self.target.device, self.target.cfg.vocab_size
        logits = self.target.forward([[0] * (k + 1)] * b, [ctx] * b, tables[:b], [k + 1] * b,
                                     float_logits=False)    # (as a step's: its dtype)
        q = list(torch.softmax(torch.randn(b * k, V), dim=-1).to(dev).split(k))
        ids = torch.randint(V, (b * k,), dtype=torch.int32, device=dev)
        cu = torch.arange(0, b * k + 1, k, dtype=torch.int32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)

        def meta(t: float, probs) -> VerifyMetadata:
            return VerifyMetadata(ids, cu, torch.full((b,), t, device=dev),
                                  torch.arange(b, **i64), torch.zeros(b, **i64),
                                  draft_probs=probs, max_num_draft=k)
        runs = {("verify", 0.0): (lambda: verify(logits, meta(0.0, None), self.verify_backend,
                                                 resolved=True), 1, dev),
                ("verify", 1.0): (lambda: verify(logits, meta(1.0, joined(q)),
                                                 self.verify_backend, resolved=True), 1, dev)}
        sampling = ([1.0] * b, list(range(b)), [0] * b, [0] * b, [1.0] * b)
        for runner in {id(r): r for r in runners.values() if r.steps_in_one_call}.values():
            def draw(runner=runner):
                return runner.draft_steps([[0]] * b, [ctx] * b, tables[:b], [k] * b, 0,
                                          sampling)
            runs["draw", id(runner)] = (draw, 1, runner.device)
        return runs

    def _warm_verification(self) -> None:
        """Load (on first use: build) the verification op now, so that no timed step pays
        for it."""
        dev = self.target.device
        verify(torch.zeros(1, self.target.cfg.vocab_size, device=dev),
               VerifyMetadata.dummy(dev), self.verify_backend, resolved=True)

    def _set_threads(self) -> None:
        """CPU intra-op threads: as configured; by default one for small models, whose
        matmuls gain nothing from a thread pool and lose much when a core is busy."""
        n = self.config.num_threads
        if n is None and self.target.device.type == "cpu" and \
                self.target.num_params < SMALL_MODEL_PARAMS:
            n = 1
        if n is not None:
            torch.set_num_threads(n)

    def _draft_vocab(self, path: str) -> torch.Tensor | None:
        """The ids a draft's output layer scores (its draft_vocab.json), or None: all."""
        ids = draft_vocab.load(path)
        if ids is None:
            return None
        log.info("draft %s scores %d tokens of its vocabulary (%s)", path, len(ids),
                 draft_vocab.FILE)
        return torch.tensor(ids, dtype=torch.long)

    def _check_draft(self, path: str, runner: ModelRunner) -> None:
        if runner.cfg.vocab_size != self.target.cfg.vocab_size:
            raise ValueError(f"draft {path!r} has vocabulary size {runner.cfg.vocab_size}, "
                             f"target has {self.target.cfg.vocab_size}: a draft must share the "
                             f"target's tokenizer and vocabulary")
        draft_tok = load_tokenizer(path)
        if draft_tok is not None and self.tokenizer is not None and \
                draft_tok.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"draft {path!r} uses a different tokenizer than the target")

    def _num_kv_blocks(self, runners: list[ModelRunner], k: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = sum(r.kv_bytes_per_block(c.block_size) for r in runners)
        if c.kv_cache_memory_gb is not None:
            budget = c.kv_cache_memory_gb * 2**30
        elif self.target.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.target.device)
            budget = 0.9 * free
        else:
            budget = CPU_KV_CACHE_GB * 2**30
        enough = c.max_num_seqs * (self.max_model_len + k + c.block_size) // c.block_size
        return max(1, min(int(budget // per_block), enough))

    def close(self) -> None:
        """Stop the target's other ranks (tensor parallelism); the engine is unusable after.
        Garbage collection does the same."""
        self.target.close()

    @property
    def closed(self) -> bool:
        """Closed, or broken: a tensor-parallel target closes itself when a step fails
        mid-way (its ranks may have stopped at different points)."""
        return self.target.closed

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> Sequence:
        """Queue a request made (and checked) by LLM.make_request. A request without a seed
        gets request_seed(config.seed, request_id)."""
        ids = request.prompt_token_ids
        assert ids and len(ids) < self.max_model_len, "LLM.make_request checks prompts"
        params = request.params
        seed = params.seed if params.seed is not None else \
            request_seed(self.config.seed, request.request_id)
        seq = Sequence(self._next_id, request.request_id, ids, params, seed, request.domain)
        self._next_id += 1
        seq.spec.draft = self.policy.draft_for(request.domain, params.temperature)
        seq.spec.source = self.source_for(seq.spec.draft, params.temperature)
        proposer = self.proposers.get(seq.spec.draft)
        if isinstance(proposer, DraftModelProposer):  # its KV cache shares the block table
            seq.spec.draft_cache = proposer.runner.path
        self.scheduler.add(seq)
        return seq

    def seed_suffix_drafts(self, outputs: dict[str | None, list[list[int]]]) -> int:
        """Seed every suffix source's job-wide tries with earlier outputs ({domain: token id
        lists, oldest first}); returns how many suffix sources there are (0: nothing to
        seed)."""
        sources = [p for p in self.proposers.values() if isinstance(p, SuffixProposer)]
        for proposer in sources:
            for domain, outs in outputs.items():
                proposer.seed(domain, outs)
        return len(sources)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> list[Sequence]:
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in seqs:
            self._finish(seq, "abort")
        return seqs

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """One engine step. Returns (sequences finished in it, tokens generated in it)."""
        t0 = time.perf_counter()
        plain = self._runs_plain()
        scheduled = self.scheduler.schedule(drafts=not plain)
        if not scheduled:
            return [], 0
        sampling = [s for s in scheduled if s.is_sampling]
        chose = plain or self.propose(sampling)
        # (made before the forward: right after it, which has swept the caches, each small
        # torch op costs several times what it does here)
        meta = self._verify_metadata(sampling)
        # Every row's uncomputed tokens then its drafts; a sampling row gets 1 + n_i logits.
        logits = self.target.forward([s.input_token_ids for s in scheduled],
                                     [s.seq.num_computed_tokens for s in scheduled],
                                     [s.seq.block_table for s in scheduled],
                                     [int(s.is_sampling) + s.num_drafts for s in scheduled],
                                     float_logits=False)   # verification reads bf16 as is
        out_ids, num_accepted = verify(logits, meta, self.verify_backend, resolved=True)
        num_accepted = num_accepted.tolist()
        result = self.commit(scheduled, out_ids.tolist(), num_accepted)
        if chose:
            # the tokens the step made, before stop conditions cut any; its prompt tokens
            # besides the windows (a row finishing its prompt samples and is in the plan)
            self.policy.observe(time.perf_counter() - t0, len(sampling) + sum(num_accepted),
                                sum([s.num_new_tokens for s in scheduled]) - len(sampling))
        return result

    def propose(self, sampling: list[ScheduledSeq]) -> bool:
        """Draft tokens for decode rows allowed to speculate, grouped by draft; each row's
        proposal lands on it. Lookup sources (n-gram, suffix) draft first; a row routed
        between a model draft and a lookup keeps the lookup's drafts when the policy expects
        more of them than of the model's (else the model drafts, and the lookup's drafts are
        judged against what the row commits: _judge_unused). With adaptive_k the policy
        then sets every row's length (what a lookup found bounds its row), and model drafts
        draft only that many, level by level (a step the policy runs plain without weighing
        plans does not get here: see _runs_plain). Returns whether the policy chose lengths
        this step: the step is then measured, the drafts' catch-up included (a new row's
        prompt, a routed row's lookup rounds: costs speculation pays and plain does not),
        and each model draft's call on its own (SpecPolicy.observe_draft)."""
        rows = [s for s in sampling if s.max_drafts > 0]
        lookups = self.policy.costs is not None and \
            any(s.seq.spec.draft in self.lookup_fed for s in rows)
        for s in rows:
            s.source = s.seq.spec.source
        is_model = self.is_model
        # lookups first: they are cheap, and what they find bounds their rows
        for name, group in self._by_source(rows).items():
            alt = self.routes.get(name)
            if alt is not None:   # routed rows: the lookup drafts, then each row chooses
                self._draft(alt, group)
                for s in group:
                    if self.policy.prefer_lookup(
                            s.seq, name, alt, s.num_drafts, self.cost_ratio(name),
                            s.proposal.classes if s.proposal is not None else None,
                            len(sampling)):
                        s.source = alt
                    else:
                        if s.num_drafts:
                            s.unused = (alt, s.proposal)
                        s.proposal = None
            elif not is_model[name]:
                self._draft(name, group)
        chose = self.policy.costs is not None and bool(rows)
        if chose:
            lengths = self.policy.choose_lengths(
                [(s.seq, s.source, s.max_drafts if is_model[s.source] else s.num_drafts,
                  is_model[s.source]) for s in rows], len(sampling) - len(rows),
                [s.proposal.classes if s.proposal is not None else None for s in rows],
                lookups, self._step_mix)
            for s, n in zip(rows, lengths, strict=True):
                s.max_drafts = n
                if s.proposal is not None:
                    s.proposal = s.proposal.cut(n)
        into = self._q_buffer(sampling)
        for name, group in self._by_source(rows).items():
            group = [s for s in group if s.max_drafts > 0]
            if is_model[name] and group:
                t0 = time.perf_counter()
                self._draft(name, group, into)
                if chose:
                    seconds = time.perf_counter() - t0
                    catch_up_s, num = self.proposers[name].catch_up
                    if catch_up_s:
                        self.policy.observe_catch_up(name, catch_up_s, num)
                    self.policy.observe_draft(name, seconds)
        return chose

    def _runs_plain(self) -> bool:
        """Whether the policy runs this step plain without weighing plans (adaptive_k, plain
        leads for the decode rows' mix of temperatures, no try due); asked before
        scheduling, so that such a step reserves no draft slots and no source drafts
        (lookups neither): it costs what a plain engine's step does."""
        policy, running = self.policy, self.scheduler.running
        self._step_mix = None
        if policy.costs is None:
            return False
        if self._drafting[0] != self.scheduler.version:   # the batch's rows changed
            seqs = [seq for seq in running
                    if seq.spec.draft is not None and not seq.spec.fallback_triggered]
            lookups = any(seq.spec.draft in self.lookup_fed for seq in seqs)
            self._drafting = (self.scheduler.version, seqs, lookups, policy.mix_of(seqs))
        _, seqs, lookups, mix = self._drafting
        # (a row that fell back or has no room left to draft stays in seqs until the batch's
        # rows change: it only counts its temperature in the mix)
        if not seqs or not any(seq.num_uncomputed_tokens == 1 and policy.lookahead(seq) > 0
                               for seq in seqs):
            return False
        self._step_mix = mix     # (the step weighs its plans, if it does, under it too)
        return policy.plain_step(seqs, len(running), lookups, mix)

    @staticmethod
    def _by_source(rows: list[ScheduledSeq]) -> dict[str, list[ScheduledSeq]]:
        groups: dict[str, list[ScheduledSeq]] = {}
        for s in rows:
            groups.setdefault(s.source, []).append(s)
        return groups

    def cost_ratio(self, name: str) -> float:
        """c of draft `name`, the records' and the routing's price of a draft pass: the
        parameters its step computes with over the target's (ModelRunner.num_params; a
        draft vocabulary's left-out rows not counted); 0 for lookup sources."""
        return self.proposers[name].num_params / self.target.num_params

    def _q_buffer(self, sampling: list[ScheduledSeq]) -> tuple[torch.Tensor, dict] | None:
        """Where this step's model drafts write their sampled rows' q: one buffer, the rows'
        slots in the order verification reads them (_verify_metadata: the sampling rows'
        drafts one after the other), so that it takes the buffer as it is. Each draft's call
        (one per draft) used to give its own tensor, and a step of rows of two drafts (a
        job of two domains, each with its draft) copied them into one: 4 MiB a step at 64
        rows and k = 4, 0.3 ms of an 18 ms step. None where no model draft samples, and
        off the CPU (where the drafts' C++ calls run; elsewhere q is gathered as before)."""
        if self.target.device.type != "cpu":
            return None
        slots, n = {}, 0
        for s in sampling:
            if s.max_drafts > 0 and self.is_model[s.source] and s.seq.params.temperature > 0:
                slots[id(s.seq)] = n
            elif not s.max_drafts:
                continue
            n += s.max_drafts
        if not slots:
            return None
        return torch.empty(n, self.target.cfg.vocab_size), slots

    def _draft(self, name: str, rows: list[ScheduledSeq],
               into: tuple[torch.Tensor, dict] | None = None) -> None:
        proposer = self.proposers[name]
        if into is not None and isinstance(proposer, DraftModelProposer) and \
                all(id(s.seq) in into[1] for s in rows):
            props = proposer.propose([(s.seq, s.max_drafts) for s in rows],
                                     (into[0], [into[1][id(s.seq)] for s in rows]))
        else:
            props = proposer.propose([(s.seq, s.max_drafts) for s in rows])
        for s, p in zip(rows, props, strict=True):
            s.proposal = p

    def _verify_metadata(self, sampling: list[ScheduledSeq]) -> VerifyMetadata:
        """What verification needs besides the target's logits (which land on
        self.target.device, one per vocabulary token)."""
        dev, V = self.target.device, self.target.cfg.vocab_size
        cu, most = [0], 0
        for s in sampling:
            cu.append(cu[-1] + s.num_drafts)
            most = max(most, s.num_drafts)
        params = [s.seq.params for s in sampling]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        draft_probs = None
        if cu[-1] and any(p.temperature > 0 for p in params):   # (of the floats: no torch op)
            draft_probs = joined([
                s.proposal.probs if s.proposal.probs is not None else
                torch.nn.functional.one_hot(torch.tensor(s.proposal.token_ids), V).float()
                for s in sampling if s.num_drafts]).to(dev)
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):   # top_k >= V keeps every token (and fits int32)
            top_k = torch.tensor([min(p.top_k, V) for p in params],
                                 dtype=torch.int32, device=dev)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        return VerifyMetadata(
            draft_token_ids=torch.tensor([t for s in sampling if s.proposal
                                          for t in s.proposal.token_ids],
                                         dtype=torch.int32, device=dev),
            cu_num_draft=torch.tensor(cu, dtype=torch.int32, device=dev),
            temperature=temps.to(dev),
            seeds=torch.tensor([s.seq.seed for s in sampling], dtype=torch.int64, device=dev),
            offsets=torch.tensor([s.seq.num_output_tokens for s in sampling],
                                 dtype=torch.int64, device=dev),
            draft_probs=draft_probs, top_k=top_k, top_p=top_p, max_num_draft=most)

    def commit(self, scheduled: list[ScheduledSeq], out_ids: list[list[int]],
               num_accepted: list[int]) -> tuple[list[Sequence], int]:
        """Append each sampling row's accepted drafts and next token (b-th sampling row: row
        b of out_ids), roll back the KV of rejected drafts, record the round, check stops."""
        finished, num_tokens, b = [], 0, 0
        # the policy's acceptance estimates serve adaptive lengths and routing only; the
        # step's rounds are counted in them at once (SpecPolicy.record_rounds)
        estimates = self.policy.costs is not None or bool(self.routes)
        rounds: list[tuple] = []
        for s in scheduled:
            seq = s.seq
            if not s.is_sampling:
                self.scheduler.commit(seq, s.num_new_tokens, [])
                continue
            m = num_accepted[b]
            new = out_ids[b][:m + 1]
            b += 1
            if seq.num_output_tokens > 0:  # the first token comes from prefill, not a round
                seq.record_round(s.num_drafts, m, self.source_label.get(s.source))
                if estimates:     # (a round that drafted nothing counts nowhere)
                    if s.num_drafts:
                        rounds.append((seq, s.source, s.num_drafts, m,
                                       s.proposal.classes if s.proposal is not None
                                       else None))
                    if s.unused is not None:
                        rounds.append(self._judge_unused(seq, *s.unused, new))
                if s.proposal is not None and s.proposal.stopped_by_confidence:
                    seq.spec.skipped_by_confidence += 1
                if s.num_drafts:   # (a round that drafted nothing leaves its window as is)
                    self.policy.update_fallback(seq)
            new, reason = self._check_stop(seq, new)
            self.scheduler.commit(seq, s.num_new_tokens + m, new)
            num_tokens += len(new)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if rounds:
            self.policy.record_rounds(rounds)
        return finished, num_tokens

    @staticmethod
    def _judge_unused(seq: Sequence, lookup: str, proposal: Proposal,
                      new: list[int]) -> tuple:
        """The round to count in the lookup's estimates (SpecPolicy.record_rounds) for the
        lookup drafts a routed row did not take, as if verified: each draft, after drafts
        that matched, is judged accepted when it is the token the row committed there. A
        lookup's draft is one token (q one-hot), accepted with the target's probability of
        it, and the committed token is a draw of the target's distribution (exact sampling,
        over the model's own draws): the same chance, at any temperature. Drafts past the
        committed tokens are not judged. Without this, routing learned a source's acceptance
        only from rounds that took it: a code job's first eight suffix rounds (all rejected,
        one-token matches) priced every later suffix draft at 0.19, the lookup was never
        taken again, and routed rows at 8 rows made 1.26 tokens a pass where suffix drafts
        alone made 2.66."""
        drafts = proposal.token_ids[:len(new)]
        matched = 0
        while matched < len(drafts) and drafts[matched] == new[matched]:
            matched += 1
        return seq, lookup, len(drafts), matched, proposal.classes

    def _check_stop(self, seq: Sequence, new: list[int]) -> tuple[list[int], str | None]:
        """Cut `new` at the first stop condition; returns (tokens to append, reason)."""
        p = seq.params
        for i, t in enumerate(new):
            n_out = seq.num_output_tokens + i + 1
            if (t in self.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids:
                return new[:i + 1], "stop"
            if p.stop and self.tokenizer is not None and self._hit_stop_string(seq, new[:i + 1]):
                return new[:i + 1], "stop"
            if n_out >= p.max_tokens or len(seq) + i + 1 >= self.max_model_len:
                return new[:i + 1], "length"
        return new, None

    def _hit_stop_string(self, seq: Sequence, new: list[int]) -> bool:
        """Whether the newest token completes a stop string. Only the output's tail is
        decoded for the check (a token holds at least one byte, a character at most four),
        so the cost per token does not grow with the output; the whole text is decoded once,
        on a hit, to find where to cut it."""
        stops = seq.params.stop
        width = 4 * max(map(len, stops)) + 4
        start = max(seq.num_prompt_tokens, len(seq.token_ids) - width)
        tail = self.tokenizer.decode((seq.token_ids[start:] + new)[-width:],
                                     skip_special_tokens=True)
        if not any(s in tail for s in stops):
            return False
        text = self.tokenizer.decode(seq.output_token_ids + new, skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            seq.stop_text_len = min(hits)
            return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.finish_time = time.perf_counter()
        if seq.spec.draft is not None:
            self.proposers[seq.spec.draft].finish(seq, reason != "abort")
            if seq.spec.draft in self.routes:
                self.proposers[self.routes[seq.spec.draft]].finish(seq, reason != "abort")
