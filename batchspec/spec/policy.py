"""Speculation policy: which draft serves a request (by domain), how many tokens it may
draft this round (k, capped by max_tokens and the context; with adaptive_k, each row's length
from the draft slots, across all rows, that maximise the step's expected tokens per second),
and when a request stops speculating (rolling acceptance below min_acceptance, or sampled
hotter than max_spec_temperature)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from batchspec.config import EngineConfig
from batchspec.engine.sequence import Sequence

# Prior on a source's per-depth acceptance probability before its first rounds (p = 0.6
# worth 10 rounds), and the weights (in rounds) of the source's pooled estimate in its
# domain's and of the domain's in a request's own.
PRIOR_P, PRIOR_ROUNDS, DOMAIN_PRIOR_ROUNDS, REQUEST_PRIOR_ROUNDS = 0.6, 10, 10, 4
MAX_P = 0.98
# Every EXPLORE-th choice takes the other side (plain when the best plan speculates, the best
# speculating plan when it is plain), so that both sides' timing corrections come from steps
# of their own: a side never tried would borrow the other's and keep the start-up model's
# bias between them (e.g. verification costs it leaves out).
EXPLORE = 10


@dataclass
class StepCosts:
    """Measured seconds of one target forward over B rows of q tokens each (q = 1..k+1), and
    of one forward of each draft over B rows of one token, at a grid of batch sizes;
    linear in B between grid points (and beyond the last, from the last two)."""
    batch_sizes: list[int]
    target: dict[int, list[float]] = field(default_factory=dict)   # q -> seconds per B
    draft: dict[str, list[float]] = field(default_factory=dict)    # draft -> seconds per B

    def _at(self, values: list[float], b: int) -> float:
        xs = self.batch_sizes
        if len(xs) == 1:
            return values[0] * b / xs[0]
        i = min(max(bisect.bisect_left(xs, b), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], values[i - 1], values[i]
        return max(0.0, y0 + (y1 - y0) * (b - x0) / (x1 - x0))

    def target_s(self, b: int, q: int) -> float:
        return self._at(self.target[q], b) if b > 0 else 0.0

    def smooth(self) -> None:
        """Measured timings are noisy (a shared machine, one timing per shape): at each batch
        size, replace the target's times over q = 1..k+1 by their least-squares line in q
        (slope at least 0: more tokens never cost less), then make every shape's times
        non-decreasing in B."""
        qs = sorted(self.target)
        if len(qs) > 1:
            q_mean = sum(qs) / len(qs)
            for i in range(len(self.batch_sizes)):
                ts = [self.target[q][i] for q in qs]
                t_mean = sum(ts) / len(ts)
                slope = max(0.0, sum((q - q_mean) * (t - t_mean) for q, t in zip(qs, ts)) /
                            sum((q - q_mean) ** 2 for q in qs))
                for q in qs:
                    self.target[q][i] = t_mean + slope * (q - q_mean)
        for values in (*self.target.values(), *self.draft.values()):
            for i in range(1, len(values)):
                values[i] = max(values[i], values[i - 1])

    def target_tokens_s(self, b: int, num_tokens: int) -> float:
        """Target forward over b rows holding num_tokens tokens in all (ragged windows):
        interpolated between the uniform shapes of q = floor and ceil of the mean."""
        if b <= 0:
            return 0.0
        q_max = max(self.target)
        q = min(max(num_tokens / b, 1.0), float(q_max))
        lo = int(q)
        hi = min(lo + 1, q_max)
        t_lo = self.target_s(b, lo)
        return t_lo + (q - lo) * (self.target_s(b, hi) - t_lo)

    def draft_s(self, name: str, b: int) -> float:
        return self._at(self.draft[name], b) if b > 0 and name in self.draft else 0.0


class SpecPolicy:
    def __init__(self, config: EngineConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.costs: StepCosts | None = None        # set by the engine when adaptive_k
        # source, or (source, domain) -> (accepted, judged) per depth
        self.pooled: dict[str | tuple, tuple[list[int], list[int]]] = {}
        self.ratio = 1.0                            # EMA of measured / predicted, all steps
        self.step_ratio: dict[int, float] = {}     # step key -> EMA of its ratio / self.ratio
        self.observed: dict[int, int] = {}         # step key -> steps observed
        self.num_choices = 0
        self._chosen: tuple[int, float] | None = None  # (key, predicted s) of this step

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
               num_accepted: int) -> None:
        """Count a round's per-depth outcome in the request's own estimates for its source
        (on its SpecState) and in the source's pooled ones (overall and for the domain)."""
        if not num_drafted or source is None:
            return
        own = seq.spec.source_depth.setdefault(source, ([], []))
        for acc, judged in (own, self.pooled.setdefault(source, ([], [])),
                            self.pooled.setdefault((source, seq.domain), ([], []))):
            while len(judged) < num_drafted:
                acc.append(0)
                judged.append(0)
            for d in range(min(num_drafted, num_accepted + 1)):
                judged[d] += 1
                acc[d] += d < num_accepted

    def depth_probs(self, seq: Sequence, source: str, n: int) -> list[float]:
        """Estimated probability that seq's draft at depth d (d < n) from `source` is accepted
        given that every draft before it was: the request's own counts at that depth, shrunk
        towards the source's pooled estimate for the request's domain, itself shrunk towards
        the source's estimate over all domains, shrunk towards the estimate one depth
        shallower (PRIOR_P at depth 0). Estimates are capped at 0.98 (no slot is certain)."""
        src = self.pooled.get(source, ((), ()))
        dom = self.pooled.get((source, seq.domain), ((), ()))
        own = seq.spec.source_depth.get(source, ((), ()))
        out, parent = [], PRIOR_P
        for d in range(n):
            p = parent
            for (acc, judged), weight in ((src, PRIOR_ROUNDS), (dom, DOMAIN_PRIOR_ROUNDS),
                                          (own, REQUEST_PRIOR_ROUNDS)):
                if d < len(judged):
                    p = (acc[d] + weight * p) / (judged[d] + weight)
            out.append(min(p, MAX_P))
            parent = out[-1]
        return out

    def expected_tokens(self, seq: Sequence, source: str, n: int) -> float:
        """Expected tokens of a round in which `source` drafts n tokens for seq: the
        accepted drafts (sum of survival probabilities) and the target's token."""
        tokens, survive = 1.0, 1.0
        for p in self.depth_probs(seq, source, n):
            survive *= p
            tokens += survive
        return tokens

    def prefer_lookup(self, seq: Sequence, model: str, lookup: str, found: int,
                      cost_ratio: float) -> bool:
        """Routing of a row served by a model draft and a lookup source: whether the drafts
        the lookup found this round (`found` tokens, free to make) promise at least the
        tokens per target-pass cost of k model drafts (each costing cost_ratio of a pass),
        by the row's estimates for each source (shrunk towards its domain's and the
        source's pooled ones)."""
        if not found:
            return False
        k = self.lookahead(seq)
        by_model = self.expected_tokens(seq, model, k) / (1.0 + k * cost_ratio)
        return self.expected_tokens(seq, lookup, found) >= by_model

    def choose_lengths(self, rows: list[tuple[Sequence, str, int, bool]],
                       num_plain_rows: int) -> list[int]:
        """Draft lengths for this step's speculating rows, from slots admitted across all rows
        in order of survival probability (the product of the row's per-depth acceptance
        estimates up to the slot), keeping the number of slots at which the step's expected
        tokens per second, from the measured costs and their online correction, is highest
        (0 slots: the plain step). rows: (seq, source, most drafts, source is a model), the
        most drafts of a lookup source being the drafts it has already found. Rows that do
        not speculate count one token."""
        costs = self.costs
        self._chosen = None
        if costs is None:
            return [n for _, _, n, _ in rows]
        slots = []
        for i, (seq, source, n, _) in enumerate(rows):
            survive = 1.0
            for d, p in enumerate(self.depth_probs(seq, source, n)):
                survive *= p
                slots.append((-survive, d, i))
        slots.sort()
        num_rows = len(rows) + num_plain_rows
        levels: dict[str, list[int]] = {}   # model source -> rows drafting at each depth
        tokens = float(num_rows)
        draft_s = 0.0
        best_n, best_pred = 0, costs.target_tokens_s(num_rows, num_rows)
        plain_pred = predicted = best_pred
        best_rate = tokens / max(predicted * self._ratio(0), 1e-12)
        spec_n, spec_pred, spec_rate = 0, 0.0, 0.0   # the best plan that speculates
        for n, (neg_survive, d, i) in enumerate(slots, 1):
            _, source, _, is_model = rows[i]
            tokens -= neg_survive
            if is_model:
                level = levels.setdefault(source, [])
                if d == len(level):
                    level.append(0)
                draft_s += costs.draft_s(source, level[d] + 1) - costs.draft_s(source, level[d])
                level[d] += 1
            predicted = costs.target_tokens_s(num_rows, num_rows + n) + draft_s
            rate = tokens / max(predicted * self._ratio(self._key(n, num_rows)), 1e-12)
            if rate > best_rate:
                best_n, best_rate, best_pred = n, rate, predicted
            if rate > spec_rate:
                spec_n, spec_rate, spec_pred = n, rate, predicted
        self.num_choices += 1
        if self.num_choices % EXPLORE == 0 and spec_n:
            best_n, best_pred = (0, plain_pred) if best_n else (spec_n, spec_pred)
        lengths = [0] * len(rows)
        for _, d, i in slots[:best_n]:
            lengths[i] = max(lengths[i], d + 1)
        self._chosen = (self._key(best_n, num_rows), best_pred)
        return lengths

    def _key(self, num_slots: int, num_rows: int) -> int:
        """Which online correction a step uses: its drafts per row, rounded (at least 1 when
        it drafts at all), so that steps of similar shape share one."""
        if num_slots == 0:
            return 0
        return max(1, min(self.config.num_speculative_tokens, round(num_slots / num_rows)))

    def _ratio(self, key: int) -> float:
        """Measured / predicted decode-step time (what the start-up costs leave out:
        sampling, verification, bookkeeping, a busier machine): the ratio of all recent
        steps times the relative ratio of steps of this key; an untried key borrows the
        relative ratio of the nearest tried one."""
        rel = self.step_ratio
        if key not in rel and rel:
            key = min(rel, key=lambda j: (abs(j - key), j))
        return self.ratio * rel.get(key, 1.0)

    def observe(self, seconds: float, weight: float = 0.1) -> None:
        """Fold the measured time of the step whose lengths choose_lengths chose into the
        corrections: the overall ratio (which follows the machine's load) and, relative to
        it, its key's (what the model misses for steps of that shape). A step more than 10x
        off the prediction (a one-time build, a pause of the process) is left out, and one
        step moves a key's relative ratio by at most a factor of 2 before averaging, so a
        burst of load on a busy machine cannot condemn a shape that is rarely retried."""
        if self._chosen is None:
            return
        key, predicted = self._chosen
        self._chosen = None
        if not predicted or not 0.1 <= seconds / predicted <= 10.0:
            return
        r = seconds / predicted
        first = not self.step_ratio
        rel = min(max(r / self.ratio, 0.5), 2.0) if not first else 1.0
        n = self.observed[key] = self.observed.get(key, 0) + 1
        total = sum(self.observed.values())
        # a plain mean over the first 1/weight observations, an EMA after
        self.ratio = r if first else self.ratio + max(weight, 1 / total) * (r - self.ratio)
        old = self.step_ratio.get(key, rel)
        self.step_ratio[key] = old + max(weight, 1 / n) * (rel - old)
