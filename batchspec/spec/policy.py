"""Speculation policy: which draft serves a request (by domain), how many tokens it may
draft this round (k, capped by max_tokens and the context; with adaptive_k, each row's length
from the draft slots, across all rows, that maximise the step's expected tokens per second),
and when a request stops speculating (rolling acceptance below min_acceptance, or sampled
hotter than max_spec_temperature)."""
from __future__ import annotations

import bisect
import functools
import logging
import math
import os
from dataclasses import dataclass, field

from batchspec.config import EngineConfig
from batchspec.engine.sequence import Sequence

log = logging.getLogger(__name__)

# Prior on a source's per-depth acceptance probability before its first rounds (p = 0.6
# worth 10 rounds), and the weights (in rounds) of the source's pooled estimate in its
# domain's, of the domain's in the domain's at the row's band of output positions, and of
# that in a request's own.
PRIOR_P, PRIOR_ROUNDS, DOMAIN_PRIOR_ROUNDS, BAND_PRIOR_ROUNDS, REQUEST_PRIOR_ROUNDS = \
    0.6, 10, 10, 10, 4
# Acceptance drifts along a request's output: the demo's code and prose drafts had their
# first token accepted 0.76 of the time in a row's first 16 output tokens, 0.88 in the next
# 16 and 0.94 after 32 (T = 0, 8 rows; benchmarks/estimate_calibration.py). Pooled
# estimates are also kept per band of output positions (position_band: 0-15, 16-31, 32-63,
# ... up to MAX_POSITION_BAND), and a request's own counts decay by REQUEST_DECAY at each of
# its rounds, so that its estimate follows its recent rounds. With counts over all its
# rounds, a request's estimates lagged behind its acceptance: at 8 rows and T = 0 they
# predicted 0.83 for a first draft accepted 0.87 of the time (0.56 for a fourth, 0.62):
# plans weighed every slot as less likely to hold than it was.
REQUEST_DECAY, MAX_POSITION_BAND = 0.7, 8
MAX_P = 0.98
# Now and then a choice takes the other side (plain when the best plan speculates, the best
# speculating plan when it is plain), so that both sides' corrections come from steps of
# their own: a side never tried would keep the start-up model's bias between them (e.g.
# verification costs it leaves out). The first try comes EXPLORE steps after a side takes
# the lead, and the gap doubles with each try that does not change the lead, up to
# MAX_EXPLORE: a side that keeps losing costs ever fewer steps. A side whose corrected rate
# is below TRY_MARGIN of the leader's is tried only every FAR_EXPLORE steps (at 32 rows and
# T = 0.8, where speculation loses, plans judged on their measured excess came to 0.71-0.95
# of plain, and with a margin of 0.8 tries every 80 steps cost about 1.5% of a run that
# stays plain; where speculation pays, T = 0, they come above 1). A try runs
# TRY_STEPS measured steps (one step's time is noisy on a shared machine), and more, up to
# MAX_TRY_STEPS, until they add up to TRY_MIN_S (three steps of 2.5 ms at 8 rows told
# sides 5% apart from each other by chance), unless a try of plain measures it below
# TRY_MARGIN of speculation's pace by then (_plain_far_behind); one more runs first,
# unmeasured (see choose_lengths).
EXPLORE, MAX_EXPLORE, FAR_EXPLORE, TRY_MARGIN, TRY_STEPS = 10, 80, 400, 0.9, 3
TRY_MIN_S, MAX_TRY_STEPS = 0.03, 12
# The first plain steps after a speculating one run slower than plain steps do: at 32 rows and
# T = 0.8, 3.6, 3.6, 3.3, 3.1, 3.0 and 2.9 ms for the first six against 2.7 from the seventh on
# (in the bench's turns; the speculating step's working set, the draft's weights and the
# windows' logits, has pushed the plain step's out of the core's caches). The first
# PLAIN_COLD_STEPS are not measured: a try of plain at 32 rows measures about ten steps, and
# from its second step on it found plain about 8% slower than it runs, which held leads of
# speculation that lost.
PLAIN_COLD_STEPS = 3
# Tries are also held to a budget: what they cost beyond the leading side's measured time
# for the same tokens, summed, stays within this share of all measured steps' time (a try's
# first step, with the drafts' catch-up, included). At 32 rows and T = 0.8 a try of
# speculation cost about 4.5 plain steps, and tries every 80 steps cost 5% of a run. A try
# of plain close behind a lead of speculation (within TRY_MARGIN) is not held to it: such a
# try costs little or gains, and is what ends a wrong lead. With the budget spent by tries of
# speculation, leads it took at 32 rows and T = 0.8 (0.94-0.96x plain) held for whole jobs.
# Nor is a try of a side that the weighing judges ahead of the leader (`ahead`: it is tried
# at once): with the budget spent by tries of suffix drafts over a templated job's first rows,
# which found little to draft, the try that would hand speculation the lead once the job-wide
# trie had filled waited, and `suffix-adaptive` made 1.10x plain where it makes 1.6-1.7x.
# Half a percent, not 1%: beside a plain engine at 64 rows and T = 0.8, where speculation
# loses, tries of speculation cost 0.6-1.7% of a run with 1% (benchmarks/policy_losses.py),
# and the policy made 0.969x plain against 0.939x (benchmarks/policy_ab.py, medians of five
# rounds; 32 rows 0.962 against 0.955; 8 rows, T = 0.8, where speculation leads, 1.155
# against 1.166; 32 rows, T = 0, 1.248 against 1.255).
EXPLORE_BUDGET = 0.005
# While plain leads, a try of speculation drafts only for rows whose drafts are least behind,
# up to this many catch-up tokens per batch row in all (see SpecPolicy._behind), except the
# first try of a mix of temperatures and band of batch sizes, which drafts for every row.
CATCH_UP_PER_ROW = 4
# Speculation takes the lead from plain only once its corrected rate beats plain's by this
# factor (plain takes it back as soon as it is ahead). Judged on its measured excess (a few
# steps of a try), its rate against plain's spread over 0.72-1.11 within a job at 8 rows and
# T = 0.8, where it loses, and over 0.79-1.29 at 64 rows and T = 0, where a fixed k made
# 1.04-1.09x: with a margin of 1.05 its leads there lost 1-6% against plain's; with 1.1, they
# were rarer and cost 0.8% at 64 rows, and 8 rows at T = 0.8 no longer lost.
SWITCH_MARGIN = 1.1
# The prompt row timed at start-up (StepCosts.prompt_token_s); steps that run more prompt
# tokens than twice this are not measured (attention grows with the prompt's square).
PROMPT_TIMED = 64
# Mixes of temperatures and batch-size bands whose measurements are kept besides the current
# one (_use_mix): a worker serving jobs of many temperatures holds a bounded state.
MAX_MIXES = 64
# A model draft's measured time against what the start-up costs predict for the levels it
# ran (SpecPolicy.observe_draft): the draft's row in routing (prefer_lookup) is scaled by
# the ratio of the averages once DRAFT_TIMED_MIN calls are timed; averages over the first
# 1/DRAFT_WEIGHT calls, EMAs after. (Plans price a draft slot unscaled: see _plan.)
DRAFT_TIMED_MIN, DRAFT_WEIGHT = 3, 0.1
# A source may put each draft in a class by its own evidence (suffix drafts: the token's
# share of its trie's continuations and the match length, suffix.evidence_class); each
# class's acceptance, per source and temperature, is shrunk towards the slot's depth
# estimate with the weight of CLASS_PRIOR_ROUNDS rounds.
CLASS_PRIOR_ROUNDS = 10
# Plans and predictions price a step at its rows' mean context to this many tokens
# (StepCosts.at), and a StepCosts keeps the costs of at most MAX_CONTEXTS contexts.
CONTEXT_STEP, MAX_CONTEXTS = 16, 256


