"""Speculation policy: which draft serves a request (by domain), how many tokens it may
draft this round (k, capped by max_tokens and the context; with adaptive_k, the k of the step
that maximises expected tokens per second), and when a request stops speculating (rolling
acceptance below min_acceptance, or sampled hotter than max_spec_temperature)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from batchspec.config import EngineConfig
from batchspec.contract import expected_tokens_per_pass
from batchspec.engine.sequence import Sequence

# Prior on a draft's per-token acceptance probability before its first rounds (p = 0.6
# worth 10 rounds), and the weight of the draft's pooled estimate in a request's own.
PRIOR_P, PRIOR_ROUNDS, REQUEST_PRIOR_ROUNDS = 0.6, 10, 4


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

    def draft_s(self, name: str, b: int) -> float:
        return self._at(self.draft[name], b) if b > 0 and name in self.draft else 0.0


class SpecPolicy:
    def __init__(self, config: EngineConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.costs: StepCosts | None = None        # set by the engine when adaptive_k
        self.pooled: dict[str, list[int]] = {}     # draft -> [accepted, rejections]
        self.step_ratio: dict[int, float] = {}     # k -> EMA of measured / predicted step
        self.predicted: dict[int, float] = {}      # k -> predicted seconds, this step

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

    # ---- adaptive k (goodput, SmartSpec-style) ----------------------------------------
    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Pool a round's outcome into its draft's acceptance estimate."""
        if num_drafted:
            pooled = self.pooled.setdefault(seq.spec.draft, [0, 0])
            pooled[0] += num_accepted
            pooled[1] += num_accepted < num_drafted

    def acceptance_p(self, seq: Sequence) -> float:
        """Per-token acceptance probability of seq's next drafts: its own rounds, shrunk
        towards its draft's pooled estimate (itself shrunk towards PRIOR_P)."""
        acc, rej = self.pooled.get(seq.spec.draft, (0, 0))
        p_draft = (acc + PRIOR_P * PRIOR_ROUNDS) / (acc + rej + PRIOR_ROUNDS)
        s = seq.spec
        return (s.num_accepted + p_draft * REQUEST_PRIOR_ROUNDS) / \
            (s.num_accepted + s.num_rejections + REQUEST_PRIOR_ROUNDS)

    def choose_k(self, spec_rows: dict[str, list[Sequence]], num_plain_rows: int) -> int:
        """The k (0..k_max) of this step that maximises expected tokens per second:
        sum over rows of E[tokens | p_i, k] over (target forward of the batch with k+1 tokens
        per speculating row + k forwards of each draft over its rows), from measured costs.
        k = 0 is a plain step. Rows that do not speculate count 1 token at any k."""
        costs, k_max = self.costs, self.config.num_speculative_tokens
        if costs is None or not spec_rows:
            return k_max
        ps = [self.acceptance_p(seq) for rows in spec_rows.values() for seq in rows]
        b_spec = len(ps)
        base = costs.target_s(b_spec + num_plain_rows, 1) - costs.target_s(b_spec, 1)
        draft_s = sum(costs.draft_s(name, len(rows)) for name, rows in spec_rows.items())
        best_k, best_rate = 0, 0.0
        for k in range(k_max + 1):
            tokens = num_plain_rows + sum(expected_tokens_per_pass(p, k) for p in ps)
            self.predicted[k] = base + costs.target_s(b_spec, k + 1) + k * draft_s
            rate = tokens / max(self.predicted[k] * self._ratio(k), 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _ratio(self, k: int) -> float:
        """Measured / predicted decode-step time for k (what the start-up costs leave out:
        sampling, verification, bookkeeping, a busier machine); an untried k borrows the ratio
        of the nearest tried one."""
        if k in self.step_ratio or not self.step_ratio:
            return self.step_ratio.get(k, 1.0)
        return self.step_ratio[min(self.step_ratio, key=lambda j: (abs(j - k), j))]

    def observe(self, k: int, seconds: float, weight: float = 0.1) -> None:
        """Fold a step's measured time into the correction of its k. A step more than 10x off
        the prediction (a one-time build, a pause of the process) is not a cost of its k and
        is left out: a k judged dear is rarely tried again to correct it."""
        predicted = self.predicted.get(k)
        if predicted and 0.1 <= seconds / predicted <= 10.0:
            r = seconds / predicted
            self.step_ratio[k] = r if k not in self.step_ratio else \
                (1 - weight) * self.step_ratio[k] + weight * r
