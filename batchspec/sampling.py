"""Sampling parameters of one request (vLLM's field names and defaults)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

SEED_RANGE = (-2**63, 2**63)   # a seed is an int64


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 means greedy
    top_p: float = 1.0            # nucleus mass kept, (0, 1]
    top_k: int = 0                # 0 or -1: off
    max_tokens: int = 16
    seed: int | None = None       # None: derived from the LLM's seed and the request index
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (checked on decoded text)
    ignore_eos: bool = False

    def __post_init__(self):
        # (numbers of numpy's or torch's count as numbers; a bool or 1.5 tokens does not)
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("top_k", "max_tokens", "seed"):
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an integer, got {value!r}")
            setattr(self, name, int(value))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits (|seed| < 2**63), got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or \
                not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings (an empty "
                             f"one would stop at once), got {self.stop!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