@dataclass
class StepCosts:
    """Measured seconds of one target forward over B rows of q tokens each (q = 1..k+1), and
    of one forward of each draft over B rows of one token, at a grid of batch sizes and a
    context of `context` tokens a row; linear in B between grid points (and beyond the last,
    from the last two); what a row's context token adds to each, below the context timed and
    above it (target_ctx, draft_ctx: at(ctx) gives the costs at another context); and what
    a prompt token adds to a target forward (a row of PROMPT_TIMED prompt tokens beside the
    largest batch timed, against that batch alone; a prompt row needs its last position's
    logits only)."""
    batch_sizes: list[int]
    target: dict[int, list[float]] = field(default_factory=dict)   # q -> seconds per B
    draft: dict[str, list[float]] = field(default_factory=dict)    # draft -> seconds per B
    prompt_token_s: float = 0.0
    # the context the shapes were timed at, and the seconds a row's context token adds to a
    # forward (attention reads it), below that context and above it: the target's per q,
    # each draft's
    context: int = 0
    target_ctx: dict[int, tuple[float, float]] = field(default_factory=dict)
    draft_ctx: dict[str, tuple[float, float]] = field(default_factory=dict)
    # what a drafted token adds at T > 0 beyond the greedy forwards: to verification (the
    # drafts' q gathered, the target's distribution at the slot, the ratio test), and to a
    # model draft's step (its draw from q, a softmax over the vocabulary kept for
    # verification): Engine._sampling_runs
    verify_token_s: float = 0.0
    draft_sample_s: dict[str, float] = field(default_factory=dict)
    # derived tables, filled on first use (the timings do not change after smooth())
    _per_q: dict = field(default_factory=dict, repr=False)
    _windows: dict = field(default_factory=dict, repr=False)
    _marginal: dict = field(default_factory=dict, repr=False)
    _contexts: dict = field(default_factory=dict, repr=False)

    def at(self, ctx: float) -> StepCosts:
        """These costs at a mean context of ctx tokens a row (to CONTEXT_STEP tokens): each
        shape's time plus, per row, what its context tokens beyond (or short of) the timed
        context add (or take off), at least half the time timed. Attention grows with the
        context, a window's q tokens' most: on the demo at 64 rows a 5-token window took
        34.4 ms at a context of 512 where the costs timed at 128 said 24.1, and 22.1 ms at
        64 against 26.1 at 128. Without the slopes (costs timed at one context), the costs
        themselves."""
        if not (self.target_ctx or self.draft_ctx):
            return self
        c = int(ctx + CONTEXT_STEP / 2) // CONTEXT_STEP * CONTEXT_STEP
        view = self._contexts.get(c)
        if view is None:
            if len(self._contexts) >= MAX_CONTEXTS:
                self._contexts.clear()
            d = c - self.context

            def shifted(values: list[float], slopes: tuple[float, float]) -> list[float]:
                per_token = slopes[d > 0]
                return [max(t + b * d * per_token, 0.5 * t)
                        for t, b in zip(values, self.batch_sizes)]
            view = self._contexts[c] = StepCosts(
                self.batch_sizes,
                target={q: shifted(v, self.target_ctx.get(q, (0.0, 0.0)))
                        for q, v in self.target.items()},
                draft={n: shifted(v, self.draft_ctx.get(n, (0.0, 0.0)))
                       for n, v in self.draft.items()},
                prompt_token_s=self.prompt_token_s, context=c,
                verify_token_s=self.verify_token_s, draft_sample_s=self.draft_sample_s)
        return view

    def _at(self, values: list[float], b: int) -> float:
        xs = self.batch_sizes
        if len(xs) == 1:
            return values[0] * b / xs[0]
        i = min(max(bisect.bisect_left(xs, b), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], values[i - 1], values[i]
        return max(0.0, y0 + (y1 - y0) * (b - x0) / (x1 - x0))

    def target_s(self, b: int, q: int) -> float:
        return self._at(self.target[q], b) if b > 0 else 0.0

    def decode_s(self, b: int) -> float:
        """target_s(b, 1), from the table kept per batch size (a plain step's prediction,
        every plain step)."""
        return self._target_at(b)[1]

    def smooth(self) -> None:
        """Measured timings are noisy (a shared machine, one timing per shape): at each batch
        size, replace the target's times by their least-squares line in q (slope at least 0:
        more tokens never cost less), which also fills the q = 1..k+1 not timed, then make
        every shape's times non-decreasing in B."""
        qs = sorted(self.target)
        if len(qs) > 1:
            q_mean = sum(qs) / len(qs)
            n = len(self.batch_sizes)
            line = {q: [0.0] * n for q in range(1, qs[-1] + 1)}
            for i in range(n):
                ts = [self.target[q][i] for q in qs]
                t_mean = sum(ts) / len(ts)
                slope = max(0.0, sum((q - q_mean) * (t - t_mean) for q, t in zip(qs, ts)) /
                            sum((q - q_mean) ** 2 for q in qs))
                for q in line:
                    line[q][i] = t_mean + slope * (q - q_mean)
            self.target = line
            if len(self.target_ctx) > 1:   # what a context token adds: lines in q too
                ks = sorted(self.target_ctx)
                k_mean = sum(ks) / len(ks)
                sides = []
                for side in (0, 1):
                    cs = [self.target_ctx[q][side] for q in ks]
                    c_mean = sum(cs) / len(cs)
                    slope = sum((q - k_mean) * (c - c_mean) for q, c in zip(ks, cs)) / \
                        sum((q - k_mean) ** 2 for q in ks)
                    sides.append({q: max(0.0, c_mean + slope * (q - k_mean)) for q in line})
                self.target_ctx = {q: (sides[0][q], sides[1][q]) for q in line}
        for values in (*self.target.values(), *self.draft.values()):
            for i in range(1, len(values)):
                values[i] = max(values[i], values[i - 1])

    def _target_at(self, b: int) -> list[float]:
        """The target's time at B = b for q = 0 (unused), 1 .. k+1."""
        t = self._per_q.get(b)
        if t is None:
            t = self._per_q[b] = [0.0] + [self.target_s(b, q)
                                          for q in range(1, max(self.target) + 1)]
        return t

    def verified_token_s(self, b: int) -> float:
        """What one more verified token adds to a target forward over b rows: the slope of
        the target's time in q from q = 1 to k+1 (a line after smooth()), per row."""
        t = self._target_at(b)
        return (t[-1] - t[1]) / (b * (len(t) - 2)) if len(t) > 2 else 0.0

    def draft_row_s(self, name: str, b: int) -> float:
        """A row's share of a forward of draft `name` over b rows."""
        return self.draft_s(name, b) / b if b > 0 else 0.0

    def target_tokens_s(self, b: int, num_tokens: int) -> float:
        """Target forward over b rows holding num_tokens tokens in all (ragged windows):
        interpolated between the uniform shapes of q = floor and ceil of the mean (at most
        k + 1 a row; fewer than one a row count as one)."""
        if b <= 0:
            return 0.0
        w = self.windows_s(b)
        return w[min(max(num_tokens - b, 0), len(w) - 1)]

    def windows_s(self, b: int) -> list[float]:
        """[n] = target_tokens_s(b, b + n) for n = 0 .. k * b: what a plan of n slots over b
        rows costs the target (SpecPolicy._plan reads it slot by slot)."""
        w = self._windows.get(b)
        if w is None:
            t = self._target_at(b)
            q_max = len(t) - 1
            w = []
            for n in range(b, q_max * b + 1):
                q = min(n / b, float(q_max))
                lo = int(q)
                w.append(t[lo] + (q - lo) * (t[min(lo + 1, q_max)] - t[lo]))
            self._windows[b] = w
        return w

    def draft_list(self, name: str, num_rows: int) -> list[float]:
        """[c] = draft_s(name, c) for c = 0 .. num_rows."""
        key = (name, num_rows, "s")
        m = self._marginal.get(key)
        if m is None:
            m = self._marginal[key] = [self.draft_s(name, c) for c in range(num_rows + 1)]
        return m

    def draft_marginal_list(self, name: str, num_rows: int) -> list[float]:
        """[c] = the cost of one more row in a forward of draft `name` over c rows, for
        c < num_rows (what SpecPolicy._plan sums)."""
        key = (name, num_rows, "marginal")
        m = self._marginal.get(key)
        if m is None:
            s = self.draft_list(name, num_rows)
            m = self._marginal[key] = [b - a for a, b in zip(s, s[1:])]
        return m

    def draft_s(self, name: str, b: int) -> float:
        return self._at(self.draft[name], b) if b > 0 and name in self.draft else 0.0


_UNSET = object()


@functools.cache
def _native_core():
    """kernels/policy_core.cpp's functions (in the CPU kernels' module), or None where the
    kernels do not build (looked up once)."""
    try:
        from batchspec.spec._build import cpu_module
        return cpu_module()
    except Exception as e:  # noqa: BLE001 - no compiler: the Python arithmetic
        log.warning("C++ policy arithmetic unavailable (%s); using the Python one", e)
        return None


def native_core():
    """The C++ arithmetic of the policy's per-row work (depth_probs over a step's rows, the
    plan, counting rounds), unless BATCHSPEC_POLICY_NATIVE=0 asks for the Python one, the
    reference it is tested against."""
    return _native_core() if os.environ.get("BATCHSPEC_POLICY_NATIVE", "1") != "0" else None


def mean_context(seqs: list[Sequence]) -> float:
    """The mean context of rows (tokens a row's attention reads), at which a step's costs
    are priced (StepCosts.at)."""
    return sum([len(seq.token_ids) for seq in seqs]) / len(seqs) if seqs else 0.0


def temperature_bucket(seq: Sequence) -> float:
    """The temperature that estimates and measurements are kept per: seq's, to 0.1
    (acceptance falls steeply with it)."""
    return bucket_of(seq.params.temperature)


def bucket_of(temperature: float) -> float:
    """A temperature's bucket (temperature_bucket)."""
    return round(temperature, 1)


def position_band(num_output_tokens: int, most: int | None = None) -> int:
    """The band of output positions of a round that starts after num_output_tokens output
    tokens, whose pooled acceptance estimates a row reads and counts in: 0 for a row's first
    16 output tokens, then one band per doubling (16-31, 32-63, ...), up to `most`
    (MAX_POSITION_BAND when None; with 0, no pool per band is kept or read)."""
    most = MAX_POSITION_BAND if most is None else most
    return min(max(0, num_output_tokens.bit_length() - 4), most)


def batch_band(num_rows: int) -> int:
    """The band of batch sizes the policy keeps measurements and a lead per: log2 of the
    rows, rounded (1; 2; 3-5; 6-11; 12-22; 23-45; 46-90; ...), so that a full batch of a
    power of two, give or take the rows that finish and join, stays in one."""
    return round(math.log2(max(num_rows, 1)))


class SpecPolicy:
    def __init__(self, config: EngineConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.costs: StepCosts | None = None        # set by the engine when adaptive_k
        # (source, temperature) or (source, temperature, domain) -> (accepted, judged) per
        # depth (_pool_keys)
        self.pooled: dict[tuple, tuple[list[int], list[int]]] = {}
        # (source, temperature) -> {class: [accepted, judged]} of drafts the source classed
        self.by_class: dict[tuple, dict[int, list[int]]] = {}
        # speculating? -> averages over its recent measured steps of [predicted tokens,
        # predicted seconds, tokens, seconds]; steps observed
        self.measured: dict[bool, list[float]] = {}
        self.observed: dict[bool, int] = {}
        self._winner: bool | None = None        # the side the corrections prefer
        self._interval, self._since = EXPLORE, 0  # steps between tries of the other side
        self._try_left = 0                  # steps of a try of the other side still to run
        self._far = False                   # the side behind was far behind when last weighed
        self._far_gap = EXPLORE             # steps between weighings of lookup rows while
        #                                     plain leads and speculation is far behind
        self._tried_in_full = False         # a try of speculation has drafted for every row
        self._speculated = False            # whether the last step speculated
        self.plain_cold_steps = PLAIN_COLD_STEPS
        self._cold = 0                      # plain steps still to leave unmeasured after the
        #                                     last speculating step
        self._trying = False                # whether this step is part of a try
        self._try_measured = 0              # measured steps of the try on (or the last)
        self._try_s = 0.0                   # and their seconds
        self._fresh = False                 # a try has just measured all its steps
        # a lead of speculation not yet confirmed by a try of plain: its steps' [seconds,
        # tokens]; and the try interval the side behind had before the last change (_switch)
        self._unconfirmed: list[float] | None = None
        self._interval_before = EXPLORE
        # seconds tries cost beyond the leader's time for their tokens; seconds measured
        self._explore_s, self._busy_s = 0.0, 0.0
        # this step's (speculates, predicted tokens, predicted seconds, a try of the side
        # that does not lead)
        self._chosen: tuple[bool, float, float, bool] | None = None
        # The measurements and the lead above are those of the batch's current mix of
        # temperatures and band of batch sizes; each seen keeps its own (_use_mix).
        self._mix: tuple | None = None
        self._band: int | None = None
        self._mixes: dict[tuple, tuple] = {}
        # model draft -> averages of [predicted, measured] seconds of its timed calls, and
        # calls timed (observe_draft), for the current mix; this step's predictions
        self._draft_timed: dict[str, list[float]] = {}
        self._draft_pred: dict[str, float] = {}
        # this step's drafts' catch-up beyond a level, in all and per draft (observe_catch_up)
        self._catch_up_s, self._catch_up = 0.0, {}
        self._native = _UNSET       # (native: looked up at first use)

    @property
    def native(self):
        """The C++ arithmetic of rows' estimates, plans and counting (native_core), or None
        for the Python; looked up at first use, so that an engine that never weighs plans
        nor counts rounds (a fixed k without routing, plain decoding) does not load it."""
        if self._native is _UNSET:
            self._native = native_core()
        return self._native

    @native.setter
    def native(self, value) -> None:
        self._native = value

    def draft_for(self, domain: str | None, temperature: float) -> str | None:
        """Name of the draft serving a request: its domain's, else `default`, else None."""
        c = self.config
        if not c.speculative:
            return None
        if c.max_spec_temperature is not None and temperature > c.max_spec_temperature:
            return None
        if domain is not None and domain in c.drafts:
            return domain
        return "default" if "default" in c.drafts else None

    def lookahead(self, seq: Sequence) -> int:
        """Draft tokens seq may verify this round; never lets it pass max_tokens/context."""
        if seq.spec.draft is None or seq.spec.fallback_triggered:
            return 0
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def update_fallback(self, seq: Sequence) -> None:
        """Production rule: once enough drafts are judged, a request whose rolling acceptance
        over the last `fallback_window` drafted tokens is below min_acceptance decodes
        plainly from then on."""
        c = self.config
        if seq.spec.draft is None or seq.spec.fallback_triggered:
            return
        drafted, accepted = seq.rolling_acceptance(c.fallback_window)
        if drafted >= c.fallback_min_drafted and accepted < c.min_acceptance * drafted:
            seq.spec.fallback_triggered = True

    # ---- adaptive verification: per-slot draft lengths by expected goodput ----------------
    def record(self, seq: Sequence, source: str | None, num_drafted: int,
               num_accepted: int, classes: list[int] | None = None) -> None:
        """Count a round's per-depth outcome in the request's own estimates for its source
        (on its SpecState; its earlier rounds' counts decay by REQUEST_DECAY first) and in
        the source's pooled ones (overall, for the domain and for the domain at the row's
        band of output positions, at the request's temperature); drafts the source classed
        (classes: one per draft) also count in their classes."""
        if not num_drafted or source is None:
            return
        own = seq.spec.source_depth.setdefault(source, ([], []))
        own_acc, own_judged = own
        for d in range(len(own_judged)):      # older rounds weigh less (REQUEST_DECAY)
            own_acc[d] *= REQUEST_DECAY
            own_judged[d] *= REQUEST_DECAY
        src, dom = self._pool_keys(seq, source)
        if classes is not None:
            self._count_classes(src, classes, num_drafted, num_accepted)
        pools = [own, self.pooled.setdefault(src, ([], [])),
                 self.pooled.setdefault(dom, ([], []))]
        if MAX_POSITION_BAND:
            pools.append(self.pooled.setdefault(
                dom + (position_band(seq.num_output_tokens),), ([], [])))
        for acc, judged in pools:
            while len(judged) < num_drafted:
                acc.append(0)
                judged.append(0)
            for d in range(min(num_drafted, num_accepted + 1)):
                judged[d] += 1
                acc[d] += d < num_accepted

    def record_rounds(self, rounds: list[tuple[Sequence, str | None, int, int,
                                                list[int] | None]]) -> None:
        """record() for a step's rounds, each (seq, source, num_drafted, num_accepted,
        classes), with the counting in C++ (self.native) where it builds: at 64 rows
        record() took 0.23 ms of a 12 ms step."""
        native = self.native
        if native is None:
            for r in rounds:
                self.record(*r)
            return
        counted = []
        for seq, source, num_drafted, num_accepted, classes in rounds:
            if not num_drafted or source is None:
                continue
            src, dom = self._pool_keys(seq, source)
            if classes is not None:
                self._count_classes(src, classes, num_drafted, num_accepted)
            own = seq.spec.source_depth.get(source)
            if own is None:
                own = seq.spec.source_depth[source] = ([], [])
            counted.append((own, src, dom, seq.num_output_tokens, num_drafted, num_accepted))
        native.record_rows(self.pooled, counted, REQUEST_DECAY, MAX_POSITION_BAND)

    def _count_classes(self, src: tuple, classes: list[int], num_drafted: int,
                       num_accepted: int) -> None:
        """Count a round's judged drafts in their classes (record)."""
        counts = self.by_class.setdefault(src, {})
        for d in range(min(num_drafted, num_accepted + 1, len(classes))):
            c = counts.setdefault(classes[d], [0, 0])
            c[0] += d < num_accepted
            c[1] += 1

    @staticmethod
    def _pool_keys(seq: Sequence, source: str) -> tuple[tuple, tuple]:
        """Keys of the source's pooled estimates that seq counts in and reads: over all
        domains and for seq's domain, both at seq's temperature (to 0.1; acceptance falls
        steeply with it, so rows sampled at another temperature say little)."""
        cached = seq.spec.pool_keys.get(source)
        if cached is not None and cached[0] is seq.params and cached[1] == seq.domain:
            return cached[2]
        t = temperature_bucket(seq)
        keys = (source, t), (source, t, seq.domain)
        seq.spec.pool_keys[source] = (seq.params, seq.domain, keys)
        return keys

    def depth_probs(self, seq: Sequence, source: str, n: int,
                    classes: list[int] | None = None) -> list[float]:
        """Estimated probability that seq's draft at depth d (d < n) from `source` is accepted
        given that every draft before it was: the request's own counts at that depth (older
        rounds weighing less, REQUEST_DECAY), shrunk towards the source's pooled estimate for
        the request's domain at the row's band of output positions (position_band; at its
        temperature, as all pooled estimates), shrunk towards the domain's over all
        positions, shrunk towards the source's estimate over all domains, shrunk towards
        the estimate one depth shallower (PRIOR_P at depth 0). A draft the source classed by
        its own evidence (classes: one per draft) takes its class's acceptance instead,
        shrunk towards the depth's estimate (a suffix draft continuing a long, unanimous
        match is far likelier to hold than one after a single token). Estimates are capped
        at 0.98 (no slot is certain)."""
        out = self._depth_probs(seq, source, n)
        if classes is not None:
            self._class_probs(out, seq, source, classes)
        return out

    def rows_probs(self, rows: list[tuple[Sequence, str, int, bool]],
                   classes: list[list[int] | None] | None = None) -> list[list[float]]:
        """depth_probs of each row (seq, source, n, _), classes[i] row i's; over all rows
        in one C++ call (self.native) where it builds."""
        native = self.native
        if native is None:
            return [self.depth_probs(seq, source, n, classes[i] if classes is not None
                                     else None)
                    for i, (seq, source, n, _) in enumerate(rows)]
        keyed = []
        for seq, source, n, _ in rows:
            src, dom = self._pool_keys(seq, source)
            keyed.append((seq.spec.source_depth.get(source), src, dom, seq.num_output_tokens,
                          n))
        probs = native.depth_probs_rows(self.pooled, keyed, (
            PRIOR_P, PRIOR_ROUNDS, DOMAIN_PRIOR_ROUNDS, BAND_PRIOR_ROUNDS,
            REQUEST_PRIOR_ROUNDS, MAX_P), MAX_POSITION_BAND)
        if classes is not None:
            for (seq, source, _, _), row_probs, row_classes in zip(rows, probs, classes):
                if row_classes is not None:
                    self._class_probs(row_probs, seq, source, row_classes)
        return probs

    def _class_probs(self, out: list[float], seq: Sequence, source: str,
                     classes: list[int]) -> None:
        """A row's depth estimates (out, changed in place) for drafts its source classed."""
        src_key, _ = self._pool_keys(seq, source)
        counts = self.by_class.get(src_key, {})
        for d in range(min(len(out), len(classes))):
            acc, judged = counts.get(classes[d], (0, 0))
            out[d] = min((acc + CLASS_PRIOR_ROUNDS * out[d]) / (judged + CLASS_PRIOR_ROUNDS),
                         MAX_P)

    def _depth_probs(self, seq: Sequence, source: str, n: int) -> list[float]:
        src_key, dom_key = self._pool_keys(seq, source)
        src_acc, src_judged = self.pooled.get(src_key, ((), ()))
        dom_acc, dom_judged = self.pooled.get(dom_key, ((), ()))
        band_acc, band_judged = self.pooled.get(
            dom_key + (position_band(seq.num_output_tokens),), ((), ())) \
            if MAX_POSITION_BAND else ((), ())
        own_acc, own_judged = seq.spec.source_depth.get(source, ((), ()))
        # (unrolled: this runs for every row at every weighing; 6 against 8 us a row)
        n_src, n_dom, n_band, n_own = len(src_judged), len(dom_judged), len(band_judged), \
            len(own_judged)
        out, p = [], PRIOR_P
        for d in range(n):
            if d < n_src:
                p = (src_acc[d] + PRIOR_ROUNDS * p) / (src_judged[d] + PRIOR_ROUNDS)
            if d < n_dom:
                p = (dom_acc[d] + DOMAIN_PRIOR_ROUNDS * p) / (dom_judged[d] + DOMAIN_PRIOR_ROUNDS)
            if d < n_band:
                p = (band_acc[d] + BAND_PRIOR_ROUNDS * p) / (band_judged[d] + BAND_PRIOR_ROUNDS)
            if d < n_own:
                p = (own_acc[d] + REQUEST_PRIOR_ROUNDS * p) / (own_judged[d] + REQUEST_PRIOR_ROUNDS)
            p = min(p, MAX_P)
            out.append(p)
        return out

    def expected_tokens(self, seq: Sequence, source: str, n: int,
                        classes: list[int] | None = None) -> float:
        """Expected tokens of a round in which `source` drafts n tokens for seq: the
        accepted drafts (sum of survival probabilities) and the target's token."""
        tokens, survive = 1.0, 1.0
        for p in self.depth_probs(seq, source, n, classes):
            survive *= p
            tokens += survive
        return tokens

    def prefer_lookup(self, seq: Sequence, model: str, lookup: str, found: int,
                      cost_ratio: float, classes: list[int] | None = None,
                      num_rows: int = 1) -> bool:
        """Routing of a row served by a model draft and a lookup source: whether the drafts
        the lookup found this round (`found` tokens, free to make) promise at least the
        tokens per second of the model's, by the row's estimates for each source (shrunk
        towards its domain's and the source's pooled ones).

        With the measured costs (adaptive_k), each side is weighed at this step's batch size
        (num_rows rows) and the row's context on the row's share of it: a plain step's time
        per row, plus for each draft the model's per-row forward and, for either source, what
        a verified token adds to the target's (the best number of drafts up to what each may draft).
        The model's row is scaled by what its calls have measured against their prediction
        (draft_scale). At 32 rows a window's tokens cost about half a decoded token each, and
        a model's k drafts cost more than a lookup's fewer, free ones: weighed on draft
        passes alone (below), routed rows took the model's drafts at 32 rows, speculation no
        longer paid, and the routed engine ran plain (0.96x plain where suffix drafts alone
        made 1.2x). Without costs: k model drafts cost k * cost_ratio of a target pass, and
        verification nothing. The lookup's estimates learn from every round, its drafts
        judged against what the row commits where the model drafted (Engine._judge_unused)."""
        if not found:
            return False
        k = self.lookahead(seq)
        costs = self.costs
        if costs is None:
            by_model = self.expected_tokens(seq, model, k) / (1.0 + k * cost_ratio)
            return self.expected_tokens(seq, lookup, found, classes) >= by_model
        costs = costs.at(len(seq))
        b = max(num_rows, 1)
        row_s, token_s = costs.target_s(b, 1) / b, costs.verified_token_s(b)
        return self._best_rate(self.depth_probs(seq, lookup, found, classes), row_s,
                               token_s) >= \
            self._best_rate(self.depth_probs(seq, model, k), row_s,
                            token_s + costs.draft_row_s(model, b) * self.draft_scale(model))

    @staticmethod
    def _best_rate(probs: list[float], row_s: float, per_draft_s: float) -> float:
        """A row's most tokens per second over drafting 0 .. len(probs) tokens: its
        expected tokens (1 + the sum of survival probabilities) over row_s + per_draft_s a
        draft."""
        best, tokens, survive = 1.0 / max(row_s, 1e-12), 1.0, 1.0
        for n, p in enumerate(probs, 1):
            survive *= p
            tokens += survive
            best = max(best, tokens / max(row_s + n * per_draft_s, 1e-12))
        return best

    def choose_lengths(self, rows: list[tuple[Sequence, str, int, bool]],
                       num_plain_rows: int,
                       classes: list[list[int] | None] | None = None,
                       lookups: bool = False, mix: tuple | None = None) -> list[int]:
        """Draft lengths for this step's speculating rows, from slots admitted across all rows
        in order of survival probability (the product of the row's per-depth acceptance
        estimates up to the slot). Of the plans that admit 1, 2, ... slots, the best by
        expected tokens per second from the measured costs; it runs if its rate, corrected
        by what speculating steps have measured against their predictions, beats the plain
        step's, corrected by what plain steps have measured (0 slots: the plain step).
        rows: (seq, source, most drafts, source is a model), the most drafts of a lookup
        source being the drafts it has already found; classes: per row, the classes its
        source gave those drafts, or None; lookups, mix: as for plain_step. Rows that do not
        speculate count one token."""
        self._chosen = None
        if self.costs is None:
            return [n for _, _, n, _ in rows]
        num_rows = len(rows) + num_plain_rows
        seqs = [seq for seq, _, _, _ in rows]
        if self.plain_step(seqs, num_rows, lookups, mix):
            return [0] * len(rows)
        costs = self.costs.at(mean_context(seqs))
        plain_s = max(costs.target_tokens_s(num_rows, num_rows), 1e-12)
        plain_rate = num_rows / plain_s
        if not any(n for _, _, n, _ in rows):
            # No row has a draft to verify (lookup rows that found nothing this step): the
            # step runs plain, which says nothing of which side leads. It is measured as a
            # plain step and leaves the lead and the tries as they were; the steps since
            # the last try or change count on (while plain leads, lookups are weighed every
            # EXPLORE steps, not at every step until they find a draft). It used to hand
            # plain the lead: at one row, where lookups find nothing in about half the
            # steps, speculation lost the lead at the first such step and plain then held
            # it, weighing plans every EXPLORE steps only.
            self._since += 1
            self._trying = False
            self._chosen = None if self._cold_step() else (False, num_rows, plain_s, False)
            return [0] * len(rows)
        probs = self.rows_probs(rows, classes)
        extra_s = self._overhead_s()
        full = self._plan(rows, probs, set(), num_rows, extra_s, costs)
        spec_n = full[0]
        spec_c, plain_c = self._corrected_rate(full), plain_rate / self._slowdown(False)
        # speculation takes the lead from plain only when ahead by SWITCH_MARGIN: sides
        # within noise of each other would otherwise trade it back and forth, and each
        # switch to speculation costs the drafts' catch-up. It keeps the lead only while
        # ahead: with the margin both ways, a lead of speculation up to 5% slower than plain
        # could hold to the end of a job (`spec-adaptive` at 32 rows, T = 0, on a CPU where
        # a verified token costs 0.43 of a decoded one, speculated through a bench cell at
        # 3.2 tokens a pass and made 0.962x plain)
        margin = SWITCH_MARGIN if self._winner is False else 1.0
        speculate = spec_n > 0 and spec_c > plain_c * margin
        fresh, self._fresh = self._fresh, False
        if fresh and self._winner is True and not speculate and spec_n and \
                self._speculation_measured_ahead():
            # A try of plain whose steps measured fewer tokens per second than the lead's
            # own steps does not take the lead on this one step's plan: at 8 rows and
            # T = 0.8 (where speculation makes 1.2-1.3x plain) a try of plain ended on a
            # step whose plan, its rows' estimates or its mean context, priced speculation
            # below plain though its steps had measured 4.1 tokens a ms against the try's
            # 3.4, and plain then led for 85 steps of a 250-step job
            speculate = True
        ahead = False      # the side behind looks ahead, but on measurements not fresh
        if speculate != self._winner:
            if self._winner is None or fresh or not spec_n:  # a try has just shown it (or
                # no plan speculates): it leads now, and the side behind is explored soon,
                # unless it has just lost the lead it took at the last change
                self._switch(speculate, fresh)
            else:
                # The side behind was measured in its last try, the leader in every step
                # since: on a machine whose speed drifts (10-30% within seconds on a
                # shared VM) the two were measured at different speeds. It is tried now
                # (EXPLORE steps after the last try or change at the soonest; plain as soon
                # as a lead not yet confirmed has measured itself behind: _lead_measured),
                # and takes the lead only if the try shows it ahead.
                speculate = self._winner
                ahead = not self._try_left and (self._since + 1 >= EXPLORE or
                                                self._lead_measured())
        elif fresh:     # a try has confirmed the lead
            self._unconfirmed = None
        self._since += 1
        # a side far behind is tried only every FAR_EXPLORE steps (each try of speculation
        # also costs the drafts' catch-up); one never measured is not known to be, and one
        # far ahead is tried at once (`ahead`)
        behind_c, lead_c = (plain_c, spec_c) if self._winner else (spec_c, plain_c)
        close = behind_c >= TRY_MARGIN * lead_c or len(self.measured) < 2
        # while lookups feed the rows and plain leads, a side far behind is weighed again
        # after EXPLORE steps, then after twice as many each time it is still far behind, up
        # to MAX_EXPLORE (plain_step)
        self._far_gap = EXPLORE if close or not self._far else \
            min(2 * self._far_gap, MAX_EXPLORE)
        self._far = not close
        if self._try_left and spec_n:    # a try goes on
            speculate = not self._winner
            self._try_left -= 1
        elif spec_n and (ahead or self._since >= (self._interval if close else FAR_EXPLORE)) \
                and (self._may_explore() or ahead or self._winner and close):
            speculate = not speculate
            self._since = 0
            self._interval = min(2 * self._interval, MAX_EXPLORE)
            self._try_left = TRY_STEPS
            self._try_measured, self._try_s = 0, 0.0
        # While plain leads, a try leaves out the rows whose drafts are far behind (not to
        # pay their catch-up for a few steps); the lead is still weighed on the plan over
        # every row (above), which is what speculation makes once it leads and the drafts
        # keep up.
        skip = self._behind(rows, num_rows) \
            if self._winner is False and speculate and self._tried_in_full else set()
        plan = self._plan(rows, probs, skip, num_rows, extra_s, costs) if skip else full
        spec_tokens, spec_s = plan[2:4]
        lengths = plan[7] if speculate else [0] * len(rows)
        # A speculating step right after plain ones also brings the drafts' caches up to
        # date on every token of the plain steps: a cost of switching, not of speculating,
        # so it is not measured (later steps are, a new row's prompt caught up included).
        # Nor is a try's first plain step: it was weighed, scheduled with draft slots and
        # drafted for by lookups, as the try's later steps (plain_step) are not.
        tried = self._trying = speculate != self._winner
        warm_up = speculate != self._speculated and (speculate or tried)
        self._speculated = speculate
        if speculate:
            self._cold = self.plain_cold_steps
        cold = not speculate and self._cold_step()
        self._chosen = None if warm_up or cold else (True, spec_tokens, spec_s, tried) \
            if speculate else (False, num_rows, plain_s, tried)
        self._draft_pred = self._levels_s(rows, lengths, costs) \
            if speculate and not warm_up else {}
        return lengths

    def _levels_s(self, rows: list[tuple[Sequence, str, int, bool]],
                  lengths: list[int], costs: StepCosts | None = None) -> dict[str, float]:
        """Each model draft's predicted seconds for these lengths by the start-up costs (at
        the step's context: costs): a forward per depth over the rows drafting that deep."""
        costs = costs or self.costs
        by_source: dict[str, list[int]] = {}
        for (_, src, _, is_model), n in zip(rows, lengths):
            if is_model and n:
                by_source.setdefault(src, []).append(n)
        pred: dict[str, float] = {}
        for src, ns in by_source.items():
            table = costs.draft_list(src, len(rows))
            ns.sort(reverse=True)
            total, c = 0.0, len(ns)
            for d in range(ns[0]):          # rows drafting at depth d: those longer than d
                while ns[c - 1] <= d:
                    c -= 1
                total += table[c]
            pred[src] = total
        return pred

    def observe_catch_up(self, name: str, seconds: float, num_rows: int) -> None:
        """Model draft `name`'s call this step began with a forward that caught num_rows rows'
        drafts up on more than a few tokens each (a new row's prompt, a row drafted for
        again after plain steps), in `seconds`. What it took beyond a level's forward over
        those rows is left out of the call's time (observe_draft) and, in a try of
        speculation, of the step's (observe): it is a cost of switching, which the try's
        budget pays, not of the steps speculation runs once it leads, where a row catches up
        on a prompt once. At 32 rows, T = 0, tries drafted for the 1-3 rows least behind,
        often new rows reading their prompts, and measured speculating steps at 1.6-2.3x
        their predicted seconds where steps of speculation's full plans measured 1.16x."""
        extra = max(0.0, seconds - self.costs.draft_s(name, num_rows) * self.draft_scale(name))
        self._catch_up[name] = self._catch_up.get(name, 0.0) + extra
        self._catch_up_s += extra

    def observe_draft(self, name: str, seconds: float) -> None:
        """Fold the measured seconds of model draft `name`'s call this step (the lengths
        choose_lengths chose; not a try's first step nor a lead's, which bring the draft up to
        date on the plain steps before) into its averages against their prediction
        (_levels_s). The call also brings the draft's cache up to date on its rows' tokens it
        has not seen (a new row's prompt, a routed row's lookup rounds) and runs Python and
        sampling per depth, which the start-up costs (a forward of one token per row) leave
        out: at 8 rows a routed engine's code draft took 5.6 ms a step where its levels were
        priced at 3.6 ms, and routed rows chose it over suffix drafts that made more tokens
        per second. A call more than 10x off its prediction is left out; after
        DRAFT_TIMED_MIN calls, one counts at most twice (or half) the usual ratio."""
        seconds -= self._catch_up.pop(name, 0.0)
        pred = self._draft_pred.pop(name, None)
        if not pred or not 0.0 < seconds < 10.0 or not 0.1 <= seconds / pred <= 10.0:
            return
        m = self._draft_timed.get(name)
        if m is None:
            self._draft_timed[name] = [pred, seconds, 1]
            return
        if m[2] >= DRAFT_TIMED_MIN:
            usual = m[1] / m[0] * pred
            seconds = min(max(seconds, usual / 2), usual * 2)
        m[2] += 1
        w = max(DRAFT_WEIGHT, 1 / m[2])
        m[0] += w * (pred - m[0])
        m[1] += w * (seconds - m[1])

    def draft_scale(self, name: str) -> float:
        """Measured / predicted seconds of model draft `name`'s calls (observe_draft), 1
        before DRAFT_TIMED_MIN are timed."""
        m = self._draft_timed.get(name)
        return m[1] / m[0] if m is not None and m[2] >= DRAFT_TIMED_MIN else 1.0

    @staticmethod
    def mix_of(seqs: list[Sequence]) -> tuple:
        """The mix of temperatures (each rounded to 0.1, as temperature_bucket) of rows that
        may speculate. (Each distinct temperature rounded once: a call per row took 40 µs at
        32 rows, every time a batch's rows change, nearly every other step.)"""
        return tuple(sorted({bucket_of(t) for t in {seq.params.temperature for seq in seqs}}))

    def plain_step(self, seqs: list[Sequence], num_rows: int, lookups: bool = False,
                   mix: tuple | None = None) -> bool:
        """Whether this step of num_rows rows (seqs: those that may speculate) runs plain
        without weighing plans: plain leads for the rows' mix of temperatures and no try of
        speculation is due. The engine asks before any source drafts, so that such a step
        costs what a plain engine's does. Plans are weighed every EXPLORE steps where rows
        draft from lookups (`lookups`: what they find changes with the text, and a job-wide
        trie fills as rows finish, so speculation may take the lead without a try); while
        weighings find speculation far behind, after a gap that doubles with each, from
        EXPLORE to MAX_EXPLORE steps (at 32 rows and T = 0.8, suffix drafts' weighings every
        EXPLORE steps took 2.2 ms more than a plain step each, 3.7% of a run that stays
        plain; going straight to MAX_EXPLORE, a weighing over the new rows of a job's first
        steps, which lookups have little text to draft from yet, found speculation far
        behind and the job ran plain for its next 80 steps where suffix drafts made 1.2x);
        else
        only when a try may be due (at the try interval, or FAR_EXPLORE steps when
        speculation was far behind at the last weighing; then every EXPLORE steps until one
        starts) and every MAX_EXPLORE steps (new rows may change the plan): a model draft's
        plan changes only with what its tries measure, and weighing every EXPLORE steps cost
        a few percent of a run that stays plain (about 1 ms a weighing at batch size 8).
        mix: mix_of(seqs), where the caller keeps it."""
        self._use_mix(self.mix_of(seqs) if mix is None else mix, num_rows)
        tried = self._winner is True and self._try_left > 0 and not self._speculated
        if tried:   # a try of plain goes on: its steps run as they do while plain leads
            if not self._cold:       # (those left unmeasured do not count among its steps)
                self._try_left -= 1
        else:
            step = self._since + 1   # (every interval is a multiple of EXPLORE)
            due = FAR_EXPLORE if self._far else self._interval
            if self._winner is not False or self._try_left or self._fresh or \
                    (not step % EXPLORE and (lookups and not step % self._far_gap or
                                             not step % MAX_EXPLORE or
                                             (step >= due and self._may_explore()))):
                return False
        self._since += 1
        self._speculated, self._trying = False, tried
        self._chosen = None if self._cold_step() else (False, num_rows, max(self.costs.at(
            mean_context(seqs)).decode_s(num_rows), 1e-12), tried)
        return True

    def _cold_step(self) -> bool:
        """Whether this plain step is one of the first plain_cold_steps (PLAIN_COLD_STEPS)
        after a speculating step, which are not measured (counted off here)."""
        if not self._cold:
            return False
        self._cold -= 1
        return True

    def _plan(self, rows: list[tuple[Sequence, str, int, bool]], probs: list[list[float]],
              skip: set[int], num_rows: int, extra_s: float = 0.0,
              costs: StepCosts | None = None):
        """The best speculating plan over rows not in skip, given each row's depth_probs:
        (slots admitted, its expected tokens per second, tokens, seconds, slot order, each
        slot's row, each slot's depth, each row's draft length); 0 slots when no row may
        draft. The plan is the one with the most tokens per second once extra_s, what a step
        costs besides the forwards (_overhead_s), is added to its seconds; the rate and
        seconds returned are the forwards' alone, as predictions are measured against.

        The slots are ordered and admitted in C++ (self.native) where it builds, else by
        _admit: plain Python floats there, since this runs at every step that weighs plans,
        and with numpy (arrays past 16 slots, its scalars below) it took 0.14 ms of a 5 ms
        step at 8 rows, T = 0 (the policy's share is benchmarks/step_phases.py's "propose,
        rest"); in Python, 0.11 ms of a 6.3 ms step at 32 rows on a CPU with AMX tiles."""
        costs = costs or self.costs
        if not rows:
            return 0, 0.0, 0.0, 0.0, [], [], [], []
        # a row sampled at T > 0 also pays, per slot, what sampling adds (verification's
        # share and, for a model draft, its draw: StepCosts.verify_token_s, draft_sample_s),
        # which the greedy forwards timed leave out: at 32 rows and T = 0.8 about a fifth
        # of a slot's price
        sampled = [costs.verify_token_s + (costs.draft_sample_s.get(src, 0.0) if is_model
                                           else 0.0)
                   if seq.params.temperature > 0 else 0.0
                   for seq, src, _, is_model in rows]
        # slots by survival per second of cost, most first (ties: shallower, then earlier
        # rows): a slot costs what its token adds to the target's forward, for a model
        # draft a row of its forward (on average over the step's rows) and, sampled, what
        # sampling adds. Where every row's slots cost the same, that is the order of
        # survival; where rows draft from a model and from a lookup, a free lookup draft
        # goes before a model's draft a little likelier to hold (by survival alone, routed
        # rows' model drafts at 32 rows came first, and the plans they made no longer beat
        # plain).
        sources = {(src, is_model) for _, src, _, is_model in rows}
        unit = None
        if len(sources) > 1 or min(sampled) != max(sampled):
            token_s = costs.verified_token_s(num_rows) + 1e-12
            draft_row = {src: costs.draft_row_s(src, len(rows))   # (once per draft)
                         for src, is_model in sources if is_model}
            unit = [token_s + sampled[i] + (draft_row[src] if is_model else 0.0)
                    for i, (_, src, _, is_model) in enumerate(rows)]
        # each model draft's cost grows with the rows it runs at each depth: a slot at
        # depth d adds one row to its source's forward at d. What the draft's calls measure
        # beyond their forwards (draft_scale: 2.2-2.9x at 32 rows) is not priced per slot: it
        # is the call's own (Python, the catch-up of the tokens its rows committed, which a
        # row pays whatever it drafts next), and it is in what speculating steps measure
        # beyond their prediction (extra_s). Scaled per slot, it priced a slot at 32 rows,
        # T = 0 at 0.092 ms where dropping one saved about 0.05, and plans held in the lead
        # drafted 1.9 tokens a row where a fixed k = 4 drafted 3.9 and made 10% more
        # (the ablation in docs/benchmarks.md, forty-sixth round).
        marginal = {src: costs.draft_marginal_list(src, len(rows))
                    for src, is_model in sources if is_model}
        windows = costs.windows_s(num_rows)     # the target's time for n slots
        if self.native is not None:
            index = {src: m for m, src in enumerate(marginal)}
            return self.native.plan(
                probs, [i in skip for i in range(len(rows))] if skip else [False] * len(rows),
                sampled, unit, [index[src] if is_model else -1 for _, src, _, is_model in rows],
                list(marginal.values()), windows, num_rows, extra_s)
        return self._admit(rows, probs, skip, num_rows, extra_s, sampled, unit, marginal,
                           windows)

    @staticmethod
    def _admit(rows, probs, skip, num_rows, extra_s, sampled, unit, marginal, windows):
        """_plan's slots ordered and admitted, in Python (kernels/policy_core.cpp's plan is
        the same in C++)."""
        survive, depth, row = [], [], []
        for i, row_probs in enumerate(probs):
            if i in skip:
                continue
            sp = 1.0
            for d, p in enumerate(row_probs):
                sp *= p
                survive.append(sp)
                depth.append(d)
                row.append(i)
        lengths = [0] * len(rows)
        if not survive:
            return 0, 0.0, 0.0, 0.0, [], row, depth, lengths
        if row[-1] == row[0]:     # one row: its slots in order of depth (survival falls)
            order = list(range(len(survive)))
        else:
            if unit is not None:
                keyed = [(-sp / unit[i], d, i, j)
                         for j, (sp, d, i) in enumerate(zip(survive, depth, row))]
            else:
                keyed = [(-sp, d, i, j)
                         for j, (sp, d, i) in enumerate(zip(survive, depth, row))]
            keyed.sort()     # (row, depth) pairs are unique: the slot's index never decides
            order = [j for _, _, _, j in keyed]
        level: dict[tuple[str, int], int] = {}
        most = len(windows) - 1
        best_rate, best, kept, drafts = -1.0, 0, 0.0, 0.0
        best_tokens = best_s = 0.0
        for n, j in enumerate(order, 1):
            kept += survive[j]
            _, src, _, is_model = rows[row[j]]
            if is_model:
                c = level.get((src, depth[j]), 0)
                level[(src, depth[j])] = c + 1
                drafts += marginal[src][c]
            drafts += sampled[row[j]]
            sec = windows[min(n, most)] + drafts
            tokens = num_rows + kept
            rate = tokens / max(sec + extra_s, 1e-12)
            if rate > best_rate:
                best_rate, best, best_tokens, best_s = rate, n, tokens, sec
        for j in order[:best]:
            lengths[row[j]] = max(lengths[row[j]], depth[j] + 1)
        return (best, best_tokens / max(best_s, 1e-12), best_tokens, best_s, order, row,
                depth, lengths)

    def _use_mix(self, mix: tuple, num_rows: int = 1) -> None:
        """Switch the measurements and the lead to those of this mix of temperatures (each
        rounded to 0.1) among the rows that may speculate, at this band of batch sizes
        (batch_band). What speculation measured at one temperature says little at another:
        at T = 0 it may be near break-even where at T = 0.8 it loses, and an engine that
        serves one job and then another (a worker, the bench's cells) would otherwise
        speculate at a loss until its averages caught up. Nor does what a side measured at
        a few rows hold at 32: what a step costs besides the forwards (Python, sampling,
        bookkeeping) is about the same at any batch size, so measured against the forwards
        it weighs far more at a few rows. With one state for all batch sizes, the steps at
        the end of a job of 32 rows (the last rows finishing, 1 to 6 at a time) left
        speculation's measured slowdown at 1.4-1.5 where full batches measure 1.1-1.2; the
        next job could start with it, find speculation far behind plain and run plain for
        80 steps of its 250 (benchmarks/policy_trace.py). A band first seen under the mix the
        engine was in starts from copies of that band's measurements (below)."""
        band = batch_band(num_rows)
        if mix == self._mix and band == self._band:
            return
        if self._mix is not None:    # (the first mix seen takes the state as it is)
            self._mixes[(self._mix, self._band)] = (
                self.measured, self.observed, self._winner, self._interval, self._since,
                self._far, self._draft_timed, self._tried_in_full)
            while len(self._mixes) > MAX_MIXES:          # the least recently left first
                del self._mixes[next(iter(self._mixes))]
            state = self._mixes.pop((mix, band), None)
            if state is None:
                # A band not seen before under this mix starts from what the band it comes
                # from measured (its own first steps of each side replace that: observed is
                # empty), not from the start-up costs alone: at 64 rows and T = 0.8 a job's
                # last 45 rows entered a band whose first lead the start-up costs gave to
                # speculation, whose plain side was never measured, and no try of plain came
                # in the few steps of each job's end (such an end lost about 1% of a job).
                # Its first try then needs not draft for every row (_behind) if the band it
                # comes from had one that did.
                same = mix == self._mix
                seed = {side: list(m) for side, m in self.measured.items()} if same else {}
                state = (seed, {}, None, EXPLORE, 0, False, {}, same and self._tried_in_full)
            self.measured, self.observed, self._winner, self._interval, self._since, \
                self._far, self._draft_timed, self._tried_in_full = state
            # a try of the mix left, ended or not, says nothing of this one's lead
            self._try_left, self._fresh, self._trying = 0, False, False
            self._far_gap = EXPLORE
            self._chosen = None
            self._unconfirmed = None
            self._draft_pred = {}
        self._mix, self._band = mix, band

    def _may_explore(self) -> bool:
        """Whether the tries so far leave room in EXPLORE_BUDGET for another."""
        return self._explore_s <= EXPLORE_BUDGET * self._busy_s

    def _lead_measured(self) -> bool:
        """Whether speculation leads on a try not yet confirmed by a try of plain (_switch)
        and its own steps have measured TRY_STEPS: a weighing that then finds plain ahead
        tries plain at once, not EXPLORE steps after the switch. The try that handed it
        the lead drafted for the rows least behind (_behind), and what it measured beyond
        its forwards understates what steps over every row do: at 32 rows and T = 0.8 a
        try drafting for about one row measured 2.2 ms beyond its forwards, the lead's
        steps 4.5 ms, and such a lead, held for EXPLORE steps at 0.7 of plain's pace, cost
        2% of its job."""
        return self._unconfirmed is not None and self.observed.get(True, 0) >= TRY_STEPS

    @staticmethod
    def _behind(rows: list[tuple[Sequence, str, int, bool]], num_rows: int) -> set[int]:
        """While plain leads, the rows a try of speculation leaves out: a model draft must
        first catch up on every token of its row it has not seen (the whole history of a
        long plain stretch, at 64 rows tens of thousands of tokens), so a try drafts only
        for the rows least behind, up to CATCH_UP_PER_ROW tokens per batch row in all. The
        row least behind is always drafted for: at small batches every row is further behind
        than the budget, and a try that drafts for no row would never be made.

        Not for the first try of a mix and band (choose_lengths): it drafts for every row,
        whatever the catch-up costs, once. A try that drafts for one row of 8 carries what a
        speculating step adds besides its window (the draft's call, scheduling with draft
        slots, the plans; such a step took 0.5-0.9 ms more than a plain one at 8-32 rows,
        benchmarks/policy_trace.py --tries) for a token or two, and the
        slowdown it measures, applied to the plan over every row, kept plain ahead at 8
        rows, T = 0, where speculation held in the lead makes 1.055x plain and the policy
        0.96x (benchmarks/policy_ab.py --speculation-leads). Measured over every row once,
        at 8 rows, T = 0 it took the lead: 1.02-1.04x against 0.98 in three paired runs of
        four. Tries in full every time cost 2-4% at 16 rows and 1-5% at 32-64, where
        speculation at best breaks even, in the catch-up of each try."""
        lag = sorted((len(seq) - seq.spec.num_draft_computed, i)
                     for i, (seq, _, _, is_model) in enumerate(rows) if is_model)
        budget, behind = CATCH_UP_PER_ROW * num_rows, set()
        for j, (tokens, i) in enumerate(lag):
            if tokens <= budget or j == 0:
                budget -= tokens
            else:
                behind.add(i)
        return behind

    def _slowdown(self, speculate: bool) -> float:
        """Predicted / measured tokens per second of recent steps of this side (plain or
        speculating): what the start-up costs and the acceptance estimates leave out
        (sampling, verification, the drafts' catch-up, bookkeeping, optimism in the slots
        chosen, a busier machine). A ratio of averages (tokens and seconds averaged apart),
        not an average of ratios: a speculating step's tokens vary from 1 to k+1 a row, and
        at small batches an average of per-step ratios would overstate the slowdown by far.
        A side not yet measured borrows the other's. Plain's rate is judged by it;
        speculation's plans by their measured excess (_corrected_rate)."""
        m = self.measured.get(speculate) or self.measured.get(not speculate)
        if m is None:
            return 1.0
        pred_tokens, pred_s, tokens, seconds = m
        return (pred_tokens / pred_s) / (tokens / seconds)

    def _corrected_rate(self, plan) -> float:
        """The plan's tokens per second once what speculating steps have measured beyond
        their predicted seconds (on average; plain's before speculation is measured) is
        added to its seconds, and its tokens are scaled by their measured / predicted tokens
        (optimism in the slots picked). An excess, not a ratio: most of what a speculating
        step costs beyond its forwards (the drafts' calls, verification, the plan itself)
        does not grow with its slots, and a try that drafted for 1-3 rows of 32 measured
        1.6-2.3x its forwards where steps of the plan over every row measured 1.16x: as a
        ratio, that excess multiplied into the full plan kept plain ahead where a fixed k
        made 1.09-1.18x plain. A negative excess (the machine faster than at start-up)
        takes at most half the plan's seconds off."""
        _, _, tokens, seconds = plan[:4]
        m = self.measured.get(True) or self.measured.get(False)
        if m is None:
            return tokens / max(seconds, 1e-12)
        return tokens * m[2] / m[0] / max(seconds + m[3] - m[1], 0.5 * seconds, 1e-12)

    def _pace(self, speculate: bool) -> float | None:
        """Tokens per second that a side's measured steps made (its averages: a lead's recent
        steps, a try's own), or None before it has measured one."""
        m = self.measured.get(speculate)
        return m[2] / m[3] if m is not None and m[3] > 0 else None

    def _speculation_measured_ahead(self) -> bool:
        """Whether speculation's measured steps (its lead's recent ones) made more tokens per
        second than plain's (a try's own steps, after a try of plain)."""
        spec, plain = self._pace(True), self._pace(False)
        return spec is not None and plain is not None and spec > plain

    def _overhead_s(self) -> float:
        """What a speculating step has measured beyond its predicted seconds, on average (a
        plain step's, before speculation is measured): scheduling, sampling, verification and
        bookkeeping, which the start-up costs (the forwards alone) leave out and most of
        which does not grow with the slots admitted (sampling at T > 0, which does, is
        priced per slot: StepCosts.verify_token_s, draft_sample_s).
        Plans are chosen as if each step also paid it: on the forwards alone, plans at
        32-64 rows and T = 0 made 3.27 tokens a pass where a fixed k = 4 made 3.73-3.82;
        with it, 3.26-3.71 (it moves with what the machine's drift adds to the measured
        steps), with no gain in tokens per second beyond the noise of the bench."""
        m = self.measured.get(True) or self.measured.get(False)
        return max(0.0, m[3] - m[1]) if m is not None else 0.0

    def _switch(self, speculate: bool, fresh: bool) -> None:
        """Hand the lead to `speculate`'s side. A lead of speculation that the first try of
        plain reverses was exploration too: its steps' seconds beyond plain's measured pace
        count against EXPLORE_BUDGET, and speculation is next tried at the interval it had
        before it took the lead, doubled. A try of speculation while plain
        leads drafts only for some rows (_behind), and the plan over every row it is weighed
        on can do worse than the try measured; without this, speculation at 64 rows and
        T = 0.8 took the lead and lost it every 20-30 steps. The first lead of a mix (no side
        led before) is the start-up costs' choice, not exploration, and is not charged: at
        32 rows and T = 0, a job's first lead of speculation over rows with no text yet for
        suffix drafts was reversed after 10 steps, and its charge held every try back for
        the next 400 steps of the job while speculation would have made 1.2x plain."""
        first = self._winner is None
        reversed_ = fresh and self._unconfirmed is not None
        if reversed_:
            lead_s, lead_tokens = self._unconfirmed
            pace = self.measured.get(speculate)
            if pace is not None and lead_tokens:
                self._explore_s += max(0.0, lead_s - lead_tokens * pace[3] / pace[2])
        interval = min(2 * self._interval_before, MAX_EXPLORE) if reversed_ else EXPLORE
        self._interval_before = self._interval
        self._winner, self._interval, self._since = speculate, interval, 0
        self._try_left = 0
        self._unconfirmed = [0.0, 0] if speculate and not first else None
        # The new leader's averages restart from its steps as leader (a try of speculation
        # may have drafted for a few rows only); the first step of speculation's lead, in
        # which the rows the try left out catch up, is a cost of switching, not measured.
        self.observed[speculate] = 0
        if speculate:
            self._speculated = False

    def _count_try(self, seconds: float, tokens: int, prompt_tokens: int = 0) -> None:
        """Add a measured step's seconds to the time measured and, for a step of a try
        (its first, unmeasured step too), what it took beyond the leading side's measured
        seconds per token for its tokens to what tries have cost (EXPLORE_BUDGET); a step
        of a lead not yet confirmed adds to that lead's account (_switch). The prompt
        tokens a step also ran (StepCosts.prompt_token_s each) are work either side does:
        their time counts in neither account, and a step with over 2 * PROMPT_TIMED of them
        is left out of both (its prompts' cost is known too roughly). Charged in full, one
        try's first step beside the prompts of 23 new rows (0.4 s) spent the budget of 40 s
        of steps at 32 rows, and no side was tried again for the rest of the job."""
        if not 0.0 < seconds < 10.0:   # (a pause of the process says nothing)
            return
        if prompt_tokens and self.costs is not None:
            seconds = max(0.0, seconds - prompt_tokens * self.costs.prompt_token_s)
        self._busy_s += seconds
        if prompt_tokens > 2 * PROMPT_TIMED:
            return
        lead = self.measured.get(bool(self._winner)) if self._winner is not None else None
        if self._trying and lead is not None and tokens:
            self._explore_s = max(0.0, self._explore_s + seconds - tokens * lead[3] / lead[2])
        elif not self._trying and self._unconfirmed is not None:
            self._unconfirmed[0] += seconds
            self._unconfirmed[1] += tokens

    def observe(self, seconds: float, tokens: int, prompt_tokens: int = 0,
                weight: float = 0.1) -> None:
        """Fold the measured time and tokens of the step whose lengths choose_lengths chose
        into its side's averages.

        The leading side's: means over its first 1/weight steps, EMAs after; a step of it
        counts at most twice (or half) its side's measured / predicted time, so that a
        burst of load on a busy machine moves it by at most a tenth. A try of the side
        behind replaces that side's averages by the means of the try's own steps: what it
        measured in its last try, often hundreds of steps ago, was measured at another
        speed of the machine, and once the try has measured its steps the two sides are
        weighed on measurements of the same stretch.

        A step that also ran prompt tokens beside the plan's rows (prompt_tokens; a row
        that samples its first token counts in the plan with one) has their cost added to
        its prediction (StepCosts.prompt_token_s); one with over 2 * PROMPT_TIMED of them
        is not measured. With speculation at 64 rows, rows finish at staggered steps and
        four steps in five admit a new row: measuring decode-only steps alone left the
        leading side unmeasured for hundreds of steps. A step more than 10x off the
        prediction (a one-time build, a pause of the process) is left out."""
        self._count_try(seconds, tokens, prompt_tokens)
        catch_up_s, self._catch_up_s = self._catch_up_s, 0.0
        if self._chosen is None:
            return
        speculate, pred_tokens, pred_s, tried = self._chosen
        self._chosen = None
        if tried and speculate:
            seconds -= catch_up_s
        if prompt_tokens:
            if prompt_tokens > 2 * PROMPT_TIMED:
                return
            pred_s += prompt_tokens * self.costs.prompt_token_s
        if not pred_s or not seconds or not tokens or \
                not 0.1 <= (pred_tokens / pred_s) / (tokens / seconds) <= 10.0:
            return
        n = self.observed[speculate] = self.observed.get(speculate, 0) + 1
        m = self.measured.setdefault(speculate, [pred_tokens, pred_s, tokens, seconds])
        if tried:
            self._try_measured += 1
            self._try_s += seconds
            w = 1 / self._try_measured
        else:
            if n > 1:    # (a side's first step replaces what a band's seed holds, as it is)
                usual = m[3] / m[1] * pred_s       # this step's time at the side's usual ratio
                seconds = min(max(seconds, usual / 2), usual * 2)
            w = max(weight, 1 / n)
        for i, v in enumerate((pred_tokens, pred_s, tokens, seconds)):
            m[i] += w * (v - m[i])
        if tried:
            self._fresh = self._try_measured >= MAX_TRY_STEPS or \
                (self._try_measured >= TRY_STEPS and
                 (self._try_s >= TRY_MIN_S or not speculate and self._plain_far_behind()))
            self._tried_in_full |= self._fresh and speculate
            if not self._fresh and not self._try_left:
                self._try_left = 1          # the try goes on

    def _plain_far_behind(self) -> bool:
        """Whether a try of plain has measured it below TRY_MARGIN of speculation's measured
        tokens per second: the try ends after TRY_STEPS measured steps, however short. At
        one row a step takes about 3 ms, so TRY_MIN_S took MAX_TRY_STEPS plain steps (a
        twelfth of a job of 16 rows of 64 tokens, at half speculation's pace), where the
        first three left no doubt. A try of speculation runs its steps in full: it drafts
        for some rows only (_behind), and its rate is not yet what it makes once it leads."""
        plain, spec = self._pace(False), self._pace(True)
        return plain is not None and spec is not None and plain < TRY_MARGIN * spec

