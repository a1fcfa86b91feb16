"""Offline API: LLM(...).generate(prompts, params) -> list[RequestOutput]."""
from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from batchspec.config import EngineConfig
from batchspec.contract import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    Request,
    RequestError,
    acceptance_record,
)
from batchspec.engine.engine import Engine
from batchspec.engine.sequence import Sequence
from batchspec.sampling import SamplingParams


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic collector's reach
    (gc.freeze), as a process that owns its engine does once the models are loaded. The
    import and load heap (over 300,000 objects with torch and transformers) is static, yet
    every full collection scanned it: 0.15 s a pause on the 2-core CPU VM, landing on
    whichever step allocated then. Objects frozen by an earlier call are unfrozen first, so
    an engine dropped since is collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str            # stop | length | abort
    domain: str | None = None
    draft: str | None = None      # the draft (path or "ngram") that served it; None: plain
    latency_s: float = 0.0        # from generate() receiving it to its last token
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    stats: dict = field(default_factory=dict)  # the acceptance record (batchspec.contract)


class LLM:
    def __init__(self, model: str, drafts: dict[str, str] | None = None,
                 num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 confidence_threshold: float = 0.0,
                 device: str = "auto", dtype: str = "auto", seed: int = 0, **kwargs):
        config = EngineConfig(model=model, drafts=drafts or {},
                              num_speculative_tokens=num_speculative_tokens,
                              confidence_threshold=confidence_threshold, device=device,
                              dtype=dtype, seed=seed, **kwargs)
        self._init(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        self = cls.__new__(cls)
        self._init(config)
        return self

    def _init(self, config: EngineConfig) -> None:
        self.config = config
        self._closed = False
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len

    # ---- inputs ------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """str | list[int] | list[{"role", "content"}] -> token ids (chat template for
        messages). Raises RequestError saying what is wrong with the prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty_prompt", "empty prompt")
            self._need_tokenizer()
            # (verbose=False: the tokenizer's warning about its model_max_length; the
            # engine's own check of the prompt's length says what to do)
            return list(self.tokenizer.encode(prompt, add_special_tokens=False, verbose=False))
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict)
                                                                 for m in prompt):
            self._need_tokenizer()
            if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in prompt):
                raise RequestError("invalid_prompt", "messages need string 'role' and 'content'")
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise RequestError("invalid_prompt",
                                   "the model's tokenizer has no chat template for messages")
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True,
                                                      tokenize=False)
            # (what tokenize=True does, without the warning: the template writes the
            # special tokens itself)
            return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not
                                                    isinstance(t, bool) for t in prompt):
            if not prompt:
                raise RequestError("empty_prompt", "empty prompt")
            return list(prompt)
        raise RequestError("invalid_prompt", f"a prompt must be a string, a list of token ids "
                                             f"or a list of messages, got {type(prompt).__name__}")

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("invalid_prompt", f"model {self.config.model!r} has no tokenizer "
                                                 f"files: give token-id prompts")

    def make_request(self, prompt, params: SamplingParams, request_id: str,
                     domain: str | None = None) -> Request:
        """Encode and check one prompt: the one place a request is validated. Raises
        RequestError (kind: empty_prompt, invalid_prompt, prompt_too_long)."""
        ids = self.encode(prompt)
        if not ids:
            raise RequestError("empty_prompt", "prompt encodes to no tokens")
        vocab = self.engine.target.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError("invalid_prompt", f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestError("prompt_too_long", f"prompt has {len(ids)} tokens; the context "
                                                  f"holds {self.max_model_len} (prompt + at "
                                                  f"least one generated token)")
        return Request(str(request_id), ids, params, domain)

    # ---- generation --------------------------------------------------------------------
    def add(self, requests: Seq[Request]) -> list[Sequence]:
        """Queue made requests without running them; `step()` runs the engine and
        `output(seq)` turns a finished sequence into a RequestOutput."""
        return [self.engine.add_request(r) for r in requests]

    def add_requests(self, prompts: Seq, params: SamplingParams | Seq[SamplingParams] | None = None,
                     domains: Seq[str | None] | None = None,
                     request_ids: Seq[str] | None = None) -> list[Sequence]:
        """Make and queue requests (see make_request). Raises ValueError (naming the prompt)
        before anything is queued."""
        if self._closed or self.engine.closed:
            raise RuntimeError("this LLM is closed: make another to generate")
        if isinstance(prompts, str):      # one prompt (vLLM's generate takes one too)
            prompts = [prompts]
        elif not isinstance(prompts, list | tuple):
            try:
                prompts = list(prompts)
            except TypeError:
                raise TypeError(f"prompts must be a string or a list of prompts, got "
                                f"{type(prompts).__name__}") from None
        n = len(prompts)
        if params is None:
            params = SamplingParams()
        params = [params] * n if isinstance(params, SamplingParams) else list(params)
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be a SamplingParams or a list of them, one a prompt")
        domains = [None] * n if domains is None else list(domains)
        ids = [str(i) for i in range(n)] if request_ids is None else [str(r) for r in request_ids]
        if not (len(params) == len(domains) == len(ids) == n):
            raise ValueError("params, domains and request_ids must match prompts in length")
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                requests.append(self.make_request(prompt, params[i], ids[i], domains[i]))
            except RequestError as e:
                raise ValueError(f"prompt {i} ({ids[i]}): {e}") from None
        return self.add(requests)

    def close(self) -> None:
        """Release the engine (stops a tensor-parallel target's rank processes); garbage
        collection does the same. The LLM cannot generate afterwards."""
        self._closed = True
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has_waiting(self) -> bool:
        """Whether queued requests are still waiting to be admitted to the batch."""
        return bool(self.engine.scheduler.waiting)

    def step(self) -> tuple[list[Sequence], int]:
        """One engine step over everything queued: (sequences finished, tokens generated)."""
        return self.engine.step()

    def generate(self, prompts: Seq, params: SamplingParams | Seq[SamplingParams] | None = None,
                 domains: Seq[str | None] | None = None, use_tqdm: bool = True,
                 request_ids: Seq[str] | None = None,
                 should_abort: Callable[[], bool] | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        seqs = self.add_requests(prompts, params, domains, request_ids)
        n = len(seqs)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=n, desc="generate", unit="req", file=sys.stderr, dynamic_ncols=True)
        done = generated = 0
        t0 = time.perf_counter()
        try:
            while self.engine.has_unfinished():
                if should_abort is not None and should_abort():
                    self.engine.abort_all()
                    break
                finished, num_tokens = self.engine.step()
                done += len(finished)
                generated += num_tokens
                if bar is not None:
                    bar.update(len(finished))
                    bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - t0):.0f}")
                if on_progress is not None:
                    on_progress(done, generated)
        finally:
            if bar is not None:
                bar.close()
            if self.engine.has_unfinished():  # interrupted: leave the engine clean
                self.engine.abort_all()
        return [self.output(s) for s in seqs]

    def output(self, seq: Sequence) -> RequestOutput:
        c = self.config
        name = seq.spec.draft
        draft_path = c.drafts.get(name) if name else None
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if seq.stop_text_len is not None:
                text = text[:seq.stop_text_len]
        stats = acceptance_record(
            seq, target=c.model, draft_path=draft_path,
            k_max=c.num_speculative_tokens if name else 0,
            confidence_threshold=c.confidence_threshold,
            cost_ratio=self.engine.cost_ratio(seq.spec.source) if name else 0.0)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids, text=text, finish_reason=seq.finish_reason or "abort",
            domain=seq.domain, draft=draft_path, stats=stats,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            latency_s=(seq.finish_time or seq.arrival_time) - seq.arrival_time)
