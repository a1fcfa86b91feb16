"""EngineConfig: the one configuration object built by the Python API, the CLI and the
Celery task alike. Validated and completed (derived values) in __post_init__."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from batchspec.contract import DEFAULT_NUM_SPECULATIVE_TOKENS, LOOKUP_SOURCES


def draft_sources(value: str) -> list[str]:
    """The sources one draft setting names: a model directory, 'ngram', 'suffix', or a model
    directory and a lookup source joined by '+' ('DIR+suffix'), between which each row
    chooses per round."""
    if value in LOOKUP_SOURCES or os.path.isdir(value):
        return [value]
    head, sep, tail = value.rpartition("+")
    return [head, tail] if sep and head and tail in LOOKUP_SOURCES else [value]


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without it bf16
    matmuls are emulated and slower than fp32."""
    return cpu_matmul_isa() in ("amx", "avx512_bf16")


def cpu_matmul_isa(flags: set[str] | None = None) -> str:
    """The widest matrix instructions of a CPU with these flags (default: this CPU's), the
    first of: amx (AMX bf16 tiles), avx512_bf16, avx512, avx2, other. Speed ratios between
    methods depend on it (what a verified token costs against a decoded one), so
    benchmarks record it."""
    if flags is None:
        flags = set(_cpuinfo().get("flags", "").split())
    for isa, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"),
                      ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return isa
    return "other"


def cpu_model() -> str:
    return _cpuinfo().get("model name", "unknown")


def default_dtype(model: str, device: str) -> str:
    """dtype="auto": on CUDA, bf16 (fp16 for fp16 checkpoints). On CPU, bf16 when the
    checkpoint is stored in bf16 and the CPU computes bf16 natively (halves the weight
    traffic, which bounds small-batch decoding), else fp32."""
    from batchspec.models.loader import stored_dtype
    stored = stored_dtype(model)
    if device.startswith("cuda"):
        return "float16" if stored == "float16" else "bfloat16"
    return "bfloat16" if stored == "bfloat16" and cpu_has_native_bf16() else "float32"


def rank_devices(device: str, size: int) -> list[str]:
    """One device per rank from one: cpu -> cpu each; cuda:N -> cuda:N, cuda:N+1, ..."""
    if size == 1 or device == "cpu":
        return [device] * size
    kind, _, index = device.partition(":")
    if kind != "cuda" or not (index or "0").isdigit():
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, got {device!r}")
    return [f"cuda:{int(index or 0) + r}" for r in range(size)]


def draft_vocab_for(temperature: float) -> bool:
    """Whether drafts at this temperature should score only their draft_vocab.json's tokens,
    where nobody said: greedy, yes; sampled, no. Sampled, the target picks a token outside
    the list about as often as the text uses one: at T = 0.8 the demo code draft's α was
    0.46 with its list of 1,024 tokens and 0.55 without (benchmarks/draft_vocab_alpha.py),
    and speculation at one row 1.43x plain against 1.62x; at T = 0.3 the two broke even (α
    0.68 against 0.67 at T = 0.2, 0.59 against 0.61 at 0.4); at T = 0 the list gained 1.8%
    (docs/benchmarks.md). The engine
    asks it for each row (Engine.source_for) where its config leaves the choice open."""
    return temperature == 0


def check_device(device: str) -> None:
    """Raise ValueError, saying what to do, for a device this process cannot use."""
    import re
    if device in ("auto", "cpu"):
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA (torch " + torch.__version__ + ")"
               if torch.version.cuda is None else "no CUDA device is visible")
        raise ValueError(f"device {device!r} is not available: {why}; use --device cpu "
                         f"(or auto)")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} "
                         f"CUDA device(s) are visible")


