"""Speculation policy: which draft serves a request (by domain), how many tokens it may
draft this round (k, capped by max_tokens and the context), and when a request stops
speculating (rolling acceptance below min_acceptance, or sampled hotter than
max_spec_temperature)."""
from __future__ import annotations

from batchspec.config import EngineConfig
from batchspec.engine.sequence import Sequence


class SpecPolicy:
    def __init__(self, config: EngineConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

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