@dataclass
class EngineConfig:
    model: str
    drafts: dict[str, str] = field(default_factory=dict)  # domain -> HF dir, "ngram",
                                                          # "suffix" or "DIR+ngram|suffix"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    confidence_threshold: float = 0.0
    draft_vocab: bool | None = None   # a draft whose directory has draft_vocab.json scores
                                      # only those tokens (batchspec.spec.draft_vocab) for
                                      # every row (True), none (False), or for each row
                                      # whose temperature is 0 (None: draft_vocab_for)
    device: str = "auto"              # auto | cpu | cuda | cuda:N; with tensor parallelism
                                      # one device per rank ("cuda:0,cuda:1"), or the first
                                      # one (cuda:N: ranks on cuda:N, cuda:N+1, ...)
    tensor_parallel_size: int | None = None  # ranks the target is sharded over; None: one
                                      # per device listed in `device`
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16; auto: see
                                      # default_dtype
    seed: int = 0
    # paged KV cache and batching
    block_size: int | None = None     # tokens per KV block; None: 16 (torch), 256 (flash)
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # None: 1 GiB on CPU, 90% of free memory on GPU
    # CPU: write every page of the KV cache at start-up, not as rows first use it, so that
    # no step pays page faults (models/llama.py: zeroed; batchspec bench sets it)
    prefault_kv_cache: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True  # share the KV blocks of identical prompt prefixes
    attention_backend: str = "auto"   # auto | torch | flash
    num_threads: int | None = None    # CPU intra-op threads; None: 1 for models < 50M params
                                      # on CPU, else torch's default
    verify_backend: str = "auto"      # auto | cuda | cpu | torch
    # speculation policy
    fallback_window: int = 100
    fallback_min_drafted: int = 50
    min_acceptance: float = 0.4
    max_spec_temperature: float | None = None
    adaptive_k: bool = False          # per step, the k in 0..num_speculative_tokens with the
                                      # most expected tokens/s (costs measured at start-up)
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_max_tokens: int = 16_384   # output tokens a domain's job-wide suffix trie holds
    suffix_min_prob: float = 0.1      # a suffix draft stops where its estimated probability
                                      # falls below this

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a Hugging Face model directory")
        if not isinstance(self.drafts or {}, dict):
            raise ValueError(f"drafts must map a domain to its draft ({{'default': PATH}}), "
                             f"got {type(self.drafts).__name__}")
        self.drafts = {str(k): str(v) for k, v in (self.drafts or {}).items()}
        for domain in self.drafts:
            # the engine names the sources it adds beside domain D's draft D+vocab, D+ngram
            # and D+suffix (its vocabulary's scorer, its routed lookup); a domain of that
            # name would take their place in the engine and in the records
            base, plus, kind = domain.rpartition("+")
            if plus and base in self.drafts and kind in ("vocab", *LOOKUP_SOURCES):
                raise ValueError(
                    f"domain {domain!r} has the name of the {kind} source batchspec adds "
                    f"for domain {base!r}: rename the domain")
        for domain, value in self.drafts.items():
            path = draft_sources(value)[0]
            if path not in LOOKUP_SOURCES and not os.path.isdir(path):
                raise FileNotFoundError(
                    f"draft for domain {domain!r}: {path!r} is not a directory (give a "
                    f"Hugging Face model directory, 'ngram', 'suffix' or DIR+ngram|suffix)")
        if self.draft_vocab is not False:   # a bad list fails here, where a job is submitted
            from batchspec.spec import draft_vocab
            for value in self.drafts.values():
                if (path := draft_sources(value)[0]) not in LOOKUP_SOURCES:
                    draft_vocab.load(path)
        if not os.path.isdir(self.model):
            raise FileNotFoundError(
                f"model {self.model!r} is not a directory: give a Hugging Face model "
                f"directory with config.json and *.safetensors")
        from batchspec.models.loader import check_model_files  # (no torch)
        # the target first, then each draft once (a set's order would make the error of a
        # job with two broken models vary from run to run)
        for path in dict.fromkeys([self.model,
                                   *(draft_sources(v)[0] for v in self.drafts.values())]):
            if path not in LOOKUP_SOURCES:
                check_model_files(path)
        if isinstance(self.num_speculative_tokens, bool) or \
                not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got "
                             f"{self.num_speculative_tokens!r}")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError("confidence_threshold must be in [0, 1)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "flash"):
            raise ValueError("attention_backend must be auto, torch or flash")
        if self.verify_backend not in ("auto", "cuda", "cpu", "torch"):
            raise ValueError("verify_backend must be auto, cuda, cpu or torch")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError("min_acceptance must be in [0, 1]")
        if self.fallback_window < 1 or self.fallback_min_drafted < 1:
            raise ValueError("fallback_window and fallback_min_drafted must be >= 1")
        if self.suffix_max_tokens < 0 or not 0.0 <= self.suffix_min_prob <= 1.0:
            raise ValueError("suffix_max_tokens must be >= 0 and suffix_min_prob in [0, 1]")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        for device in self.device.split(","):
            check_device(device.strip())
        if self.device == "auto":
            import torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._set_rank_devices()
        if self.dtype == "auto":
            self.dtype = default_dtype(self.model, self.device)
        if self.attention_backend == "auto":
            self.attention_backend = "torch"
            if self.device.startswith("cuda") and self.dtype != "float32":  # flash: 16-bit only
                from batchspec.layers.attention import flash_available
                if flash_available():
                    self.attention_backend = "flash"
        if self.block_size is None:
            self.block_size = 256 if self.attention_backend == "flash" else 16
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.attention_backend == "flash" and self.block_size % 256:
            raise ValueError("flash-attn reads a paged KV cache in blocks of a multiple of "
                             "256 tokens: set block_size=256 (or attention_backend='torch')")

    def _set_rank_devices(self) -> None:
        """`device` as one device per tensor-parallel rank, comma-separated."""
        names = [d.strip() for d in self.device.split(",")]
        size = len(names) if self.tensor_parallel_size is None else self.tensor_parallel_size
        if size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if len(names) == 1:
            names = rank_devices(names[0], size)
            for device in names[1:]:
                check_device(device)
        if len(names) != size:
            raise ValueError(f"device lists {len(names)} devices for tensor_parallel_size "
                             f"{size}: give one device per rank")
        if len({d.split(":")[0] for d in names}) > 1 or "auto" in names or \
                (names[0] != "cpu" and len(set(names)) < size):
            raise ValueError(f"the ranks' devices must be distinct CUDA devices or all cpu, "
                             f"got {self.device!r}")
        self.tensor_parallel_size = size
        self.device = ",".join(names)
        if size > 1:
            from batchspec.layers.parallel import check_shardable
            from batchspec.models.loader import read_config
            cfg = read_config(self.model)
            check_shardable(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, size)

    @property
    def devices(self) -> list[str]:
        """One device per tensor-parallel rank; rank 0 (and every draft) runs on the first."""
        return self.device.split(",")

    @property
    def speculative(self) -> bool:
        return bool(self.drafts) and self.num_speculative_tokens > 0
